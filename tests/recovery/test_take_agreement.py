"""A take's agreement and its deadline, without a job: threads as ranks on torch's HashStore.

The round runs in the job's store, so it holds whatever a failed swap left of the side group: every
rank there, the take fails alone (the step goes on); a rank missing or dead, the step fails.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from tier_kit import ROUND_GUARD_S, Job, run_threads

from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed
from ncclguard.recovery.snapshots.agreement import (
    SLACK,
    SLOW_LINK_BYTES_PER_S,
    TAKE_FAILED,
    TAKE_OK,
    TAKE_REFUSED,
    TakeOutcome,
    TakeStatement,
    TakeTier,
    agree,
    decide,
    keeper_serial,
    take_deadline_s,
    take_keys,
)
from ncclguard.store.tier_round import TierKeys

HANG_GUARD_S = 60.0  # the hang guard of a wait here (run_threads joins its threads within the same 60 s)


def _ranks(run, size: int) -> dict[int, object]:
    """``run(rank)`` on a thread per rank; what each returned or raised."""
    return run_threads(run, dict.fromkeys(range(size), 0.0))


def _nobody_dead(deadline: Deadline) -> dict[int, str]:
    return {}


def test_a_take_of_two_gigabytes_is_not_held_to_the_deadline_of_two_megabytes():
    small, big = take_deadline_s(2 * 2**20, None, 60.0), take_deadline_s(2 * 2**30, None, 60.0)
    assert small == pytest.approx(60.0 + 2 * 2**20 / SLOW_LINK_BYTES_PER_S)
    assert big == pytest.approx(60.0 + 2 * 2**30 / SLOW_LINK_BYTES_PER_S) and big > 100.0
    # A job whose takes showed a slower link than the floor's gets SLACK times that rate.
    slow = 1.0 / (10 * 2**20)  # 10 MiB/s seen
    assert take_deadline_s(2**30, slow, 60.0) == pytest.approx(60.0 + SLACK * 2**30 * slow)
    # A faster link than the floor's never shortens it.
    assert take_deadline_s(2**30, 1e-12, 60.0) == take_deadline_s(2**30, None, 60.0)


@given(
    nbytes=st.integers(0, 2**40),
    per_byte=st.one_of(st.none(), st.floats(0, 1e-3)),
    floor=st.floats(0.1, 3600),
)
def test_the_deadline_is_at_least_the_floor_and_grows_with_the_bytes(nbytes, per_byte, floor):
    d = take_deadline_s(nbytes, per_byte, floor)
    assert d >= floor and take_deadline_s(nbytes + 2**20, per_byte, floor) > d


def test_the_outcome_is_the_worst_kind_the_largest_k_and_each_reason():
    said = {
        0: TakeStatement(rank=0, kind=TAKE_OK, want=3),
        1: TakeStatement(rank=1, kind=TAKE_REFUSED, want=5, why="its manifest names a tensor rank 2 does not have"),
        2: TakeStatement(rank=2, kind=TAKE_OK, want=1),
    }
    out = decide(said, 3)
    assert out == TakeOutcome(kind=TAKE_REFUSED, k=5, whys={1: "its manifest names a tensor rank 2 does not have"})
    said[2] = None  # unreadable: taken as failed
    assert decide(said, 3).kind == TAKE_FAILED and decide(said, 3).whys[2] == "its statement could not be read"
    missing = decide({0: said[0]}, 3, {2: "killed by signal 9", 7: "another world's"})
    assert (missing.kind, missing.k, missing.missing, missing.dead) == (
        TAKE_FAILED,
        0,
        [1, 2],
        {2: "killed by signal 9"},
    )


def test_every_rank_there_reads_one_outcome_and_the_rounds_keys_go_with_the_next_take():
    store = dist.HashStore()
    kinds = {0: TAKE_OK, 1: TAKE_FAILED, 2: TAKE_OK}

    def run(r: int, n: int, kind: int) -> TakeOutcome:
        why = "the deadline passed before the replica of rank 0" if kind == TAKE_FAILED else ""
        previous = take_keys(4, 1, n - 1) if n else None
        return agree(
            store, take_keys(4, 1, n), previous, TakeStatement(rank=r, kind=kind, want=r + 1, why=why), 3,
            Deadline.within(30), _nobody_dead,
        )  # fmt: skip

    first = _ranks(lambda r: run(r, 0, kinds[r]), 3)
    expected = TakeOutcome(kind=TAKE_FAILED, k=3, whys={1: "the deadline passed before the replica of rank 0"})
    assert first == {0: expected, 1: expected, 2: expected}
    second = _ranks(lambda r: run(r, 1, TAKE_OK), 3)
    assert second == {r: TakeOutcome(kind=TAKE_OK, k=3) for r in range(3)}
    # The first round's keys went with the second: each rank deleted its statement, rank 0 the rest.
    keys = take_keys(4, 1, 0)
    assert not any(store.check([k]) for k in keys.every(3))
    assert store.check([take_keys(4, 1, 1).outcome])  # the newest stays for a late reader


def test_a_rank_that_never_comes_fails_the_step_at_the_deadline_or_at_once_when_it_is_known_dead():
    store = dist.HashStore()
    st0 = TakeStatement(rank=0, kind=TAKE_OK, want=1)
    t0 = time.monotonic()
    with pytest.raises(HealFailed, match=r"rank\(s\) \[1\] did not come within 1 s"):
        agree(store, take_keys(0, 1, 0), None, st0, 2, Deadline.within(1.0), _nobody_dead)
    assert time.monotonic() - t0 < HANG_GUARD_S

    def dead(deadline: Deadline) -> dict[int, str]:
        return {1: "its launcher posted: killed by signal 9"}

    t0 = time.monotonic()
    with pytest.raises(HealFailed, match=r"rank\(s\) \[1\] did not come \(rank 1: its launcher posted: killed by"):
        agree(store, take_keys(0, 1, 1), None, st0, 2, Deadline.within(HANG_GUARD_S), dead)
    # At the first look at the notices (0.5 s), not at the hang guard's deadline.
    assert time.monotonic() - t0 < HANG_GUARD_S / 3


def test_a_second_keeper_in_one_world_never_reads_the_first_ones_last_outcome():
    """The last take of a keeper leaves its outcome for a late reader. Seen on 4 ranks: a reference
    run's keeper, then the run under test's, in one world and one process; the second keeper's third
    take met the first one's third outcome ("ok") and committed while a rank was dead in it."""
    store = dist.HashStore()
    serials = _ranks(lambda r: [keeper_serial(store, 0, r, Deadline.within(30)) for _ in range(2)], 3)
    assert serials == {0: [1, 2], 1: [1, 2], 2: [1, 2]}  # one number per keeper, the same on every rank
    first = take_keys(0, 1, 2)
    _ranks(
        lambda r: agree(
            store, first, None, TakeStatement(rank=r, kind=TAKE_OK, want=1), 3, Deadline.within(30), _nobody_dead
        ),
        3,
    )
    assert store.check([first.outcome])  # left for a late reader
    second = take_keys(0, 2, 2)  # the second keeper's third take
    assert second.outcome != first.outcome
    with pytest.raises(HealFailed, match=r"rank\(s\) \[1, 2\] did not come"):
        agree(store, second, None, TakeStatement(rank=0, kind=TAKE_OK, want=1), 3, Deadline.within(0.5), _nobody_dead)
    # A restarted process counts on from its predecessor's keepers (the count is in the store), and
    # a new world counts from 1.
    assert keeper_serial(store, 0, 1, Deadline.within(30)) == 3
    assert keeper_serial(store, 1, 1, Deadline.within(30)) == 1


