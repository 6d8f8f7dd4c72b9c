"""The store round behind safe_barrier and the fingerprint check, on a real torch store in one process.

Two "ranks" are two threads sharing one ``HashStore`` (torch's in-process store, the same
interface as ``TCPStore``): the protocol runs for real, without process groups.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch.distributed as dist
from harness import wait_for

from ncclguard.collectives import rendezvous
from ncclguard.collectives.barrier import BarrierResult
from ncclguard.collectives.groups import GroupInfo
from ncclguard.collectives.rendezvous import MAX_ARRIVAL_BYTES, exchange, known_hosts, read_present
from ncclguard.deadlines import Deadline
from ncclguard.errors import BarrierTimeout, CollectiveError, NcclGuardError, StoreUnreachable


def _ranks(store: dist.Store, size: int = 2, name: str = "g") -> list[GroupInfo]:
    return [GroupInfo(group=None, name=name, rank=r, size=size, backend="gloo", store=store) for r in range(size)]


# timeout_s: a hang guard; every rank arrives long before (a loaded machine may start a thread seconds late).
def _together(infos: list[GroupInfo], round_name: str, timeout_s: float = 30.0) -> list[rendezvous.RoundResult]:
    results: list[rendezvous.RoundResult | None] = [None] * len(infos)

    def run(i: int) -> None:
        results[i] = exchange(infos[i], round_name, {"rank": i}, Deadline.within(timeout_s))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(infos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def test_every_rank_gets_every_payload_and_the_round_leaves_no_keys():
    store = dist.HashStore()
    before = store.num_keys()
    infos = _ranks(store, 3)
    for res in _together(infos, "r/1"):
        assert res.ok and not res.late and res.missing == []
        assert res.payloads == {0: {"rank": 0}, 1: {"rank": 1}, 2: {"rank": 2}}
    assert store.num_keys() == before
    assert set(known_hosts(infos[0])) == {0, 1, 2}


def test_absent_rank_is_missing_on_time_and_late_when_it_comes():
    store = dist.HashStore()
    infos = _ranks(store)
    t0 = time.monotonic()
    first = exchange(infos[0], "r/late", {"x": 1}, Deadline(t0 + 0.3))
    # The deadline was waited (the store's wait counts whole milliseconds); the upper bound is a hang guard.
    assert 0.29 <= time.monotonic() - t0 < 10.0
    assert not first.ok and first.missing == [1] and not first.late
    t0 = time.monotonic()
    second = exchange(infos[1], "r/late", {"x": 2}, Deadline.within(30))
    assert time.monotonic() - t0 < 10.0  # the outcome was settled: no waiting (its deadline is 30 s; a hang guard)
    assert not second.ok and second.late and second.payloads == {0: {"x": 1}, 1: {"x": 2}}


@pytest.mark.parametrize(
    "blob, phrase",
    [
        (b"{not json", "unreadable"),
        (json.dumps({"host": "h", "payload": 1, "extra": 2}).encode(), "unreadable"),
        (json.dumps({"host": 7, "payload": 1}).encode(), "unreadable"),
        (json.dumps({"host": "h" * 300, "payload": 1}).encode(), "unreadable"),
        (b"x" * (MAX_ARRIVAL_BYTES + 1), "limit"),
    ],
)
def test_a_peer_writing_garbage_is_ignored_and_logged(blob, phrase, caplog):
    store = dist.HashStore()
    infos = _ranks(store)
    # "Rank 1" arrives with a value no rank of ncclguard would write.
    store.set("ncclguard/r/bad/r1", blob)
    store.add("ncclguard/r/bad/n", 1)
    with caplog.at_level(logging.ERROR, logger="ncclguard"):
        res = exchange(infos[0], "r/bad", {"x": 1}, Deadline.within(30))  # a hang guard: it settles at once
    assert not res.ok and res.missing == [1] and res.payloads == {0: {"x": 1}}
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # one line, no more
    assert "rank 1" in line and phrase in line, line


def test_read_present_reads_only_the_keys_that_exist():
    store = dist.HashStore()
    store.set("k/a", "1")
    store.set("k/c", "3")
    assert read_present(store, ["k/a", "k/b", "k/c"]) == {"k/a": b"1", "k/c": b"3"}
    assert read_present(store, ["k/b"]) == {}


class _DeadStore:
    """A store whose server is gone: every call fails as TCPStore's client does."""

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        return fail


def test_store_that_does_not_answer_raises_store_unreachable():
    info = _ranks(_DeadStore())[0]  # type: ignore[arg-type]
    with pytest.raises(StoreUnreachable, match="did not answer during round 'r/dead'"):
        # 30 s: a hang guard; the store fails at once, and its error, not the bound, is what is checked.
        exchange(info, "r/dead", {}, Deadline.within(30))
    # One class, importable from where it used to live too.
    assert rendezvous.StoreUnreachable is StoreUnreachable and issubclass(StoreUnreachable, NcclGuardError)
    assert issubclass(StoreUnreachable, RuntimeError)


def test_barrier_result_raise_for_error():
    ok = BarrierResult(ok=True)
    assert ok.raise_for_error() is ok
    err = BarrierTimeout("ranks [2] did not reach barrier", op="barrier", missing_ranks=[2])
    bad = BarrierResult(ok=False, missing_ranks=[2], error=err)
    with pytest.raises(BarrierTimeout) as caught:
        bad.raise_for_error()
    assert caught.value is err and caught.value.missing_ranks == [2]
    assert isinstance(err, CollectiveError) and isinstance(err, TimeoutError)


def test_a_thread_waiting_in_a_round_does_not_hold_up_another_threads_round():
    # One TCPStore client shared by two groups (as subgroups share the job's client). Thread 1 waits
    # in a round of group A that its peer joins only at the end; meanwhile two more threads run a
    # round on group B.
    from datetime import timedelta

    from ncclguard.store.keys import round_keys

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
    lonely, late = _ranks(dist.PrefixStore("A", client), name="A")
    pair = _ranks(dist.PrefixStore("B", client), name="B")
    errors: list[BaseException] = []
    results: list[rendezvous.RoundResult] = []

    def alone() -> None:
        try:
            results.append(exchange(lonely, "r/alone", {}, Deadline.within(60.0)))  # a hang guard
        except BaseException as exc:  # noqa: BLE001 - the main thread asserts on it
            errors.append(exc)

    waiting = threading.Thread(target=alone)
    waiting.start()
    # Thread 1 has counted itself in (its wait comes next): polled, not a sleep a loaded machine may
    # outlast; through the server's own connection, which no thread's wait can hold up.
    seen = dist.PrefixStore("A", server)
    wait_for(lambda: seen.check([round_keys("r/alone").count]) or errors, 30, "count of the lonely round")
    assert errors == [], errors
    t0 = time.monotonic()
    pair_results = _together(pair, "r/pair")
    took = time.monotonic() - t0
    assert all(r.ok for r in pair_results)
    assert waiting.is_alive() and results == []  # thread 1 still waits: its round is not over
    # Its peer comes last, from this thread: both end the round together.
    last = exchange(late, "r/alone", {}, Deadline.within(30))
    waiting.join(60)
    assert not waiting.is_alive() and errors == []
    assert last.ok and [r.ok for r in results] == [True]
    # Each thread speaks through its own clone of the store; without it the pair waited for thread
    # 1's round to end. The bound is a hang guard 3x above a store answer's 4 s on a loaded machine.
    assert took < 12.0, took
