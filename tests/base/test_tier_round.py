"""The two-tier settle-once round (ncclguard/store/tier_round.py), threads as ranks: a job's
``TCPStore`` and one ``TCPStore`` a node on 127.0.0.1, each rank with clients of its own. Counted:
the requests each rank makes of the job's store (the carriers' few, none from the others)."""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any

import pytest
from harness import load_benchmark, wait_for
from pydantic import ValidationError
from tier_kit import JOIN_GUARD_S, ROUND_GUARD_S, Counting, Job, run_threads

from ncclguard.deadlines import Deadline
from ncclguard.store import node_store
from ncclguard.store.clients import connect
from ncclguard.store.codec import encode
from ncclguard.store.keys import RoundKeys
from ncclguard.store.rounds import Members, Peek, Rule
from ncclguard.store.tier_round import (
    Carried,
    TierKeys,
    TierPeek,
    TierPlace,
    node_deadline,
    settle_tiered,
    tier_counts,
)


def all_rule(peek: Peek, size: int, early_dead: set[int] | None = None) -> Rule[dict[str, Any]]:
    """ok when every rank arrived saying ok; the outcome names who arrived and who settled it how."""

    def decide(raw: dict[int, bytes], how: str) -> str:
        said = {r: json.loads(v) for r, v in raw.items() if v}
        arrived = sorted(said)
        return json.dumps({"arrived": arrived, "ok": arrived == list(range(size)), "how": how})

    def early(p: Peek) -> str | None:
        if not early_dead:
            return None
        present = set(p.present())
        return decide(p.arrivals(), "early") if present | early_dead == set(range(size)) else None

    return Rule(
        everyone=lambda: decide(peek.arrivals(complete=True), "everyone"),
        given_up=lambda p: decide(p.arrivals(), "given up"),
        read=lambda raw: json.loads(raw),
        members=lambda v: Members((), True),
        early=early if early_dead is not None else None,
    )


def rank_fn(job: Job, keys: RoundKeys, timeout_s: float, solo: set[int] = frozenset(), dead: set[int] | None = None):  # type: ignore[assignment]
    """Each rank's round, its clients made beforehand: a c10d client's connect now and then takes
    5 s (torch 2.13), which inside a round of a few seconds would make that rank late."""
    clients = {r: job.clients(r, linked=r not in solo) for r in range(job.size)}
    counters = {r: c[0] for r, c in clients.items()}

    def rank(r: int) -> tuple[dict[str, Any], str]:
        store, near = clients[r]
        place = TierPlace(r, job.node_of, near)
        peek = TierPeek(store, TierKeys(keys), place, 1024)
        deadline = Deadline.within(timeout_s)
        settled, path = settle_tiered(
            store,
            keys,
            place,
            json.dumps({"rank": r}),
            deadline,
            all_rule(peek, job.size, dead),
            node_by=node_deadline(deadline, timeout_s),
            peek=peek,
            known_dead=(lambda: dict.fromkeys(dead, "dead")) if dead else None,
        )
        return settled.outcome, path

    return rank, counters


def test_six_ranks_on_three_nodes_settle_once_and_only_the_carriers_talk_to_the_jobs_store():
    job, keys = Job(6, 2), RoundKeys("test/tier/all")
    before = tier_counts()
    rank, counters = rank_fn(job, keys, ROUND_GUARD_S)
    out = run_threads(rank, {r: 0.02 * r for r in range(6)})
    outcomes = {r: out[r][0] for r in range(6)}
    assert all(o == {"arrived": [0, 1, 2, 3, 4, 5], "ok": True, "how": "everyone"} for o in outcomes.values()), out
    paths = {r: out[r][1] for r in range(6)}
    carriers = sorted(r for r, p in paths.items() if p == "carried")
    # One carrier a node (the rank that completed it: the later one here); the other read the node's copy.
    assert len(carriers) == 3 and {job.node_of[r] for r in carriers} == {0, 1, 2}, paths
    assert sorted(r for r, p in paths.items() if p == "waited") == sorted(set(range(6)) - set(carriers))
    for r in set(range(6)) - set(carriers):
        assert counters[r].calls == {}, (r, counters[r].calls)  # nothing from a rank that is not carrying
    # The carriers: a set and an add each; the one that completes the count settles (compare_set),
    # reading the nodes' arrivals (a check of all three, a multi_get) and the solos (a check); the
    # two others wait for the outcome and get it.
    total = sum((counters[r].calls for r in carriers), collections.Counter())
    assert total == {"set": 3, "add": 3, "compare_set": 1, "check": 2, "multi_get": 1, "wait": 2, "get": 2}, total
    after = tier_counts()
    assert after["carried"] - before["carried"] == 3 and after["waited"] - before["waited"] == 3


