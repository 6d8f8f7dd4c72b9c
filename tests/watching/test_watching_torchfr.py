"""torch's flight recorder read as data, and joined to ncclguard's records, on a real dump.

``fixtures/torch_fr_gloo_stacks_rank0.json`` is rank 0's ``_dump_fr_trace_json`` and ncclguard
records at the end of a run of tests/workers/stacks_worker.py (torch 2.13.0+cpu, gloo, 2 ranks):
a healthy call of each stack, then one desync each. tests/watching/test_watching_stacks_multirank.py checks
the same join on the dump of every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncclguard.incidents.model import OpRecord
from ncclguard.watching.sensors.torchfr import (
    MAX_DUMP_CHARS,
    FREntry,
    entry_open,
    join,
    newest,
    parse_dump,
    parse_newest,
)

CAPTURED = json.loads((Path(__file__).parents[1] / "fixtures" / "torch_fr_gloo_stacks_rank0.json").read_text())
WORKER = "stacks_worker.py"


def captured() -> tuple[list[FREntry], dict, list[OpRecord]]:
    dump = parse_dump(json.dumps(CAPTURED["dump"]))
    return dump.entries, dump.status, [OpRecord.model_validate(r) for r in CAPTURED["records"]]


def numbered(joined: dict[int, OpRecord], entries: list[FREntry]) -> dict[tuple[str, int], tuple[str, int]]:
    by_id = {e.record_id: e for e in entries}
    return {(by_id[i].group, by_id[i].collective_seq): (rec.group, rec.seq) for i, rec in joined.items()}


def test_the_dump_parses_into_entries_with_group_thread_and_time():
    entries, status, records = captured()
    assert len(entries) == 64 and [e.record_id for e in entries] == list(range(64))
    bucket = entries[12]  # DDP's gradient bucket, its first step
    assert (bucket.group, bucket.collective_seq, bucket.name, bucket.sizes, bucket.numel) == (
        "0",
        11,
        "gloo:all_reduce",
        [[272]],
        272,
    )
    assert bucket.dtypes == ["Float"] and bucket.retired is True and bucket.state == "scheduled"
    assert bucket.thread == records[0].thread  # torch's thread_id is threading.get_ident()
    assert 1.7e9 < bucket.created < 2.0e9  # the system clock in seconds, as time.time()
    assert status["1"]["last_completed_collective"] == "14"
    assert {g: e.collective_seq for g, e in newest(entries, ["0", "1", "7"]).items()} == {"0": 50, "1": 14}


def test_the_watchdogs_read_parses_only_the_newest_entry_of_each_group_it_asks_for():
    text = json.dumps(CAPTURED["dump"])
    full, part = parse_dump(text), parse_newest(text, ["1", "0", "9"])
    assert part.entries == sorted(newest(full.entries, ["0", "1"]).values(), key=lambda e: e.record_id)
    assert part.status == full.status and parse_newest(text, []).entries == []


def test_every_recorded_call_is_joined_to_the_entries_it_issued_and_nothing_else():
    entries, _, records = captured()
    joined = numbered(join(records, entries), entries)
    assert joined == {
        ("0", 29): ("0", 1),  # plain dist.all_reduce, healthy
        ("0", 33): ("0", 2),  # FSDP2's four all_gather_single, healthy
        ("0", 34): ("0", 3),
        ("0", 35): ("0", 4),
        ("0", 36): ("0", 5),
        ("1", 9): ("1", 1),  # DeepSpeed: gradient all_reduce, overflow check, parameter all_gather
        ("1", 10): ("1", 2),
        ("1", 11): ("1", 3),
        ("0", 40): ("0", 6),  # the plain desync
        ("0", 44): ("0", 7),  # the FSDP2 desync
        ("0", 45): ("0", 8),
        ("0", 46): ("0", 9),
        ("0", 47): ("0", 10),
        ("1", 12): ("1", 4),  # the DeepSpeed desync
        ("1", 13): ("1", 5),
        ("1", 14): ("1", 6),
    }
    # The C++-issued ones stay unjoined: DDP's bucket all_reduces, the functional, DTensor and compiled
    # collectives, FSDP2's gradient reduction (gloo:all_reduce of 72 elements).
    cpp = {
        "ddp": [("0", 11), ("0", 14), ("0", 32), ("0", 43)],
        "functional": [("0", 30), ("0", 41)],
        "dtensor": [("0", 31), ("0", 42)],
        "fsdp2": [("0", 37), ("0", 38), ("0", 48), ("0", 49)],
        "compile": [("0", 39), ("0", 50)],
    }
    by_seq = {(e.group, e.collective_seq): e for e in entries}
    for stack, keys in cpp.items():
        for key in keys:
            assert key not in joined, (stack, key, by_seq[key].name)
    assert {by_seq[k].numel for k in cpp["ddp"]} == {272} and {by_seq[k].numel for k in cpp["fsdp2"]} == {72}


def at_the_hang(last_entry: int, hung: tuple[str, int]) -> tuple[list[FREntry], list[OpRecord]]:
    """The dump and records as they were while rank 0 waited: entries up to ``last_entry``, that
    one not retired, and the record ``hung`` (if Python issued it) not ended."""
    entries, _, records = captured()
    cut = [e for e in entries if e.record_id <= last_entry]
    cut[-1] = cut[-1].model_copy(update={"retired": False})
    hung_rec = next((r for r in records if (r.group, r.seq) == hung), None)
    recs = [r for r in records if r.start <= cut[-1].created + 1e-3]
    if hung_rec is not None:
        recs = [r if r is not hung_rec else r.model_copy(update={"end": None, "state": "started"}) for r in recs]
    return cut, recs


def test_while_deepspeed_waits_the_newest_entry_is_open_and_carries_its_python_call():
    entries, records = at_the_hang(61, hung=("1", 4))
    op = newest(entries, ["1"])["1"]
    assert (op.collective_seq, op.name, op.numel) == (12, "gloo:all_reduce", 136)
    assert entry_open(op, {}) is True
    rec = join(records, [op])[op.record_id]
    assert (rec.group, rec.seq, rec.op, rec.phase) == ("1", 4, "all_reduce(SUM)", "train step=7")
    assert rec.site.endswith(f"{WORKER}:114")


def test_while_ddp_waits_the_newest_entry_is_the_bucket_and_no_python_call_issued_it():
    entries, records = at_the_hang(53, hung=("0", -1))
    op = newest(entries, ["0"])["0"]
    assert (op.collective_seq, op.name, op.numel, entry_open(op, {})) == (43, "gloo:all_reduce", 272, True)
    assert join(records, [op]) == {}


def rec(seq: int, start: float, end: float | None, *, thread: int = 7, async_op: bool = False, **kw) -> OpRecord:
    return OpRecord(
        seq=seq, op="all_reduce(SUM)", group="0", start=start, end=end, thread=thread, async_op=async_op, **kw
    )


def entry(rid: int, created: float, *, thread: int | None = 7, group: str = "0", **kw) -> FREntry:
    return FREntry(record_id=rid, group=group, created=created, thread=thread, profiling_name="gloo:all_reduce", **kw)


def test_a_synchronous_call_takes_every_entry_it_issued_an_async_one_only_its_first():
    chunked = rec(1, 10.0, 11.0)  # safe_all_reduce: one record, one backend op per chunk
    issued_async = rec(2, 20.0, 25.0, async_op=True)  # ends when the watchdog notices completion
    entries = [entry(0, 10.2), entry(1, 10.5), entry(2, 10.9), entry(3, 20.0001), entry(4, 21.0)]
    joined = join([issued_async, chunked], entries)
    assert {i: r.seq for i, r in joined.items()} == {0: 1, 1: 1, 2: 1, 3: 2}  # 4: C++ after the call returned


@pytest.mark.parametrize(
    "other",
    [
        entry(0, 10.5, thread=8),  # another thread (DDP's reducer on the autograd thread, say)
        entry(0, 10.5, thread=None),  # no thread id: nothing to join by
        entry(0, 10.5, group="1"),  # another group
        entry(0, 10.5, is_p2p=True),  # a send/recv: numbered in "0:p2p"
        entry(0, 11.5),  # after the call returned
        entry(0, 9.5),  # before the call began
    ],
)
def test_an_entry_outside_a_calls_thread_group_or_time_is_not_its(other):
    assert join([rec(1, 10.0, 11.0)], [other]) == {}


def test_open_is_read_from_the_state_from_retired_or_from_the_groups_status():
    assert entry_open(entry(0, 1.0, state="completed", retired=False), {}) is False  # NCCL's own state
    assert entry_open(entry(0, 1.0, retired=True), {}) is False
    assert entry_open(entry(0, 1.0, retired=False), {}) is True
    older = entry(0, 1.0, collective_seq_id=5)  # a torch without "retired": the group's counter says
    assert entry_open(older, {"0": {"last_completed_collective": "5"}}) is False
    assert entry_open(older, {"0": {"last_completed_collective": "4"}}) is True
    assert entry_open(older, {}) is None and entry_open(older, {"0": {"last_completed_collective": "x"}}) is None


def test_malformed_entries_are_skipped_and_a_bad_dump_is_refused():
    good = CAPTURED["dump"]["entries"][0]
    text = json.dumps({"entries": [good, "junk", {**good, "collective_seq_id": "not a number"}, {"record_id": 3}]})
    assert [e.record_id for e in parse_dump(text).entries] == [0, 3]
    assert [e.record_id for e in parse_newest(text, ["0"]).entries] == [0]  # the newest valid one, by record_id
    with pytest.raises(ValueError, match="not an object"):
        parse_dump("[]")
    with pytest.raises(ValueError):
        parse_dump("{not json")
    with pytest.raises(ValueError, match="over"):
        parse_dump(" " * (MAX_DUMP_CHARS + 1))
