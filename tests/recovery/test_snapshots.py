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
from ncclguard.recovery.snapshots.keeper import SLOTS, Keeper
from ncclguard.recovery.snapshots.packing import (
    Manifest,
    Snapshot,
    admit_fresh,
    admit_peer,
    consistent,
    digest,
    pack,
    read_manifest,
    unpack,
)
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
    out = [-1] * (SLOTS * (1 + size))
    out[: len(own)] = own
    for src, steps in replicas.items():
        out[SLOTS * (1 + src) : SLOTS * (1 + src) + len(steps)] = steps
    return out


NONE = [-1] * (SLOTS * 4)


def test_the_restore_chooses_the_newest_step_every_survivor_holds_with_a_replica_for_each_receiver() -> None:
    size = 3
    # rank 1 restarted; rank 2 holds its replicas of steps 4 and 6; every survivor holds 4 and 6
    h = [holdings([4, 6], {2: [4, 6]}, size), NONE, holdings([4, 6], {1: [4, 6]}, size)]
    assert choose(h, [1]) == (6, {1: 2})
    # the swap of step 6 did not reach rank 2: back to 4
    h[2] = holdings([4, 6], {1: [2, 4]}, size)
    assert choose(h, [1]) == (4, {1: 2})


def test_a_refused_step_falls_back_to_the_next_one_every_survivor_and_a_holder_share() -> None:
    size = 3
    # keep=2: every survivor holds 4 and 6 of its own, rank 2 rank 1's replicas of both
    h = [holdings([4, 6], {2: [4, 6]}, size), NONE, holdings([4, 6], {1: [4, 6]}, size)]
    assert choose(h, [1], {6}) == (4, {1: 2})  # rank 1 refused 6 (damaged): back to 4
    assert "was refused by a receiver (step(s) [4, 6] refused)" in str(choose(h, [1], {4, 6}))
    # a pending take (its agreement failed on rank 0): rank 0 holds 8 pending, the others never got it
    h[0] = holdings([6, 8], {2: [6]}, size)
    h[2] = holdings([6], {1: [6]}, size)
    assert choose(h, [1]) == (6, {1: 2})


def test_the_restore_says_what_is_missing() -> None:
    h = [holdings([4, 6], {}, 3), NONE, NONE]
    assert "rank(s) 1-2" in str(choose(h, [1, 2]))  # each one's replica was on the other, lost too
    assert "no rank holds a snapshot" in str(choose([[-1] * 9, [-1] * 9], [0, 1]))
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


# --- admission: a bound from the shape of the state, never from a guess -----------------------------


