"""The flight recorder's records (issue 29): what a report reads from them, the ring's wrap-around,
a reader on another thread, and the compiled wrapper against the generated one.

Records are made by real ``torch.distributed`` calls on a gloo group of one rank (a HashStore
rendezvous) through ``instrument()``'s wrappers, compiled (``_hotpath.c``) and generated (Python).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard import phase
from ncclguard.incidents import files
from ncclguard.incidents.model import OpRecord
from ncclguard.recording import instrument as ins
from ncclguard.recording.flight import FlightRecorder, doors, recorder
from ncclguard.recording.instrument import instrument, uninstrument
from ncclguard.recording.record import FlightRecord
from ncclguard.watching.sensors.rank_state import RankState

HERE = __file__
CHUNK_BYTES = 4096


def line() -> int:
    return sys._getframe(1).f_lineno


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_group().group_name
    uninstrument()
    dist.destroy_process_group()


@pytest.fixture
def wrappers(wrapper_kind):
    """instrument() installs the compiled wrapper or the generated one; the recorder starts empty."""
    return wrapper_kind


def chunked_call(group: str, numel: int) -> list[Any] | None:
    """Opens a record as safe_all_reduce does around its chunks (its site: the caller of this)."""
    return recorder.open_fast("all_reduce(SUM)", group, numel, torch.float32)


# ----------------------------------------------------------------------------- what a report reads


def test_a_report_from_the_recorders_records_shows_every_field(world_of_one, wrappers):
    group = world_of_one
    instrument()
    t = torch.ones(4, dtype=torch.float64)
    with phase("train", step=3):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # 1: completed
        with pytest.raises(RuntimeError, match="invalid root rank"):
            dist.broadcast(t, src=5)  # 2: failed
        rec = chunked_call(group, 3 * CHUNK_BYTES // 4)  # 3: in flight, 2 of its 3 chunks done
        open_line = line() - 1
        recorder.progress(rec, 2, 3, 2 * CHUNK_BYTES)
        statement = RankState(0, 2).statement(beat=4, peers={}).model_dump(mode="json")
    start = FlightRecord.of(rec).start
    recorder.close_ok(rec)

    # Every field a record had, as the statement carries it (its recent records and the op in flight).
    recent = statement["recent"]
    assert [(r["seq"], r["op"], r["state"], r["numel"], r["dtype"], r["phase"]) for r in recent] == [
        (1, "all_reduce(MAX)", "completed", 4, "float64", "train step=3"),
        (2, "broadcast", "failed", 4, "float64", "train step=3"),
        (3, "all_reduce(SUM)", "started", 3 * CHUNK_BYTES // 4, "float32", "train step=3"),
    ]
    assert set(recent[0]) == set(OpRecord.model_fields)
    assert "invalid root rank: 5" in recent[1]["error"] and recent[0]["error"] is None
    assert all(r["group"] == group and r["async_op"] is False and r["peer"] is None for r in recent)
    assert {r["thread"] for r in recent} == {threading.get_ident()}
    assert (recent[2]["chunks_done"], recent[2]["chunks"], recent[2]["bytes_done"]) == (2, 3, 2 * CHUNK_BYTES)
    assert recent[2]["site"] == f"{HERE}:{open_line}" and recent[0]["site"].startswith(f"{HERE}:")
    assert [r["seq"] for r in statement["inflight"]] == [3] and statement["blocked_in"]["seq"] == 3
    assert (statement["last_seq"], statement["last_completed"]) == ({group: 3}, {group: 1})

    # The report: this rank waits in #3 while a peer is still elsewhere after #1.
    peer = {
        **{k: statement[k] for k in ("host", "beat", "world_size", "groups", "peers")},
        "rank": 1,
        "pid": 1,
        "time": statement["time"],
        "phase": "eval batch=7",
        "site": "/job/eval.py:88",
        "last_seq": {group: 1},
        "last_completed": {group: 1},
        "inflight": [],
        "blocked_in": None,
        "stack": ["/job/eval.py:88 in evaluate: step()"],
        "recent": [],
    }
    peer["groups"] = {group: [0, 1]}
    statement["groups"] = {group: [0, 1]}
    doc = {"id": "20260101-000000-001", "kind": "hang", "reason": "r", "by": 0, "created": start + 30.0}
    doc |= {"group": group, "seq": 3, "n": 1}
    text = files.render(files.merge(doc, {0: statement, 1: peer}, {}, {}, 2, merged_by=0, waiting_after_s=5.0))
    assert f"rank 0 waiting in all_reduce(SUM) #3 ({3 * CHUNK_BYTES // 4} x float32, phase train step=3) for " in text
    assert "rank 1 last completed #1, now in phase eval batch=7 at eval.py:88" in text
    assert "chunk 2 of 3 done, 8.0 KiB reduced" in text


def test_a_record_reads_every_field_it_is_given_and_its_state_from_end_and_error():
    started = FlightRecord(7, "send", "3", 2, "int64", 10.0, phase="p", site="a.py:1", peer=1, thread=9)
    done = FlightRecord(8, "all_reduce(SUM)", "3", 2, "int64", 10.0, state="completed", end=11.0, async_op=True)
    failed = FlightRecord(9, "barrier", "3", 0, "", 10.0, state="failed", end=12.0, error="closed by peer")
    assert started.to_dict() == {
        "seq": 7,
        "op": "send",
        "group": "3",
        "numel": 2,
        "dtype": "int64",
        "start": 10.0,
        "state": "started",
        "end": None,
        "phase": "p",
        "site": "a.py:1",
        "error": None,
        "async_op": False,
        "peer": 1,
        "thread": 9,
        "bytes_done": 0,
        "chunks_done": 0,
        "chunks": 0,
    }
    assert (done.state, done.end, done.error, done.async_op) == ("completed", 11.0, None, True)
    assert (failed.state, failed.end, failed.error) == ("failed", 12.0, "closed by peer")
    assert FlightRecord(1, "x", "0", 0, "", 1.0, state="failed").error == "failed"  # a failure always says one
    with pytest.raises(ValueError, match="started, completed or failed"):
        FlightRecord(1, "x", "0", 0, "", 1.0, state="done")
    assert FlightRecord.of(started._r) == started and FlightRecord.of(started._r) is not started


# ----------------------------------------------------------------------------- the ring


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("ok"), st.sampled_from(["0", "7"]), st.booleans()),
        st.tuples(st.just("fail"), st.sampled_from(["0", "7"]), st.booleans()),
        st.tuples(st.just("open"), st.sampled_from(["0", "7"]), st.booleans()),
        st.tuples(st.just("resize"), st.integers(1, 6), st.just(False)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 6), ops=OPS)
def test_the_ring_keeps_the_newest_records_in_order_and_counts_every_one(size, ops):
    rec = FlightRecorder(size=size)
    model: list[tuple[str, int, str]] = []  # (counter, seq, state) of every record made
    seq: dict[str, int] = {}
    done: dict[str, int] = {}
    kept = size
    for what, arg, p2p in ops:
        if what == "resize":
            rec.resize(arg)
            kept = arg
            continue
        key = f"{arg}:p2p" if p2p else arg
        seq[key] = seq.get(key, 0) + 1
        raw = rec.open_fast("send" if p2p else "all_reduce(SUM)", arg, 1, torch.float32, peer=1 if p2p else None)
        if what == "ok":
            rec.close_ok(raw)
            done[key] = seq[key]
        elif what == "fail":
            rec.finish(raw, RuntimeError("boom"))
        else:  # left open: later ops of this thread are nested in it, so hand it off (it stays in flight)
            rec.hand_off(raw)
        state = {"ok": "completed", "fail": "failed", "open": "started"}[what]
        model.append((key, seq[key], state))
    got = [(f"{r.group}:p2p" if r.peer is not None else r.group, r.seq, r.state) for r in rec.records()]
    # Resizing keeps the newest: the ring always holds the newest min(kept, made) records in order.
    assert len(got) <= kept
    assert got == model[len(model) - len(got) :]
    assert len(got) == min(len(model), kept) or any(w == "resize" for w, _, _ in ops)
    assert rec.last_seq() == seq
    assert rec.last_completed() == done
    assert sorted((r.group, r.seq) for r in rec.inflight()) == sorted(
        (k.removesuffix(":p2p"), s) for k, s, state in model if state == "started"
    )


# ----------------------------------------------------------------------------- a reader on another thread


def test_a_reader_on_another_thread_only_ever_sees_whole_records(world_of_one, wrappers):
    """The watchdog's thread reads while the training thread writes, with no lock: every record a
    read returns is whole (its state agrees with its end and error, its progress is of one moment,
    each group's numbers run without a gap). The switch interval is cut to 10 us so that the reader
    runs between the writer's steps, and once by handshake while a chunked record is half done."""
    group = world_of_one
    instrument()
    t = torch.ones(2)
    stop, mid_flight, seen_mid = threading.Event(), threading.Event(), threading.Event()
    problems: list[str] = []
    reads = {"n": 0, "started": 0, "progress": 0}

    def check(snapshot: list[dict[str, Any]]) -> None:
        last: dict[str, int] = {}
        for d in snapshot:
            state, end, error = d["state"], d["end"], d["error"]
            if (state == "started") != (end is None) or (state == "failed") != (error is not None):
                problems.append(f"torn state: {d}")
            if d["op"] == "broadcast" and state == "completed":  # every broadcast here fails: END seen before ERROR
                problems.append(f"a failure read as completed: {d}")
            if d["bytes_done"] != d["chunks_done"] * CHUNK_BYTES or d["chunks"] not in (0, 3):
                problems.append(f"torn progress: {d}")
            if d["group"] in last and d["seq"] != last[d["group"]] + 1:
                problems.append(f"gap in {d['group']}: {last[d['group']]} then {d['seq']}")
            last[d["group"]] = d["seq"]
            reads["started"] += state == "started"
            reads["progress"] += 0 < d["chunks_done"] < 3

    def reader() -> None:
        while not stop.is_set():
            # Looked at before the read: a read that began before the writer set mid_flight may
            # predate the half-done record, and would answer the handshake without having seen it.
            mid = mid_flight.is_set()
            check([r.to_dict() for r in recorder.records()])
            flying = [r.start for r in recorder.inflight()]  # live views: one may finish as it is read
            if flying != sorted(flying):
                problems.append(f"in flight out of order: {flying}")
            completed = recorder.last_completed()  # first: both only grow, so it never passes seqs
            seqs = recorder.last_seq()
            if any(completed.get(g, 0) > s for g, s in seqs.items()):
                problems.append(f"completed past issued: {completed} {seqs}")
            reads["n"] += 1
            if mid:
                seen_mid.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for i in range(1500):
            dist.all_reduce(t)
            if i % 7 == 0:
                with pytest.raises(RuntimeError):
                    dist.broadcast(t, src=5)
            if i % 5 == 0:
                rec = chunked_call(group, 3 * CHUNK_BYTES // 4)
                for c in range(1, 4):
                    recorder.progress(rec, c, 3, c * CHUNK_BYTES)
                    if i == 500 and c == 1:  # once for sure: a read while this record is half done
                        mid_flight.set()
                        assert seen_mid.wait(30.0)
                        mid_flight.clear()
                    time.sleep(0)
                recorder.close_ok(rec)
    finally:
        stop.set()
        thread.join(30.0)
        sys.setswitchinterval(switch)
    assert not thread.is_alive()
    assert problems == []
    assert reads["n"] >= 2 and reads["progress"] >= 1 and reads["started"] >= 1, reads
    check([r.to_dict() for r in recorder.records()])
    assert problems == [] and recorder.inflight() == []


# ----------------------------------------------------------------------------- compiled and generated alike


def _script(t: torch.Tensor, tag: str) -> None:
    with phase("script", tag=tag):
        dist.all_reduce(t)
        dist.all_reduce(tensor=t, op=dist.ReduceOp.MIN)
        dist.all_reduce(t, dist.ReduceOp.MAX, None, False)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
        dist.barrier()
        dist.all_gather([torch.zeros(3)], t)
        dist.all_gather_object([None], {"x": 1})
        with pytest.raises(RuntimeError):
            dist.broadcast(t, src=5)
        with pytest.raises(TypeError):
            dist.all_reduce()  # no tensor: refused by the signature, nothing recorded
        with pytest.raises(TypeError):
            dist.all_reduce(t, bogus=1)
        with pytest.raises(TypeError):
            dist.all_reduce(t, dist.ReduceOp.SUM, None, False, 5)
        with pytest.raises(TypeError):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, tensor=t)


def _recorded(kind: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    with monkeypatch.context() as m:
        if kind == "generated":
            m.setattr(ins, "_hotpath", None)
        uninstrument()
        recorder.clear()
        instrument()
        _script(torch.ones(3), "x")
        recorder.sweep()
        uninstrument()
    out = [r.to_dict() for r in recorder.records()]
    recorder.clear()
    return [{k: v for k, v in d.items() if k not in ("start", "end")} for d in out]


def test_the_compiled_wrapper_records_what_the_generated_one_records(world_of_one, monkeypatch):
    if ins._hotpath is None:
        pytest.skip("the compiled wrapper is not built in this install")
    compiled, generated = _recorded("compiled", monkeypatch), _recorded("generated", monkeypatch)
    assert compiled == generated
    assert [(d["seq"], d["op"], d["numel"], d["dtype"], d["state"], d["async_op"]) for d in compiled] == [
        (1, "all_reduce(SUM)", 3, "float32", "completed", False),
        (2, "all_reduce(MIN)", 3, "float32", "completed", False),
        (3, "all_reduce(MAX)", 3, "float32", "completed", False),
        (4, "all_reduce(SUM)", 3, "float32", "completed", True),
        (5, "broadcast", 3, "float32", "completed", False),
        (6, "barrier", 0, "", "completed", False),
        (7, "all_gather", 3, "float32", "completed", False),
        (8, "all_gather", 1, "int64", "completed", False),
        (9, "all_gather", 21, "uint8", "completed", False),  # the pickled {"x": 1}
        (10, "broadcast", 3, "float32", "failed", False),
    ]
    assert all(d["phase"] == "script tag=x" and d["site"].startswith(f"{HERE}:") for d in compiled)


def test_a_send_numbers_apart_and_names_its_peer_in_both_wrappers(world_of_one, wrappers):
    def noop(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None) -> None:
        return None

    send = ins._wrap(ins._spec("send", dist.send), noop, like=dist.send)
    t = torch.ones(2)
    dist.all_reduce(t)  # plain: not instrumented here
    send(t, 1)
    send(t, dst=2)
    send(t, group_dst=0)  # no dst: a peer all the same, so it numbers with the send/recv
    got = [(r.op, r.seq, r.peer, r.async_op) for r in recorder.records()]
    assert got == [("send", 1, 1, False), ("send", 2, 2, False), ("send", 3, -1, False)]
    assert recorder.last_seq() == {f"{world_of_one}:p2p": 3}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_call_that_records_itself_goes_through_either_door_alike(compiled):
    """flight.doors(): open_fast/close_ok, compiled or not (safe_all_reduce records through them)."""
    if compiled and ins._hotpath is None:
        pytest.skip("the compiled hot path is not built in this install")
    rec = FlightRecorder(size=3)
    open_, close = doors(rec, compiled=compiled)

    def library_call(numel: int) -> list[Any] | None:  # stands in for safe_all_reduce: its caller is the site
        return open_("all_reduce(SUM)", "g", numel, torch.float32)

    with phase("eval", batch=2):
        first = library_call(8)
        site = f"{HERE}:{line() - 1}"
        assert library_call(9) is None  # nested: this thread is inside a recorded call
        close(None)
        close(first)
        second = library_call(10)
    rec.finish(second, RuntimeError("peer closed"))
    rec.clear()
    third = library_call(11)
    rec.clear()  # a world change while the call is in flight: it closes into nothing
    close(third)
    assert [(r.seq, r.numel, r.state, r.error) for r in [FlightRecord.of(first), FlightRecord.of(second)]] == [
        (1, 8, "completed", None),
        (2, 10, "failed", "peer closed"),
    ]
    assert (FlightRecord.of(first).site, FlightRecord.of(first).phase, FlightRecord.of(first).dtype) == (
        site,
        "eval batch=2",
        "float32",
    )
    assert FlightRecord.of(third).state == "completed" and rec.records() == [] and rec.opened == {}


def test_group_none_is_the_default_group_at_the_time_of_the_call(world_of_one, wrappers):
    """The wrappers read torch's default group on every call (no cache to go stale): while the
    default group is routed to another one (an evaluation group does this), records name that one."""
    from ncclguard import _torch_compat as compat

    other = dist.new_group([0], backend="gloo")
    instrument()
    t = torch.ones(1)
    dist.all_reduce(t)
    with compat.routed_default_group(other):
        dist.all_reduce(t)
    dist.all_reduce(t, group=other)
    assert [(r.group, r.seq) for r in recorder.records()] == [
        (world_of_one, 1),
        (other.group_name, 1),
        (other.group_name, 2),
    ]


def test_the_site_is_the_users_line_above_the_frameworks_frames(world_of_one, wrappers):
    """Six frames of torch's file between the user and the collective (as DeepSpeed's are): the
    first call classifies the file (sites.user_frame), the next ones walk it as known."""
    instrument()
    ns: dict[str, Any] = {"dist": dist}
    src = "def f0(t):\n    return dist.all_reduce(t)\n"
    src += "".join(f"def f{i}(t):\n    return f{i - 1}(t)\n" for i in range(1, 6))
    exec(compile(src, dist.distributed_c10d.__file__, "exec"), ns)
    t = torch.ones(1)
    for _ in range(3):
        ns["f5"](t)
        site = f"{HERE}:{line() - 1}"
    assert [r.site for r in recorder.records()] == [site] * 3