def test_a_rank_that_never_comes_is_named_alone_and_a_late_one_reads_the_same_outcome():
    job, keys = Job(6, 2), RoundKeys("test/tier/missing")
    rank, _ = rank_fn(job, keys, 3.0)  # the round's bound; the node's ranks give up 0.3 s before it
    out = run_threads(rank, {r: 0.0 for r in range(6) if r != 3})
    expected = {"arrived": [0, 1, 2, 4, 5], "ok": False, "how": "given up"}
    assert all(out[r][0] == expected for r in out), out
    assert out[2][1] == "carried"  # rank 3's node-mate carried itself at the node's deadline
    late = run_threads(rank, {3: 0.0})[3]
    assert late == (expected, "waited"), late  # its node's copy of the outcome; not among the arrived


def test_a_rank_with_no_nodes_store_is_carried_by_itself_and_its_node_does_not_wait_the_deadline():
    job, keys = Job(6, 2), RoundKeys("test/tier/solo")
    rank, counters = rank_fn(job, keys, ROUND_GUARD_S, solo={5})
    start = time.monotonic()
    out = run_threads(rank, {r: 0.0 for r in range(6)})
    took = time.monotonic() - start
    assert all(out[r][0]["arrived"] == [0, 1, 2, 3, 4, 5] and out[r][0]["ok"] for r in range(6)), out
    assert out[5][1] == "solo" and out[4][1] == "carried", out
    assert counters[5].calls["append"] == 1  # its rank in the round's list of solos
    # Rank 4 learned from that list that rank 5 goes alone, at its node's first ask (0.5 s), not at
    # the node's deadline (27 s here); the bound is a hang guard.
    assert took < ROUND_GUARD_S / 2, took


def test_a_node_whose_missing_rank_is_known_dead_carries_early_and_the_round_settles_early():
    job, keys = Job(6, 2), RoundKeys("test/tier/dead")
    rank, _ = rank_fn(job, keys, ROUND_GUARD_S, dead={1})
    start = time.monotonic()
    out = run_threads(rank, {r: 0.0 for r in range(6) if r != 1})
    took = time.monotonic() - start
    assert all(out[r][0] == {"arrived": [0, 2, 3, 4, 5], "ok": False, "how": "early"} for r in out), out
    assert took < ROUND_GUARD_S / 2, took  # at the node's first ask, not at the deadline (a hang guard)


def test_a_nodes_store_that_dies_under_its_ranks_leaves_each_the_jobs_store():
    job, keys = Job(4, 2), RoundKeys("test/tier/gone")
    rank, _ = rank_fn(job, keys, 4.0)  # rank 3 never comes: the round is given up at 4 s
    out: dict[int, Any] = {}
    watcher = connect("127.0.0.1", job.nodes[0].port, ROUND_GUARD_S)  # before the round (rank_fn's doc)
    node0 = threading.Thread(target=lambda: out.update(run_threads(rank, {0: 0.0, 1: 0.0})))
    node0.start()
    # Node 0's two ranks met there and one of them carries (its claim is made); the other waits for
    # the outcome in the node's store, which goes with its server before the outcome is copied in.
    wait_for(lambda: watcher.check([TierKeys(keys).claim]), ROUND_GUARD_S, "node 0's carrier")
    job.nodes[0] = None  # the server goes with its last reference
    out.update(run_threads(rank, {2: 0.0}))
    node0.join(JOIN_GUARD_S)
    assert not node0.is_alive()
    expected = {"arrived": [0, 1, 2], "ok": False, "how": "given up"}
    assert all(out[r][0] == expected for r in range(3)), out
    assert sorted(out[r][1] for r in (0, 1)) == ["carried", "fell_back"], out


