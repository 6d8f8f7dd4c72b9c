"""Rank side of tests/recovery/test_recovery_multirank.py. Usage: recovery_worker.py SCENARIO."""

from __future__ import annotations

import os
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import kill, put, skip_collective

from ncclguard import _torch_compat as compat
from ncclguard import rebuild_world, safe_all_reduce, safe_barrier
from ncclguard.errors import GroupFailed
from ncclguard.recording.flight import recorder
from ncclguard.recovery import generation, reaper
from ncclguard.recovery._rebuild.meeting import MeetingKeys
from ncclguard.world import subscribe

# A rebuild renumbers ranks: the faults and the result files go by the rank the launcher gave.
rankkit.rank = lambda: int(os.environ["RANK"])

# The old world's collective timeout: an abandoned gloo op ends at the latest after it.
GROUP_TIMEOUT_S = 20.0


def resources() -> dict[str, int]:
    """Threads (every native one, gloo's included), open descriptors and resident memory."""
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    tasks = os.listdir("/proc/self/task")
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return {
        "threads": len(tasks),
        "thread_names": sorted(names),  # type: ignore[dict-item]
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss_kib,
    }


def result_fields(res: Any) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "bool": bool(res),
        "generation": res.generation,
        "rank": res.rank,
        "world_size": res.world_size,
        "rank_map": {str(k): v for k, v in res.rank_map.items()},
        "missing": res.missing_ranks,
        "late": res.late,
        "elapsed": res.elapsed_s,
        # A RebuildFailed whose fields agree with the result's, or None.
        "error": str(res.error) if res.error is not None else None,
        "error_type": type(res.error).__name__ if res.error is not None else None,
        "error_fields_agree": res.error is None
        or (res.error.missing_ranks == res.missing_ranks and res.error.late == res.late),
    }


