"""The watchdog's store protocol without processes: the key schema, bounded calls (a call that
blocks, a store that is gone), and values validated on the way in (torch's in-memory HashStore
stands in for the job's TCPStore)."""

from __future__ import annotations

import logging
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.model import Heartbeat, IncidentDoc, IncidentKind, MergedNote, OpRecord, Statement
from ncclguard.store import bounded_calls
from ncclguard.watching.base.watchdog_store import LIMITS, BoundedCalls, Keys, WatchdogStore, parse_value

# Hang guard: a bounded call that must end at its 0.1 s bound; 100x that, far below the blocked 60 s.
BLOCKED_CALL_GUARD_S = 10.0


def heartbeat(rank: int, beat: int = 1, inflight: int = 0) -> Heartbeat:
    recs = [OpRecord(seq=i + 1, op="all_reduce(SUM)", group="0", start=1.0, site="x" * 100) for i in range(inflight)]
    return Heartbeat(
        rank=rank,
        host="node1",
        pid=100 + rank,
        beat=beat,
        time=1000.0,
        phase="train step=1",
        site="/job/train.py:10",
        last_seq={"0": 4},
        last_completed={"0": 4},
        inflight=recs,
    )


# Each call's bound (30 s) is a hang guard: these tests expect every call to answer, and an
# in-process store's answer on a loaded machine has taken 2-4 s.
def wstore(store=None, timeout: float = 30.0, gone_after: float = 60.0) -> WatchdogStore:
    return WatchdogStore(store if store is not None else dist.HashStore(), Keys("main"), timeout, gone_after)