def real_size() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """2.2M parameters (as the FSDP2 model the restarted rank could not take): Adam's moments triple it."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    )
    return module, torch.optim.Adam(module.parameters(), lr=1e-3)


def test_a_restarted_rank_admits_a_real_size_replica_whose_optimizer_state_it_does_not_have_yet() -> None:
    module, opt = real_size()
    module(torch.randn(8, 64)).sum().backward()
    opt.step()
    replica = pack(ModuleState(lambda: module, lambda: opt).capture(), step=4, rank=0)
    fresh_module, fresh_opt = real_size()  # a restarted process: no Adam state before its first step
    fresh = ModuleState(lambda: fresh_module, lambda: fresh_opt).capture()
    fresh_bytes = sum(t.numel() * t.element_size() for t in fresh.tensors.values())
    assert replica.manifest.nbytes > 2 * fresh_bytes + (1 << 20)  # the old bound refused it
    assert admit_fresh(replica.manifest, fresh) is None
    # another model's replica: named what differs, before a byte of it is allocated
    other = torch.nn.Sequential(torch.nn.Linear(64, 512))
    why = admit_fresh(replica.manifest, ModuleState(lambda: other, None).capture())
    assert why is not None and "0.weight is float32[1024, 64] in the replica and float32[512, 64] here" in why


def manifest(entries: list[tuple[str, str, list[int]]], nbytes: int | None = None, **extra: object) -> Manifest:
    out, offset = [], 0
    for name, dtype, shape in entries:
        out.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset})
        offset += -(-math.prod(shape) * getattr(torch, dtype).itemsize // 64) * 64
    return Manifest.model_validate(
        {"step": 1, "rank": 0, "entries": out, "nbytes": offset if nbytes is None else nbytes, "digest": "x", **extra}
    )


def test_absurd_or_inconsistent_manifests_are_refused_before_any_payload() -> None:
    module, opt = real_size()
    fresh = ModuleState(lambda: module, lambda: opt).capture()
    ok = manifest([("p:0.weight", "float32", [1024, 64]), ("o:0", "float32", [1024, 1024])])
    assert consistent(ok) is None and admit_fresh(ok, fresh) is None
    assert "not the 999 it declares" in str(consistent(manifest([("p:0.weight", "float32", [1024, 64])], nbytes=999)))
    huge = manifest([("o:0", "float32", [1 << 20, 1 << 20])], nbytes=4 << 40)
    assert "larger than any tensor of this rank's state" in str(admit_fresh(huge, fresh))
    many = manifest([(f"o:{i}", "float32", [1]) for i in range(4 * len(fresh.tensors) + 65)])
    assert "tensors this rank's state does not name" in str(admit_fresh(many, fresh))
    assert "not a torch dtype" in str(
        consistent(
            manifest([("o:0", "float32", [1])]).model_copy(
                update={"entries": [ok.entries[0].model_copy(update={"dtype": "os.system"})]}
            )
        )
    )
    with pytest.raises(HealFailed, match="cannot be read"):  # a negative size is no manifest at all
        read_manifest(manifest([("o:0", "float32", [1])]).model_dump_json().replace("[1]", "[-1]").encode(), "a peer's")


def test_a_buddys_replica_must_name_this_ranks_tensors_and_be_at_most_a_shard_of_them() -> None:
    module, opt = real_size()
    mine = pack(ModuleState(lambda: module, lambda: opt).capture(), step=2, rank=1).manifest
    assert admit_peer(mine.model_copy(update={"rank": 0}), mine, 3) is None
    wider = manifest([(e.name, e.dtype, [4 * max(e.shape[0], 1), *e.shape[1:]]) for e in mine.entries])
    assert "more than a shard of a tensor" in str(admit_peer(wider, mine, 3))
    fewer = manifest([(e.name, e.dtype, e.shape) for e in mine.entries[1:]])
    assert "its tensors are not this rank's" in str(admit_peer(fewer, mine, 3))


def test_the_digest_sees_one_flipped_bit_in_any_piece_of_a_large_buffer() -> None:
    payload = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)  # three pieces of 16 MiB
    before = digest(payload)
    assert digest(payload.clone()) == before
    for at in (0, (16 << 20) + 5, payload.numel() - 1):
        payload[at] ^= 1
        assert digest(payload) != before
        payload[at] ^= 1


# --- the keeper in a world of one: commits, keeps and spares --------------------------------------------


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_world_of_one_keeps_its_own_snapshots_and_a_commit_frees_the_oldest(world_of_one) -> None:
    from ncclguard.recovery._step.state import StepState

    module, opt = real_size()
    for keep, spares in ((1, False), (2, False), (1, True)):
        keeper = Keeper(ModuleState(lambda: module, lambda: opt), every=1, keep=keep, spares=spares)
        buffers = []
        for step in range(3):
            keeper.take(step, StepState.take(module))
            buffers.append(keeper.own[-1].payload.data_ptr())
        assert [s.step for s in keeper.own] == [0, 1, 2][-keep:]
        assert keeper.pending is None and keeper.replicas == {} and keeper.takes == 3
        assert keeper.holdings(1) == ([0, 1, 2][-keep:] + [-1] * SLOTS)[:SLOTS] + [-1] * SLOTS
        if spares:  # the buffer the commit of step 1 freed (step 0's) took step 2
            assert buffers[2] == buffers[0]
    with pytest.raises(ValueError, match="keep must be 1 or 2"):
        Keeper(ModuleState(lambda: module, None), keep=3)


def test_a_memory_cap_drops_the_spares_then_the_second_snapshot_and_says_what_it_cannot_meet(
    world_of_one, caplog
) -> None:
    from ncclguard.recovery._step.state import StepState
    from ncclguard.recovery.snapshots.memory import Fit, MemoryCap, steady_bytes

    assert [steady_bytes(100, k, s) for k, s in ((1, False), (2, False), (1, True), (2, True))] == [100, 200, 200, 300]
    assert MemoryCap(None).fit(100, 2, True) == Fit(2, True, (), 300, False)
    assert MemoryCap(250).fit(100, 2, True) == Fit(2, False, ("the spare buffers",), 200, False)
    both = ("the spare buffers", "the second snapshot kept of each")
    assert MemoryCap(150).fit(100, 2, True) == Fit(1, False, both, 100, False)
    assert MemoryCap(199).fit(100, 2, False) == Fit(1, False, ("the second snapshot kept of each",), 100, False)
    cap = MemoryCap(50)
    assert cap.fit(100, 2, True) == Fit(1, False, both, 100, True)  # one snapshot is over it all the same
    assert cap.fit(1, 2, True) == Fit(1, False, both, 100, True)  # a smaller state: the fit made stands
    assert cap.fit(300, 2, True) == Fit(1, False, both, 300, True)  # a larger one: fitted again
    assert MemoryCap(250).fit(100, 1, False).dropped == () and MemoryCap(250).fit(300, 1, False).over
    # A real keeper (2.2M parameters with Adam, a world of one): asked for 2 snapshots and spares, under
    # a cap of 1.5 snapshots it keeps one, with no spare, and says why at its first take.
    module, opt = real_size()
    module(torch.randn(2, 64)).sum().backward()
    opt.step()  # Adam's moments exist: the state is its full size
    own = Keeper(ModuleState(lambda: module, lambda: opt), every=1)
    own.take(0, StepState.take(module))
    size = own.own[-1].manifest.nbytes
    keeper = Keeper(ModuleState(lambda: module, lambda: opt), every=1, keep=2, spares=True, max_bytes=size * 3 // 2)
    with caplog.at_level("WARNING", logger="ncclguard"):
        for step in range(3):
            keeper.take(step, StepState.take(module))
    assert (keeper.keep, keeper.spares, [s.step for s in keeper.own]) == (1, False, [2])
    said = [r.getMessage() for r in caplog.records if "snapshot_max_bytes" in r.getMessage()]
    assert len(said) == 1 and "the spare buffers and the second snapshot kept of each dropped" in said[0], said
    caplog.clear()
    small = Keeper(ModuleState(lambda: module, lambda: opt), every=1, max_bytes=size // 2)
    with caplog.at_level("WARNING", logger="ncclguard"):
        small.take(0, StepState.take(module))
        small.take(1, StepState.take(module))
    assert [s.step for s in small.own] == [1]  # kept all the same: nothing else restores this rank
    over = [r.getMessage() for r in caplog.records if "over snapshot_max_bytes" in r.getMessage()]
    assert len(over) == 1 and "Raise the cap, shard the state over more ranks, or turn heal off" in over[0]


def test_the_memory_line_and_the_cap_follow_the_state_once_adams_moments_exist(world_of_one, caplog) -> None:
    """The engine's first take comes before the optimizer's first step: Adam has no moments yet, a
    third of the state. Seen at 100M parameters: "holds 505 MiB in steady state" for 1.5 GB."""
    from ncclguard.recovery._step.state import StepState

    module, opt = real_size()
    first = Keeper(ModuleState(lambda: module, lambda: opt), every=1)
    first.take(0, StepState.take(module))
    before = first.own[-1].manifest.nbytes  # the parameters only
    caplog.clear()
    # A cap the first take fits in with both snapshots and spares (3 of them), the full state not.
    keeper = Keeper(ModuleState(lambda: module, lambda: opt), every=1, keep=2, spares=True, max_bytes=before * 3)
    with caplog.at_level("WARNING", logger="ncclguard"):
        keeper.take(0, StepState.take(module))
        assert (keeper.keep, keeper.spares) == (2, True)
        module(torch.randn(2, 64)).sum().backward()
        opt.step()  # the moments exist now
        keeper.take(1, StepState.take(module))
        keeper.take(2, StepState.take(module))
    after = keeper.own[-1].manifest.nbytes
    assert after > 2.9 * before  # parameters and two moments
    assert (keeper.keep, keeper.spares, [s.step for s in keeper.own]) == (1, False, [2])
    lines = [r.getMessage() for r in caplog.records if "keeps its own state" in r.getMessage()]
    assert len(lines) == 2 and f"({before / 2**20:.1f} MiB)" in lines[0] and f"({after / 2**20:.1f} MiB)" in lines[1]
    dropped = [r.getMessage() for r in caplog.records if "dropped to stay under snapshot_max_bytes" in r.getMessage()]
    assert len(dropped) == 1, dropped


@pytest.mark.parametrize("bad", [True, 0, -1, "64G", 1.5])
def test_a_memory_cap_that_is_no_count_of_bytes_is_refused_before_anything_runs(bad) -> None:
    with pytest.raises(ValueError, match="snapshot_max_bytes must be None"):
        recovery_options(heal=True, snapshot_max_bytes=bad)
    assert recovery_options(heal=True, snapshot_max_bytes=64 * 2**30).snapshot_max_bytes == 64 * 2**30


def test_k_is_the_budgets_until_a_failure_then_youngs_interval_when_that_is_shorter() -> None:
    from ncclguard.recovery.snapshots.interval import MAX_EVERY, budget_k, wanted_k, young_k

    # The 25M FSDP2 drill's figures: a take of 0.47 s, a step of 2.5 s.
    assert budget_k(0.47, 2.5, 0.02) == 10  # 0.47 / (0.02 x 2.5) = 9.4
    assert young_k(0.47, 2.5, 60.0) == 3  # sqrt(2 x 0.47 x 60) = 7.5 s: 3 steps
    assert wanted_k(0.47, 2.5, 0.02, None) == 10  # no failure yet: the budget alone
    assert wanted_k(0.47, 2.5, 0.02, 60.0) == 3  # a kill a minute: Young's, shorter
    assert wanted_k(0.47, 2.5, 0.02, 86400.0) == 10  # a failure a day: the budget's is shorter
    assert young_k(0.001, 10.0, 1.0) == 1 and budget_k(1000.0, 0.001, 0.02) == MAX_EVERY


def test_a_forced_take_after_failures_asks_youngs_k_not_the_one_in_force(world_of_one) -> None:
    """Kills closer than K steps apart make every take a forced one (the first after each restore).
    A forced take asked the K in force, so K never left the budget's: at 100M parameters (10 s steps,
    takes of 1.7 s, K = 10, a kill every 70 s) each kill went back 6 steps. It asks Young's K now
    where failures were seen and a take's cost is known."""
    import time

    from ncclguard.recovery._step.state import StepState
    from ncclguard.recovery.snapshots.interval import budget_k, young_k

    module, opt = real_size()
    keeper = Keeper(ModuleState(lambda: module, lambda: opt))
    keeper.take(0, StepState.take(module))  # the first: forced, asks the K in force (1)
    assert keeper.k == 1
    # What the drill's ranks had measured before the kills: a take of 1.7 s, steps of 10 s: K = 9.
    keeper._take_cost, keeper._step_time = 1.7, 10.0
    keeper.k, keeper.force = budget_k(1.7, 10.0, 0.02), True  # a restore forces the next take
    assert keeper.k == 9
    keeper._failures.note([time.time() - 210.0, time.time() - 140.0, time.time() - 70.0])  # a kill every 70 s
    keeper.take(1, StepState.take(module))
    assert keeper.k == young_k(1.7, 10.0, 70.0) == 2  # sqrt(2 x 1.7 x 70) = 15.4 s: 2 steps
    # With no failure seen, a forced take keeps the K in force.
    calm = Keeper(ModuleState(lambda: module, lambda: opt))
    calm._take_cost, calm._step_time, calm.k, calm.force = 1.7, 10.0, 9, True
    calm.take(2, StepState.take(module))
    assert calm.k == 9