def world_checks(expect_ranks: list[int]) -> dict[str, Any]:
    """Plain and safe collectives on the (new) world: exact values, from every member."""
    r, n = dist.get_rank(), dist.get_world_size()
    plain = torch.full((5,), float(r + 1))
    dist.all_reduce(plain)
    safe = torch.arange(6, dtype=torch.float64) * (r + 1)
    res_safe = safe_all_reduce(safe, timeout=10, verify=True)
    chunked = torch.ones(50, dtype=torch.int64) * (r + 2)
    res_chunked = safe_all_reduce(chunked, timeout=10, chunk_numel=7)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([int(os.environ["RANK"])]))
    return {
        "rank": r,
        "world_size": n,
        "plain": plain.tolist() == [float(n * (n + 1) // 2)] * 5,
        "safe": res_safe.ok and safe.tolist() == (torch.arange(6, dtype=torch.float64) * (n * (n + 1) // 2)).tolist(),
        "chunked": res_chunked.ok and res_chunked.chunks == 8 and chunked.tolist() == [n * (n + 3) // 2] * 50,
        "barrier": bool(safe_barrier(timeout=10)),
        "launch_ranks": [int(t.item()) for t in gathered] == expect_ranks,
    }


def ddp_check() -> dict[str, Any]:
    """DDP on the rebuilt world: parameters equal everywhere and equal to a single-process reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)

    model = DDP(make(seed=100 + r))  # different on every rank: DDP must broadcast rank 0's
    reference = make(seed=100)  # rank 0's parameters, trained on everyone's batches in one process
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, r)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(reference(*batch(step, k)[:1]), batch(step, k)[1]) for k in range(n))
        (loss / n).backward()  # DDP averages the ranks' gradients
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    ref_flat = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    out = {
        "equal_across_ranks": all(torch.equal(everyone[0], t) for t in everyone),
        "matches_reference": bool(torch.allclose(flat, ref_flat, rtol=0, atol=1e-12)),
        "max_diff": float((flat - ref_flat).abs().max()),
    }
    del model, opt  # the DDP wrapper holds the group; the next rebuild frees it
    return out


def timeout_and_loop() -> None:
    """torchrun, 3 ranks: a timed-out world all_reduce, rebuild, collectives and DDP; then 20
    failures and rebuilds in a row with threads, descriptors, memory and store keys measured."""
    r = rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    store = dist.distributed_c10d._get_default_store().underlying_store  # the job's TCPStore

    # Bad arguments: refused before any communication (no arrival written, no attempt counted).
    bad = {}
    for name, kwargs in {
        "timeout_zero": {"timeout": 0},
        "timeout_negative": {"timeout": -1},
        "timeout_nan": {"timeout": float("nan")},
        "timeout_str": {"timeout": "10"},
        "shrink_str": {"allow_shrink": "yes"},
        "shrink_int": {"allow_shrink": 1},
    }.items():
        try:
            rebuild_world(**kwargs)
            bad[name] = None
        except (TypeError, ValueError) as exc:
            bad[name] = [type(exc).__name__, str(exc)]
    put("bad_args", bad)
    put("bad_args_no_arrival", not store.check([MeetingKeys(1, 0).arrival(r)]))

    # The failure: rank 2 skips the all_reduce, the others time out.
    if not skip_collective(2):
        res = safe_all_reduce(torch.ones(4), timeout=1.5)
        again = safe_all_reduce(torch.ones(4), timeout=1.5)
        put(
            "failure", {"ok": res.ok, "type": type(res.error).__name__, "refused": isinstance(again.error, GroupFailed)}
        )
        # A failed result's error chains the backend's exception, whose traceback holds the
        # group: kept, it would keep the abandoned group (and its threads) alive.
        del res, again
    old = weakref.ref(dist.distributed_c10d._get_default_group())
    seen: list[tuple[int, int, bool]] = []
    subscribe(
        lambda c: seen.append((c.new.generation, c.new.size, dist.get_world_size() == c.new.size)), kinds=("rebuilt",)
    )
    result = rebuild_world(timeout=10)
    put("rebuild", result_fields(result))
    put("generation", generation())
    put("recorder_after", {"records": len(recorder.records()), "seq": recorder.last_seq()})
    put("new_timeout_s", compat.backend_timeout(dist.distributed_c10d._get_default_group()).total_seconds())
    put("callback", seen)
    put("old_group_replaced", dist.distributed_c10d._get_default_group() is not old())
    put("world", world_checks([0, 1, 2]))
    put("ddp", ddp_check())

    # 20 failures and rebuilds in a row. Baseline: this rank's resources once the reaper has
    # released the first abandoned world and the DDP wrapper is gone.
    put("reaper_idle_before", reaper.wait_idle(GROUP_TIMEOUT_S + 5))
    put("old_group_freed", old() is None)
    put("sync_before_loop", bool(safe_barrier(timeout=GROUP_TIMEOUT_S + 10)))
    keys_before = store.num_keys()
    before = resources()
    peak = dict(before)
    oks, exact, times = [], [], []
    for i in range(20):
        if not skip_collective(2):
            safe_all_reduce(torch.ones(2), timeout=0.3)
        t0 = time.monotonic()
        res = rebuild_world(timeout=10)
        oks.append(res.ok and res.generation == i + 2)
        if not oks[-1]:
            break
        t = torch.full((3,), float(r))
        dist.all_reduce(t)
        times.append(time.monotonic() - t0)
        exact.append(t.tolist() == [3.0, 3.0, 3.0])
        now = resources()
        peak = {k: max(peak[k], now[k]) for k in peak if k != "thread_names"}
    put("loop", {"all_ok": all(oks), "all_exact": all(exact), "rebuild_to_good_s": times, "callbacks": len(seen)})
    # DDP imported torch.distributed.nn.functional while generation 1 was the world: its
    # functions' default group must follow the rebuilds, not stay on generation 1.
    import torch.distributed.nn.functional as fn

    t = torch.full((2,), float(r + 1), requires_grad=True)
    put("nn_functional_sum", fn.all_reduce(t).tolist())
    put("reaper_idle_after", reaper.wait_idle(GROUP_TIMEOUT_S + 5))

    safe_barrier(timeout=20)  # every rank done with the last meeting before the store is counted
    # Threads and descriptors of ended work go away on their own time: a loaded machine may still
    # be tearing one down here. Give them up to 10 s to get back to the stated bound, then count.
    after = resources()
    settle = time.monotonic() + 10
    while (after["threads"] > before["threads"] + 1 or after["fds"] > before["fds"] + 2) and time.monotonic() < settle:
        time.sleep(0.1)
        after = resources()
    put("resources", {"before": before, "after": after, "peak": peak})
    put("store_keys", {"before": keys_before, "after": store.num_keys()})
    rankkit.done()


def killed() -> None:
    """spawn, 3 ranks: rank 1 is SIGKILLed; without allow_shrink the others get a falsy result
    naming it and nothing changes; with it they go on as a world of 2."""
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    warm = torch.ones(1)
    dist.all_reduce(warm)
    kill(1)
    res = safe_all_reduce(torch.ones(4), timeout=2)
    put("failure", {"ok": res.ok, "type": type(res.error).__name__})
    old = dist.distributed_c10d._get_default_group()
    t0 = time.monotonic()
    refused = rebuild_world(timeout=2)
    put("no_shrink", {**result_fields(refused), "wall": time.monotonic() - t0})
    put(
        "unchanged",
        {
            "same_group": dist.distributed_c10d._get_default_group() is old,
            "world_size": dist.get_world_size(),
            "rank": dist.get_rank(),
            "generation": generation(),
        },
    )
    del old
    t0 = time.monotonic()
    shrunk = rebuild_world(timeout=2, allow_shrink=True)
    put("shrink", {**result_fields(shrunk), "wall": time.monotonic() - t0})
    put("world", world_checks([0, 2]))
    put("ddp", ddp_check())
    rankkit.done()


def absent() -> None:
    """spawn, 3 ranks: rank 2 is alive but does not call rebuild_world in time, twice."""
    r = rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    warm = torch.ones(1)
    dist.all_reduce(warm)
    gen0 = dist.distributed_c10d._get_default_group()
    job_store = dist.distributed_c10d._get_default_store().underlying_store

    # 1. Ranks 0-1 try without rank 2: falsy within timeout + 1 s, naming it; nothing changes.
    #    Rank 2 comes after they gave up (waiting on their word, not a sleep a loaded machine can
    #    outrun): falsy at once, late.
    t0 = time.monotonic()
    if r == 2:
        rankkit.fault_fired("late to a rebuild")
        rankkit.wait_for("absent-0", at_least_s=3.5)
        rankkit.wait_for("absent-1")
    res = rebuild_world(timeout=2) if r != 2 else rebuild_world(timeout=20)
    put("absent", {**result_fields(res), "wall": time.monotonic() - t0})
    if r != 2:
        rankkit.announce(f"absent-{r}")
    put("unchanged", {"same_group": dist.distributed_c10d._get_default_group() is gen0, "world": dist.get_world_size()})
    del gen0

    # 2. Every rank calls again: the attempts line up and the world is rebuilt, 3 ranks.
    res = rebuild_world(timeout=10)
    put("together", result_fields(res))
    put("world3", world_checks([0, 1, 2]))

    # 3. Ranks 0-1 time out on an all_reduce that rank 2 (alive, busy) never joins: the op stays
    #    queued in gloo until rank 2 leaves or the group's own 20 s timeout. They shrink without
    #    rank 2, which arrives late: it is left out and told so. The rebuild must not wait for
    #    that op: the old group's destructor, which does, runs on the reaper's thread.
    if r != 2:
        res = safe_all_reduce(torch.ones(3), timeout=1)
        put("stalled_failure", res.ok)
        del res  # its error's traceback holds the group
        t0 = time.monotonic()
        res = rebuild_world(timeout=2, allow_shrink=True)
        put("left_out", {**result_fields(res), "wall": time.monotonic() - t0})
        time.sleep(0.5)
        put("reaper_busy_with_the_old_group", reaper.pending())
        rankkit.announce(f"left_out-{r}")  # rank 2 may come (and leave) now
        put("world2", world_checks([0, 1]))
        # Rank 0's process hosts the job's store (spawn launcher): stay until rank 2 has read its verdict.
        job_store.wait(["test/rank2_done"], timedelta(seconds=15))
        # Rank 2's exit closes its side: the queued op fails and the old group goes, long before 20 s.
        put("reaper_idle_once_rank2_left", reaper.wait_idle(10))
    else:
        rankkit.wait_for("left_out-0", at_least_s=4.5)  # after both shrank without it
        rankkit.wait_for("left_out-1")
        t0 = time.monotonic()
        res = rebuild_world(timeout=20, allow_shrink=True)
        put("left_out", {**result_fields(res), "wall": time.monotonic() - t0})
        job_store.set("test/rank2_done", "1")
    rankkit.done()


def store_lost() -> None:
    """spawn, 3 ranks: rank 0, whose process serves the job's store under this launcher, is killed;
    the others get a falsy result at once that says why."""
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    pids = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    kill(0)
    # Wait until rank 0 is gone (its store with it), however loaded the machine: not a fixed sleep.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not rankkit.dead(pids[0]):
        time.sleep(0.05)
    t0 = time.monotonic()
    res = rebuild_world(timeout=3, allow_shrink=True)
    put("lost", {**result_fields(res), "wall": time.monotonic() - t0})
    rankkit.done()


def handshake() -> None:
    """torchrun, 2 ranks, the world made with every default (gloo's collective timeout: 1,800 s):
    rank 1's handshake into the rebuilt world fails at once; rank 0, the rank that records the
    world, gives up within the rebuild's own timeout, not a quarter of the world's (450 s), and rank
    1 waits its bound out with it. Then, with no group on either rank, ``should_commit``,
    ``safe_all_reduce`` and ``safe_barrier`` fail on both without communicating (none acts as a
    world of one), and a second rebuild, the handshake working again, brings both into generation 2."""
    import logging

    from ncclguard import safe_all_reduce, safe_barrier, should_commit
    from ncclguard.env.hierarchy import group_timeout_s
    from ncclguard.recovery._rebuild import stand_in

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    put("world_timeout_s", group_timeout_s(compat.default_group()))
    warm = torch.ones(1)
    dist.all_reduce(warm)
    me = rankkit.rank()  # the launch's rank: a failed rebuild leaves no default group to ask
    real = stand_in.torch_init_process_group
    if me == 1:
        rankkit.fault_fired("a failed handshake")

        def fails(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected: this rank's handshake failed")

        stand_in.torch_init_process_group = fails  # type: ignore[assignment]
    t0 = time.monotonic()
    res = rebuild_world(timeout=4)
    put("rebuild", {**result_fields(res), "wall": time.monotonic() - t0})
    stand_in.torch_init_process_group = real  # type: ignore[assignment]
    put("initialized", dist.is_initialized())
    commit = should_commit(timeout=5)
    put("no_group_commit", {"ok": commit.ok, "failed": commit.failed_ranks, "error": str(commit.error)})
    mine = torch.full((4,), float(me + 1))
    reduced = safe_all_reduce(mine, timeout=5)
    put("no_group_reduce", {"ok": reduced.ok, "error": type(reduced.error).__name__, "tensor": mine.tolist()})
    met = safe_barrier(timeout=5)
    put("no_group_barrier", {"ok": met.ok, "error": type(met.error).__name__, "message": str(met.error)})
    t0 = time.monotonic()
    again = rebuild_world(timeout=4)  # as a loop that calls it again would: the same timeout
    put("again", {**result_fields(again), "wall": time.monotonic() - t0})
    total = torch.tensor([float(me + 1)])
    dist.all_reduce(total)
    put("sum", total.item())
    put("commit", bool(should_commit(timeout=20)))
    dist.barrier()
    rankkit.done()


if __name__ == "__main__":
    {
        "timeout_and_loop": timeout_and_loop,
        "killed": killed,
        "absent": absent,
        "store_lost": store_lost,
        "handshake": handshake,
    }[sys.argv[1]]()
