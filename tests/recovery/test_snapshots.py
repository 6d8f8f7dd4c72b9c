"""The snapshots' pure parts, without processes: placement, the restore's choice, packing and its
digest, the codec's refusals, how often the keeper takes one. The multi-rank paths:
tests/recovery/test_sharded_heal_multirank.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ncclguard.errors import HealFailed
from ncclguard.recovery.options import recovery_options
from ncclguard.recovery.snapshots.keeper import Keeper
from ncclguard.recovery.snapshots.packing import Snapshot, pack, read_manifest, unpack
from ncclguard.recovery.snapshots.placement import buddies, sources
from ncclguard.recovery.snapshots.restore import choose
from ncclguard.recovery.snapshots.state import ModuleState


def test_one_host_puts_each_replica_on_the_next_rank() -> None:
    assert buddies([7, 7, 7]) == [1, 2, 0]
    assert buddies([7]) == [-1]
    assert sources([1, 2, 0], 0) == [2]


def test_two_hosts_put_each_replica_on_the_other_host_at_the_same_place() -> None:
    assert buddies([5, 5, 9, 9]) == [2, 3, 0, 1]
    # hosts in the order their first rank appears, whatever their numbers
    assert buddies([9, 9, 5, 5, 1, 1]) == [2, 3, 4, 5, 0, 1]
    # a smaller host: its ranks are reused
    assert buddies([1, 1, 1, 2]) == [3, 3, 3, 0]


@given(st.lists(st.integers(0, 3), min_size=2, max_size=16))
def test_a_replica_is_never_on_its_own_rank_nor_on_its_own_host_when_there_is_another(hosts: list[int]) -> None:
    out = buddies(hosts)
    for r, b in enumerate(out):
        assert b != r and 0 <= b < len(hosts)
        if len(set(hosts)) > 1:
            assert hosts[b] != hosts[r]


def holdings(own: list[int], replicas: dict[int, list[int]], size: int) -> list[int]:
    out = [-1, -1] + [-1, -1] * size
    out[: len(own)] = own
    for src, steps in replicas.items():
        out[2 + 2 * src : 2 + 2 * src + len(steps)] = steps
    return out


def test_the_restore_chooses_the_newest_step_every_survivor_holds_with_a_replica_for_each_receiver() -> None:
    size = 3
    # rank 1 restarted; rank 2 holds its replicas of steps 4 and 6; every survivor holds 4 and 6
    h = [holdings([4, 6], {2: [4, 6]}, size), [-1] * 8, holdings([4, 6], {1: [4, 6]}, size)]
    assert choose(h, [1]) == (6, {1: 2})
    # the swap of step 6 did not reach rank 2: back to 4
    h[2] = holdings([4, 6], {1: [2, 4]}, size)
    assert choose(h, [1]) == (4, {1: 2})


def test_the_restore_says_what_is_missing() -> None:
    h = [holdings([4, 6], {}, 3), [-1] * 8, [-1] * 8]
    assert "rank(s) 1-2" in str(choose(h, [1, 2]))  # each one's replica was on the other, lost too
    assert "no rank holds a snapshot" in str(choose([[-1] * 6, [-1] * 6], [0, 1]))
    assert "hold no snapshot of one same step" in str(choose([holdings([2], {}, 2), holdings([3], {}, 2)], []))


def small() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    module(torch.randn(5, 3)).sum().backward()
    opt.step()
    return module, opt


def test_a_state_packs_and_unpacks_to_the_same_tensors_and_goes_back_into_a_fresh_model() -> None:
    module, opt = small()
    codec = ModuleState(lambda: module, lambda: opt)
    snap = pack(codec.capture(), step=5, rank=0)
    assert all(e.offset % 64 == 0 for e in snap.manifest.entries)
    again = read_manifest(snap.manifest.model_dump_json().encode(), "test")
    state = unpack(Snapshot(again, snap.payload.clone()))
    fresh, fresh_opt = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)), None
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    target = ModuleState(lambda: fresh, lambda: fresh_opt)
    assert target.check(state) is None
    target.apply(state)
    for a, b in zip([*module.parameters(), *module.buffers()], [*fresh.parameters(), *fresh.buffers()], strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    for p, q in zip(module.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])


def test_a_damaged_snapshot_is_refused_before_it_is_read() -> None:
    module, opt = small()
    snap = pack(ModuleState(lambda: module, lambda: opt).capture(), step=1, rank=0)
    snap.payload[3] ^= 1
    with pytest.raises(HealFailed, match="damaged"):
        unpack(snap)


def test_a_state_that_does_not_fit_is_refused_naming_what_differs() -> None:
    module, opt = small()
    state = unpack(pack(ModuleState(lambda: module, lambda: opt).capture(), step=1, rank=0))
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 1))
    why = ModuleState(lambda: wider, lambda: torch.optim.Adam(wider.parameters())).check(state)
    assert why == "0.weight is float32[4, 3] in the snapshot and float32[5, 3] here"
    doubled = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
    why = ModuleState(lambda: doubled, lambda: torch.optim.Adam(doubled.parameters())).check(state)
    assert why == "0.weight is float32[4, 3] in the snapshot and float64[4, 3] here"
    assert "disagree on whether there is an optimizer" in str(ModuleState(lambda: module, None).check(state))
    state.meta["layout"] = {"rank": 1, "world_size": 4}
    why = ModuleState(lambda: module, lambda: opt).check(state)
    assert why == "the snapshot was taken by rank 1 of a world of 4; this is rank 0 of 1"


def test_the_keeper_takes_one_as_often_as_keeps_it_under_its_budget() -> None:
    module, opt = small()
    keeper = Keeper(ModuleState(lambda: module, lambda: opt))
    assert keeper.due(0)  # the first step always
    keeper.force = False
    assert keeper._wanted_k() == 1  # no step time seen yet
    keeper._step_time, keeper._cost = 0.1, 0.01  # a take costs 10% of a step: every 5 steps for 2%
    assert keeper._wanted_k() == math.ceil(0.01 / (0.02 * 0.1)) == 5
    keeper._cost = 1e-5
    assert keeper._wanted_k() == 1
    keeper._cost = 1e6
    assert keeper._wanted_k() == 1000  # the cap
    keeper.next_due = 12
    assert not keeper.due(11) and keeper.due(12)


def test_snapshot_every_is_checked_before_anything_runs() -> None:
    assert recovery_options(snapshot_every=3).snapshot_every == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="snapshot_every must be None"):
            recovery_options(snapshot_every=bad)  # type: ignore[arg-type]
