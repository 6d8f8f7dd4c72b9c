"""The flight recorder, phases and instrument()/uninstrument() in this process.

The instrumented calls run on a real gloo process group of one rank (a HashStore rendezvous);
tests/watching/test_watchdog_multirank.py checks the records of every op across 3 ranks.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ncclguard import configure, phase
from ncclguard.recording import instrument as ins
from ncclguard.recording import sites
from ncclguard.recording.flight import FlightRecorder, recorder
from ncclguard.recording.instrument import INSTRUMENTED_OPS, instrument, is_instrumented, uninstrument
from ncclguard.recording.phase import current_phase, main_thread_phase
from ncclguard.recording.record import LASTI, WHERE
from ncclguard.recording.sites import call_site

HERE = __file__


def line() -> int:
    return sys._getframe(1).f_lineno


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    uninstrument()
    dist.destroy_process_group()


@pytest.fixture
def fresh(wrapper_kind):
    """A cleared recorder; instrument() installs the compiled wrapper (_hotpath.c) or the generated
    Python one: every test that instruments runs with both."""
    return recorder


# ----------------------------------------------------------------------------- the recorder


def test_sequence_numbers_count_per_group_and_point_to_point_apart():
    rec = FlightRecorder(size=10)
    a1 = rec.start("all_reduce(SUM)", "0", 4, "float32")
    rec.finish(a1)
    b1 = rec.start("broadcast", "7", 2, "int64")
    rec.start("all_reduce(SUM)", "0", 4, "float32")
    s1 = rec.start("send", "0", 4, "float32", peer=1)
    rec.finish(s1)
    rec.finish(b1, RuntimeError("Connection closed by peer"))
    assert [(r.op, r.group, r.seq) for r in rec.records()] == [
        ("all_reduce(SUM)", "0", 1),
        ("broadcast", "7", 1),
        ("all_reduce(SUM)", "0", 2),
        ("send", "0", 1),
    ]
    assert rec.last_seq() == {"0": 2, "7": 1, "0:p2p": 1}
    assert rec.last_completed() == {"0": 1, "0:p2p": 1}
    assert [r.seq for r in rec.inflight()] == [2]
    assert (b1.state, b1.error) == ("failed", "Connection closed by peer")
    assert (a1.state, a1.error, a1.end is not None) == ("completed", None, True)


def test_ring_keeps_the_newest_records_and_resizes():
    rec = FlightRecorder(size=3)
    for _ in range(5):
        rec.finish(rec.start("barrier", "0", 0, ""))
    assert [r.seq for r in rec.records()] == [3, 4, 5]
    assert [r.seq for r in rec.records(last=2)] == [4, 5]
    rec.resize(2)
    assert rec.size == 2 and [r.seq for r in rec.records()] == [4, 5]


def test_default_size_comes_from_the_config():
    configure(flight_records=7)
    assert FlightRecorder().size == 7
    assert FlightRecorder(size=None).size == 7


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="positive int"):
        FlightRecorder(size=bad)
    with pytest.raises(ValueError, match="positive int"):
        FlightRecorder(size=3).resize(bad)


def test_record_carries_phase_site_and_thread():
    rec = FlightRecorder(size=4)
    with phase("eval", batch=37):
        r = rec.start("all_reduce(SUM)", "0", 1, "float32", site=call_site(1))
        here = line() - 1  # the line above
    assert r.phase == "eval batch=37"
    assert r.site == f"{HERE}:{here}"
    assert r.thread == threading.get_ident()
    assert r.to_dict()["site"] == r.site and "work" not in r.to_dict()


def test_busy_while_a_record_is_open_in_this_thread_only():
    rec = FlightRecorder(size=4)
    r = rec.start("all_reduce(SUM)", "0", 1, "float32")
    other = []
    t = threading.Thread(target=lambda: other.append(rec.busy()))
    t.start()
    t.join()
    assert rec.busy() is True and other == [False]
    rec.finish(r)
    assert rec.busy() is False


# ----------------------------------------------------------------------------- phases


def test_phases_nest_and_read_as_a_path():
    assert current_phase() == ""
    with phase("train", step=1201):
        with phase("eval", batch=37):
            assert current_phase() == "train step=1201 > eval batch=37"
        assert current_phase() == "train step=1201"
    assert current_phase() == ""


def test_phase_as_decorator_and_seen_from_another_thread():
    seen = []

    @phase("checkpoint", step=9)
    def save():
        t = threading.Thread(target=lambda: seen.append((main_thread_phase(), current_phase())))
        t.start()
        t.join()

    save()
    assert seen == [("checkpoint step=9", "")]  # the main thread's phase, and the worker's own (none)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_phase_needs_a_name(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        phase(bad)


# ----------------------------------------------------------------------------- instrument()


def test_uninstrument_gives_back_the_exact_originals(fresh):
    before = {name: getattr(dist, name) for name in INSTRUMENTED_OPS}
    c10d_before = {name: getattr(c10d, name) for name in INSTRUMENTED_OPS}
    assert instrument() == sorted(INSTRUMENTED_OPS)
    assert instrument() == sorted(INSTRUMENTED_OPS)  # idempotent: wrapped once
    for name in INSTRUMENTED_OPS:
        assert getattr(dist, name) is not before[name]
        assert getattr(c10d, name) is getattr(dist, name)
        assert getattr(dist, name).__ncclguard_original__ is before[name]
        assert getattr(dist, name).__wrapped__ is before[name]
    assert is_instrumented("all_reduce")
    assert uninstrument() == sorted(INSTRUMENTED_OPS)
    for name in INSTRUMENTED_OPS:
        assert getattr(dist, name) is before[name]
        assert getattr(c10d, name) is c10d_before[name]
    assert not is_instrumented("all_reduce")
    assert uninstrument() == []


def test_instrument_refuses_unknown_names(fresh):
    with pytest.raises(ValueError, match="all_reduce_coalesced"):
        instrument(["all_reduce", "all_reduce_coalesced"])
    assert not is_instrumented("all_reduce")


def test_instrumented_calls_are_recorded(world_of_one, fresh):
    instrument()
    t = torch.ones(5, dtype=torch.float64)
    with phase("train", step=3):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sync_line = line() - 1  # the line above
        work = dist.all_reduce(tensor=t, async_op=True)
        work.wait()
        dist.broadcast(t, src=0)
        dist.barrier()
        dist.all_gather_object([None], {"step": 3})  # torch's helper: two all_gathers inside
    recorder.sweep()
    got = [(r.seq, r.op, r.group, r.numel, r.dtype, r.state, r.async_op, r.phase) for r in recorder.records()]
    world = c10d._get_default_group().group_name
    assert got[:4] == [
        (1, "all_reduce(MAX)", world, 5, "float64", "completed", False, "train step=3"),
        (2, "all_reduce(SUM)", world, 5, "float64", "completed", True, "train step=3"),
        (3, "broadcast", world, 5, "float64", "completed", False, "train step=3"),
        (4, "barrier", world, 0, "", "completed", False, "train step=3"),
    ]
    assert [(r.seq, r.op, r.dtype) for r in recorder.records()[4:]] == [
        (5, "all_gather", "int64"),
        (6, "all_gather", "uint8"),
    ]
    assert recorder.records()[0].site == f"{HERE}:{sync_line}"
    assert recorder.inflight() == []


def test_a_failing_call_is_recorded_as_failed_and_still_raises(world_of_one, fresh):
    instrument()
    with pytest.raises(RuntimeError, match="invalid root rank"):
        dist.broadcast(torch.ones(2), src=5)  # no rank 5 in a world of one
    (rec,) = recorder.records()
    assert (rec.op, rec.state, rec.seq) == ("broadcast", "failed", 1)
    assert "invalid root rank: 5" in rec.error
    assert recorder.busy() is False


def test_calls_inside_a_recorded_call_are_not_recorded_again(world_of_one, fresh):
    instrument()
    outer = recorder.start("all_reduce(SUM)", "0", 10, "float32")  # as safe_all_reduce does around its chunks
    dist.all_reduce(torch.ones(5))
    dist.all_reduce(torch.ones(5))
    recorder.finish(outer)
    dist.all_reduce(torch.ones(5))
    assert [(r.seq, r.numel) for r in recorder.records()] == [(1, 10), (2, 5)]


def test_the_site_is_resolved_when_read_and_names_the_line_f_lineno_gives(world_of_one, fresh):
    instrument()
    t = torch.ones(3)
    lines = []
    for _ in range(2):  # the second call reads its site from the (code, offset) cache
        dist.all_reduce(
            t,
            op=dist.ReduceOp.SUM,
        )
        lines.append(line() - 4)  # the line the call starts on: what f_lineno says during it
    first, second = recorder.records()
    # Kept as code and offset until read: no file:line is built on the call's path.
    raw = recorder.raw()[0]
    assert raw[WHERE] is sys._getframe().f_code and isinstance(raw[LASTI], int)
    assert (raw[WHERE], raw[LASTI]) not in sites._sites
    assert [first.site, second.site] == [f"{HERE}:{lines[0]}"] * 2
    assert sites._sites[(raw[WHERE], raw[LASTI])] == f"{HERE}:{lines[0]}"  # resolved once, then kept
    assert first.to_dict()["site"] == first.site


def test_code_site_agrees_with_f_lineno_on_every_line_of_a_function():
    from ncclguard.recording.sites import code_site

    seen = []

    def probe() -> None:
        frame = sys._getframe(1)
        seen.append((code_site(frame.f_code, frame.f_lasti), f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    def body(flag: bool) -> None:
        probe()
        if flag:
            probe()
        for _ in range(2):
            probe()
        x = [probe() for _ in range(1)]  # a comprehension: its own code object in 3.11
        probe() if x else probe()

    body(True)
    assert len(seen) == 6 and all(got == want for got, want in seen), seen


def test_a_record_without_a_user_frame_reads_question_mark():
    from ncclguard.recording.flight import FlightRecord

    rec = FlightRecord(1, "barrier", "0", 0, "", 1.0, site=None)
    assert rec.site == "?" and rec.to_dict()["site"] == "?"


def test_each_wrapper_has_its_ops_exact_parameters_and_defaults(fresh):
    import inspect

    wrapped = instrument()
    for name in wrapped:
        fn = getattr(dist, name)
        original = fn.__ncclguard_original__
        got = inspect.signature(fn, follow_wrapped=False).parameters
        want = inspect.signature(original).parameters
        assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()], name
        assert all(got[k].default is want[k].default for k in want), name


@pytest.mark.parametrize("where", ["collectives", "recovery", "testing", "diagnosis", "integrations"])
def test_frames_of_every_part_of_ncclguard_are_library_frames(where):
    # Frames from any ncclguard subpackage (and from ncclguard.integrations, which a source
    # checkout keeps outside the package directory) are skipped: the site is the user's line.
    import ncclguard
    import ncclguard.integrations

    base = os.path.dirname(ncclguard.integrations.__file__ if where == "integrations" else ncclguard.__file__)
    path = os.path.join(base, "" if where == "integrations" else where, "library_module.py")
    ns: dict = {}
    exec(compile("def issue(site):\n    return site(1)\n", path, "exec"), ns)
    site, line = ns["issue"](call_site), sys._getframe().f_lineno
    assert site == f"{__file__}:{line}"


def test_instrument_installs_the_compiled_wrapper_where_it_is_built(fresh):
    instrument(["all_reduce"])
    compiled = ins._hotpath is not None
    assert isinstance(dist.all_reduce, ins._hotpath.Wrapper if compiled else type(line))
    assert dist.all_reduce.__wrapped__ is dist.all_reduce.__ncclguard_original__