@pytest.fixture
def job_store():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("default_pg", server)  # read through a prefix, as the engine's store is


def test_the_failure_rate_comes_from_the_jobs_death_notices(job_store, monkeypatch) -> None:
    from ncclguard.recovery.snapshots.interval import FailureRate
    from ncclguard.store.deaths import DeathNotice, post_death

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    rate = FailureRate(started=1000.0)
    assert rate.read(job_store) is None  # no failure: no rate, and no key left behind
    job = job_store.underlying_store
    for at in (1030.0, 1090.0):
        post_death(job, DeathNotice(origin=2, pid=7, returncode=-9, life=0, host="h", at=at))
    assert rate.read(job_store) is not None and rate.times == [1030.0, 1090.0] and rate.seen == 2
    assert rate.mtbf_s(now=1120.0) == 60.0  # 120 s since the count began, 2 failures
    assert rate.read(job_store) is not None and rate.seen == 2  # read once each
    restarted = FailureRate(started=1100.0)  # a restarted process counts from the job's first failure
    restarted.read(job_store)
    assert restarted.mtbf_s(now=1120.0) == 45.0


def test_a_replica_of_a_parameter_whose_shard_here_is_empty_is_bounded_by_its_global_shape() -> None:
    """FSDP2 shards dim 0: a (1, 512, 1024) position table leaves ranks 1-2 of 3 an empty local shard
    (0, 512, 1024). Their buddy's replica holds rank 0's whole row (2 MiB, over the 1 MiB floor): the
    bound is the global shape this rank's own state declares, for the parameter and its Adam moments;
    a replica larger than that whole tensor is still refused."""
    table = {"dtype": "float32", "shape": [0, 512, 1024], "global": [1, 512, 1024], "placements": ["Shard(dim=0)"]}
    meta = {"module": {"p:pos": table, "p:w": {"dtype": "float32", "shape": [4, 8], "global": [12, 8]}}}
    shards = [("p:pos", "float32", [0, 512, 1024]), ("p:w", "float32", [4, 8]), ("o:0", "float32", [0, 512, 1024])]
    mine = manifest(shards).model_copy(update={"meta": meta})
    whole_row = [("p:pos", "float32", [1, 512, 1024]), ("p:w", "float32", [4, 8]), ("o:0", "float32", [1, 512, 1024])]
    assert admit_peer(manifest(whole_row), mine, 3) is None
    two_rows = [("p:pos", "float32", [2, 512, 1024]), ("p:w", "float32", [4, 8]), ("o:0", "float32", [1, 512, 1024])]
    assert "p:pos declares [2, 512, 1024], more than a shard" in str(admit_peer(manifest(two_rows), mine, 3))
    big_moment = [("p:pos", "float32", [1, 512, 1024]), ("p:w", "float32", [4, 8]), ("o:0", "float32", [3, 512, 1024])]
    assert "o:0 declares [3, 512, 1024]" in str(admit_peer(manifest(big_moment), mine, 3))