def test_six_ranks_on_three_nodes_agree_through_the_tier_and_only_one_carrier_a_node_talks_to_the_jobs_store():
    """With the node tier on, a take's round goes through it as a commit's does (docs/scale.md): the
    same outcome on every rank, a node's ranks meeting in its store, one carrier a node making the
    job store's requests; the round before deleted in both stores; a rank missing fails the step."""
    job = Job(6, 2)
    clients = {r: job.clients(r) for r in range(6)}
    tiers = {r: TakeTier(job.node_of, near=clients[r][1]) for r in range(6)}
    kinds = {r: TAKE_FAILED if r == 4 else TAKE_OK for r in range(6)}

    def run(r: int, n: int, kind: int, deadline_s: float = ROUND_GUARD_S) -> TakeOutcome:
        why = "the deadline passed before the replica of rank 5" if kind == TAKE_FAILED else ""
        previous = take_keys(2, 1, n - 1) if n else None
        statement = TakeStatement(rank=r, kind=kind, want=r + 1, why=why)
        return agree(
            clients[r][0],
            take_keys(2, 1, n),
            previous,
            statement,
            6,
            Deadline.within(deadline_s),
            _nobody_dead,
            tiers[r],
        )

    first = run_threads(lambda r: run(r, 0, kinds[r]), dict.fromkeys(range(6), 0.0))
    expected = TakeOutcome(kind=TAKE_FAILED, k=6, whys={4: "the deadline passed before the replica of rank 5"})
    assert first == dict.fromkeys(range(6), expected)
    talking = sorted(r for r in range(6) if clients[r][0].calls)
    assert len(talking) == 3 and {job.node_of[r] for r in talking} == {0, 1, 2}, {
        r: c[0].calls for r, c in clients.items()
    }
    keys, look = take_keys(2, 1, 0), clients[0][0]  # its requests are no longer counted
    in_job = [keys.count, keys.outcome, *(TierKeys(keys).nodes.arrival(n) for n in range(3))]
    near = {r: clients[r][1] for r in range(6)}  # each rank's arrival, in its node's store

    def left() -> list[bool]:
        return [look.check([k]) for k in in_job] + [near[r].check([keys.arrival(r)]) for r in range(6)]

    assert all(left())
    second = run_threads(lambda r: run(r, 1, TAKE_OK), dict.fromkeys(range(6), 0.0))
    assert second == {r: TakeOutcome(kind=TAKE_OK, k=6) for r in range(6)}
    assert not any(left())  # the first round's keys went with the second, in both stores
    assert look.check([take_keys(2, 1, 1).outcome])  # the newest stays for a late reader
    # Rank 5 never comes: every other rank fails the step, naming it.
    third = run_threads(lambda r: run(r, 2, TAKE_OK, 3.0), dict.fromkeys(range(5), 0.0))
    for r in range(5):
        assert isinstance(third[r], HealFailed) and "rank(s) [5] did not come" in str(third[r]), (r, third[r])
