"""The rebuild's meeting through the node tier (recovery/_rebuild/meeting.py ``meet(..., tier)``),
threads as ranks on real TCPStores (tests/tier_kit.py): 6 ranks of a world on 3 nodes of 2. The
settling rank reads the arrivals once and puts the members' roster in the outcome; no member reads
them, and only one carrier a node talks to the job's store."""

from __future__ import annotations

import collections
from typing import Any

from tier_kit import ROUND_GUARD_S, Job, run_threads

from ncclguard.deadlines import Deadline
from ncclguard.recovery._rebuild.meeting import Arrival, Meeting, MeetingOutcome, Roster, forget_meeting, meet
from ncclguard.store.clients import connect
from ncclguard.store.tier_round import TierPlace


def arrival(rank: int, size: int = 6, **over: Any) -> Arrival:
    fields = dict(rank=rank, world_size=size, generation=0, backend="gloo", allow_shrink=False, host="h", pid=1)
    fields |= {"origin": 10 + rank, **over}  # launch ranks of their own: the roster must carry them
    return Arrival(**fields)


def meet_all(
    job: Job, attempt: int, ranks: dict[int, Arrival], deadline_s: float, guarded: frozenset[int] = frozenset()
) -> tuple[dict, dict]:
    """Each rank of ``ranks`` meets (its own clients, its node's store), those in ``guarded`` with a
    hang guard for a deadline (they never settle a give-up); the meetings and the job store's
    requests, by rank."""
    clients = {r: job.clients(r) for r in ranks}

    def one(r: int) -> Meeting:
        store, near = clients[r]
        deadline = Deadline.within(ROUND_GUARD_S if r in guarded else deadline_s)
        return meet(store, ranks[r], attempt, deadline, TierPlace(r, job.node_of, near))

    out = run_threads(one, dict.fromkeys(ranks, 0.0))
    return out, {r: clients[r][0].calls for r in ranks}


def forget_all(job: Job, out: dict[int, Meeting]) -> dict[str, list[str]]:
    """Each member forgets its meeting (as after the new world's group is built: one thread each);
    then every key left under the meetings' prefix, in the job's store and in each node's."""
    run_threads(
        lambda r: forget_meeting(job.clients(r)[0], out[r], Deadline.within(ROUND_GUARD_S)), dict.fromkeys(out, 0.0)
    )
    left = {}
    for name, server in [("job", job.server), *((f"node {n}", node) for n, node in enumerate(job.nodes))]:
        client = connect("127.0.0.1", server.port, ROUND_GUARD_S)
        left[name] = sorted(k for k in client.list_keys() if k.startswith("ncclguard/rebuild/"))
    return left


def test_six_ranks_meet_through_their_nodes_and_the_outcome_carries_the_roster():
    job = Job(6, 2)
    ranks = {r: arrival(r, rejoined=(r == 3)) for r in range(6)}
    out, calls = meet_all(job, 0, ranks, ROUND_GUARD_S)
    roster = Roster(origins=[10, 11, 12, 13, 14, 15], rejoined=[3], problem=None, world_size=6)
    for r in range(6):
        m = out[r]
        assert isinstance(m, Meeting) and m.goes_on and not m.late, (r, m)
        assert m.outcome == MeetingOutcome(arrived=[0, 1, 2, 3, 4, 5], ok=True, roster=roster)
        assert (m.origins(), m.rejoined(), m.problem) == ([10, 11, 12, 13, 14, 15], [3], None)
    talking = sorted(r for r, c in calls.items() if c)
    assert len(talking) == 3 and {job.node_of[r] for r in talking} == {0, 1, 2}, calls
    total = sum((calls[r] for r in talking), collections.Counter())
    # No member reads the arrivals: a set and an add a carrier; the settler's one multi_get of every
    # node's value and its compare_set; the others wait for the outcome and get it. The checks are
    # the settler's (the nodes' values, the solos' list) and the first carrier's looks for an outcome
    # and for death notices, their number the loaded machine's.
    assert (total["set"], total["add"], total["multi_get"], total["compare_set"]) == (3, 3, 1, 1), total
    # Once the new world is built, the members delete the meeting's keys but its outcome, in every store.
    outcome = "ncclguard/rebuild/g1/t0/v"
    assert forget_all(job, out) == {"job": [outcome], "node 0": [outcome], "node 1": [outcome], "node 2": [outcome]}


def test_a_shrink_through_the_tier_names_the_late_rank_and_a_rank_refusing_it_stops_all():
    job = Job(6, 2)
    ranks = {r: arrival(r, allow_shrink=True) for r in range(6) if r != 4}
    out, _ = meet_all(job, 0, ranks, 3.0)  # rank 4 never comes: given up at 3 s, the node's at 2.7 s
    for r in ranks:
        m = out[r]
        assert m.goes_on and m.outcome.arrived == [0, 1, 2, 3, 5] and m.outcome.shrunk, (r, m)
        assert m.origins() == [10, 11, 12, 13, 15]
    # Rank 4, node 2's first rank, never came: rank 5 deletes node 2's keys. A late rank still finds
    # the outcome.
    outcome = "ncclguard/rebuild/g1/t0/v"
    assert forget_all(job, out) == {"job": [outcome], "node 0": [outcome], "node 1": [outcome], "node 2": [outcome]}
    late = meet_all(job, 0, {4: arrival(4, allow_shrink=True)}, ROUND_GUARD_S)[0][4]
    assert late.late and not late.goes_on and late.outcome == out[0].outcome
    # The next attempt: rank 1 refuses a shrink that another rank settles (rank 1's own deadline is
    # a hang guard); every member refuses.
    ranks = {r: arrival(r, allow_shrink=r != 1) for r in range(6) if r != 4}
    out, _ = meet_all(job, 1, ranks, 3.0, guarded=frozenset({1}))
    for r in ranks:
        assert out[r].outcome.ok and not out[r].goes_on, (r, out[r])
        assert "ranks [1] passed allow_shrink=False" in out[r].problem