def test_every_key_lives_under_one_namespace_per_run_restart_and_session(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    k = Keys.from_env("demo")
    assert k.ns == "ncclguard/wd/job7/2/demo/g0"  # one namespace per world generation too
    keys = [k.count, k.heartbeat(3), k.claim("hang/0/15"), k.incident(4), k.statement(4, 3)]
    keys += [k.dumped(4), k.merger(4), k.merged(4), k.resolved(4)]
    assert all(key.startswith(k.ns + "/") for key in keys) and len(set(keys)) == len(keys)
    assert k.statement(4, 3) == "ncclguard/wd/job7/2/demo/g0/incident/4/st/3"
    assert Keys("main").ns == "ncclguard/wd/run/0/main/g0"
    assert Keys.from_env("demo", generation=2).ns == "ncclguard/wd/job7/2/demo/g2"


def test_a_call_that_blocks_times_out_then_the_store_counts_as_gone(monkeypatch):
    # The failing spell is timed on a clock of the test's (BoundedCalls reads time.monotonic only
    # there): on the real one, a loaded machine that stalled 0.3 s between the first two calls made
    # the second StoreUnreachable instead of StoreTimeout.
    clock = [1000.0]
    monkeypatch.setattr(bounded_calls, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    store = dist.HashStore()
    calls = BoundedCalls(store, timeout=0.1, gone_after=0.3)
    release = threading.Event()
    t0 = time.monotonic()
    # The blocked call would return after 60 s (a hang guard): only the 0.1 s bound can end it sooner.
    with pytest.raises(StoreTimeout, match=r"the store did not answer within \d+\.\d\d s") as info:
        calls.run(release.wait, 60)
    took = time.monotonic() - t0
    # The message gives the time waited (the 0.1 s bound, more on a loaded machine): never more than the
    # call took. The upper bound is a hang guard, far below the blocked call's 60 s.
    waited = float(re.search(r"within (\d+\.\d+) s", str(info.value)).group(1))
    assert waited <= took + 0.005 and took < BLOCKED_CALL_GUARD_S
    # The call is still blocked: the next one fails at once instead of queueing behind it.
    with pytest.raises(StoreTimeout, match="an earlier call to the store has not returned"):
        calls.run(store.add, "k", 1)
    clock[0] += 0.5  # failing for longer than gone_after since the first failure
    with pytest.raises(
        StoreUnreachable, match="^no answer for 0.5 s: .* an earlier call to the store has not returned"
    ):
        calls.run(store.add, "k", 1)
    release.set()  # the blocked call returns: the store answers again
    deadline = time.monotonic() + 20  # a hang guard: a loaded machine may end the blocked call's thread late
    while True:
        try:
            assert calls.run(store.add, "k", 1) == 1
            break
        except (StoreTimeout, StoreUnreachable):  # until the blocked call's thread has ended
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _store_call_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ncclguard-store-call"]


def test_calls_share_one_helper_thread_that_close_ends():
    before = set(_store_call_threads())
    # The bound (30 s) is a hang guard: every call here must answer, on a loaded machine too.
    calls = BoundedCalls(dist.HashStore(), timeout=30.0, gone_after=60.0)
    idents = {calls.run(threading.get_ident) for _ in range(5)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    (helper,) = set(_store_call_threads()) - before
    calls.close()
    helper.join(30.0)  # a hang guard
    assert not helper.is_alive()
    calls.run(threading.get_ident)  # a call after close starts a new thread
    (again,) = set(_store_call_threads()) - before
    assert again is not helper and again.is_alive()
    calls.close()


def test_a_call_that_blocked_then_returned_frees_the_calls_for_a_new_thread():
    # Only the blocked call is under the short bound: the calls that must answer get 30 s (a hang
    # guard), which a loaded machine's thread start-up and hand-off cannot miss as it could 0.1 s.
    calls = BoundedCalls(dist.HashStore(), timeout=30.0, gone_after=60.0)
    first = calls.run(threading.get_ident)
    release = threading.Event()
    calls.timeout = 0.1
    with pytest.raises(StoreTimeout, match="did not answer"):
        calls.run(release.wait, 60)  # 60 s: a hang guard; only release or the 0.1 s bound ends it sooner
    calls.timeout = 30.0
    release.set()
    deadline = time.monotonic() + 20  # a hang guard: a loaded machine may end the blocked call's thread late
    while True:
        try:
            second = calls.run(threading.get_ident)
            break
        except StoreTimeout:  # until the blocked call has returned
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert second != first  # the thread left to the blocked call is not used again
    calls.close()


def test_a_refused_connection_is_gone_at_once_and_other_errors_pass_through():
    # The bound (30 s) is a hang guard: each call raises at once, and what it raised is the verdict.
    calls = BoundedCalls(dist.HashStore(), timeout=30.0, gone_after=60.0)

    def refused():
        raise dist.DistNetworkError("Connection reset by peer\nmore")

    with pytest.raises(StoreUnreachable, match="^DistNetworkError: Connection reset by peer$"):
        calls.run(refused)

    def slow():
        raise RuntimeError("Socket Timeout")

    with pytest.raises(StoreTimeout, match="Socket Timeout"):
        calls.run(slow)
    with pytest.raises(KeyError):  # a bug is not a store failure
        calls.run({}.__getitem__, "x")


def test_an_unchanged_heartbeat_is_not_parsed_again_and_a_changed_one_is():
    ws = wstore()
    ws.publish_heartbeat(heartbeat(1, beat=3))
    first = ws.read_heartbeats([1])[1]
    assert ws.read_heartbeats([1])[1] is first  # the same value: the parse is reused
    ws.publish_heartbeat(heartbeat(1, beat=4))
    second = ws.read_heartbeats([1])[1]
    assert second.beat == 4 and second is not first
    ws.store.set(ws.keys.heartbeat(1), "not json")
    assert ws.read_heartbeats([1]) == {}  # a bad value is not masked by the last good one


def test_heartbeats_round_trip_and_missing_ranks_are_absent():
    ws = wstore()
    ws.publish_heartbeat(heartbeat(0))
    ws.publish_heartbeat(heartbeat(2, beat=5))
    got = ws.read_heartbeats([0, 1, 2])
    assert sorted(got) == [0, 2] and got[2] == heartbeat(2, beat=5)
    assert ws.read_heartbeats([1]) == {}


def test_oversized_and_malformed_values_are_dropped_with_one_log_line_each(caplog):
    raw = dist.HashStore()
    ws = wstore(raw)
    raw.set(ws.keys.heartbeat(1), "x" * (LIMITS[Heartbeat] + 1))
    raw.set(ws.keys.heartbeat(2), '{"rank": 2}')
    raw.set(ws.keys.heartbeat(3), "not json")
    ws.publish_heartbeat(heartbeat(0))
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        for _ in range(3):  # read every beat: the warning comes once per bad key
            assert sorted(ws.read_heartbeats([0, 1, 2, 3])) == [0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert f"over the {LIMITS[Heartbeat]}-byte bound of a Heartbeat" in lines[0]
    assert "not a valid Heartbeat (host: Field required; 9 error(s))" in lines[1]
    assert "not a valid Heartbeat (value: Invalid JSON" in lines[2]
    # Once it reads well again, a later bad value is reported again.
    ws.publish_heartbeat(heartbeat(2))
    assert sorted(ws.read_heartbeats([2])) == [2]
    raw.set(ws.keys.heartbeat(2), "{}")
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert ws.read_heartbeats([2]) == {}
    assert len(caplog.records) == 4


def test_parse_value_names_the_key_and_the_bound():
    with pytest.raises(ValueError, match="^k: 65537 bytes, over the 65536-byte bound of a IncidentDoc$"):
        parse_value(IncidentDoc, b"x" * 65537, "k")
    note = parse_value(MergedNote, b'{"host": "h", "dir": "/d", "summary": "s", "extra": 1}', "k")
    assert note == MergedNote(host="h", dir="/d", summary="s")  # unknown fields from a newer peer are dropped


def test_a_heartbeat_too_large_for_its_bound_is_cut_to_the_oldest_ops():
    ws = wstore()
    big = heartbeat(0, inflight=2000)
    assert len(big.model_dump_json()) > LIMITS[Heartbeat]
    ws.publish_heartbeat(big)
    got = ws.read_heartbeats([0])[0]
    assert [r.seq for r in got.inflight] == list(range(1, 17))


def test_claims_numbers_and_the_merger_are_taken_once():
    ws = wstore()
    assert ws.claim("hang/0/15", "0:aa") and not ws.claim("hang/0/15", "1:bb")
    assert ws.claim("hang/0/16", "1:bb")
    assert (ws.incident_count(), ws.number_incident(), ws.number_incident(), ws.incident_count()) == (0, 1, 2, 2)
    doc = IncidentDoc(kind=IncidentKind.HANG, reason="r", id="x-001", n=1, group="0", seq=15, op="all_reduce(SUM)")
    assert not ws.has_incident(1)
    ws.put_incident(doc)
    assert ws.has_incident(1) and ws.read_incident(1) == doc
    assert ws.claim_merger(1, 2) and not ws.claim_merger(1, 0)
    assert (ws.add_dumped(1), ws.add_dumped(1), ws.add_dumped(1, 0)) == (1, 2, 2)
    assert not ws.has_mark(ws.keys.resolved(1))
    ws.set_mark(ws.keys.resolved(1))
    assert ws.has_mark(ws.keys.resolved(1))


def test_statements_are_read_back_by_rank_and_cut_to_their_bound():
    ws = wstore()
    st = Statement(**dict(heartbeat(1)), world_size=3, stack=["f:1 in g"] * 50, groups={"0": [0, 1, 2]})
    ws.put_statement(7, st)
    assert ws.read_statements(7, [0, 1, 2]) == {1: st}
    huge = st.model_copy(
        update={"recent": heartbeat(1, inflight=4000).inflight, "stack": ["s" * 2000] * 600, "rank": 2}
    )
    assert len(huge.model_dump_json()) > LIMITS[Statement]
    ws.put_statement(7, huge)
    got = ws.read_statements(7, [2])[2]
    assert got.recent == [] and len(got.stack) == 20


def test_a_dead_tcpstore_is_unreachable():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # The bounds are hang guards: a live in-process TCPStore's answer (and a c10d connect) has taken
    # seconds on a loaded machine; a dead one fails at once, and that error is the verdict.
    ws = WatchdogStore.connect(f"127.0.0.1:{server.port}", Keys("main"), 30.0, 60.0)
    ws.publish_heartbeat(heartbeat(0))
    assert sorted(ws.read_heartbeats([0])) == [0]
    del server  # the server goes away with its object
    with pytest.raises(StoreUnreachable, match="DistNetworkError"):
        for _ in range(50):  # the first call may still land in the socket's buffer
            ws.read_heartbeats([0])
            time.sleep(0.02)