def test_a_rank_whose_nodes_store_dies_before_it_was_carried_goes_by_itself():
    job, keys = Job(4, 2), RoundKeys("test/tier/gone-early")
    # Rank 0 has no client of its node's store: one connected to a server on its way out could wait
    # out its bound (seen under load), where the test means a rank whose node's store is gone.
    rank, _ = rank_fn(job, keys, 4.0, solo={0})
    # Rank 1 counted itself in node 0's store; the store goes before rank 0 comes. Rank 1 then goes
    # to the job's store by itself (named there), and rank 0, with no node's store, does too.
    out: dict[int, Any] = {}
    watcher = connect("127.0.0.1", job.nodes[0].port, ROUND_GUARD_S)  # before the round (rank_fn's doc)
    first = threading.Thread(target=lambda: out.update(run_threads(rank, {1: 0.0})))
    first.start()
    wait_for(lambda: watcher.check([keys.count]), ROUND_GUARD_S, "rank 1's count in its node")
    job.nodes[0] = None
    out.update(run_threads(rank, {0: 0.0, 2: 0.0, 3: 0.0}))
    first.join(JOIN_GUARD_S)
    assert not first.is_alive()
    assert all(out[r][0] == {"arrived": [0, 1, 2, 3], "ok": True, "how": "everyone"} for r in range(4)), out
    assert (out[0][1], out[1][1]) == ("solo", "solo"), out


def test_a_nodes_carried_arrivals_are_read_under_their_bound_and_only_for_its_own_ranks():
    job, keys = Job(6, 2), RoundKeys("test/tier/hostile")
    tier = TierKeys(keys)
    store = connect("127.0.0.1", job.server.port, ROUND_GUARD_S)
    peek = TierPeek(store, tier, TierPlace(0, job.node_of, None), 64)
    store.set(tier.nodes.arrival(0), encode(Carried(node=0, arrivals={0: '{"a":0}', 3: '{"a":3}'})))
    store.set(tier.nodes.arrival(1), "x" * 10_000)  # over 2 x 64 bytes x 2 ranks + 4096
    store.set(keys.arrival(4), '{"a":4}')
    store.append(tier.solos, "4,9999,two,")
    # Rank 3 is not on node 0: left out there; node 1's value is over its bound: its ranks 2 and 3
    # unreadable; the solos' list keeps its one valid rank.
    assert peek.arrivals() == {0: b'{"a":0}', 2: b"", 3: b"", 4: b'{"a":4}'}
    assert peek.present() == [0, 2, 3, 4]
    with pytest.raises(ValidationError):
        Carried(node=0, arrivals={r: "{}" for r in range(65)})
    with pytest.raises(ValueError, match="not a placement"):
        TierPlace(6, job.node_of, None)


@pytest.mark.parametrize("mode, requests", [("tier", 4), ("flat", 2)])
def test_the_scale_harness_settles_1024_real_statements_in_a_fixed_number_of_requests(mode, requests):
    """benchmarks/commit_tier_scale.py's settling step, on 1,024 real ``CommitStatement``s carried by
    128 nodes of 8 (``tier``: the real ``TierPeek``'s check and multi_get of the nodes, the solos'
    check, the compare_set) or set one a rank (``flat``: one multi_get, the compare_set): every rank
    arrived, the outcome ok, in the same few requests at any size."""
    bench = load_benchmark("commit_tier_scale")
    server = node_store.serve(ROUND_GUARD_S, fresh=True)
    client = connect("127.0.0.1", server.port, ROUND_GUARD_S)
    keys, size = RoundKeys("bench/commit"), 1024
    if mode == "tier":
        for n in range(size // bench.PER_NODE):
            ranks = range(n * bench.PER_NODE, (n + 1) * bench.PER_NODE)
            carried = Carried(node=n, arrivals={r: bench.statement_text(r, size) for r in ranks})
            client.set(TierKeys(keys).nodes.arrival(n), encode(carried))
    else:
        client.multi_set([keys.arrival(r) for r in range(size)], [bench.statement_text(r, size) for r in range(size)])
    counted = Counting(client)
    outcome, _ = bench._settle(counted, mode, size, keys)
    said = json.loads(outcome)
    assert said["ok"] and said["arrived"] == list(range(size)) and said["failed"] == {}, said
    assert sum(counted.calls.values()) == requests, counted.calls
    assert json.loads(client.get(keys.outcome)) == said
