"""Rank side of tests/recovery/test_heal_multirank.py: 3 ranks under ncclguard's launcher with restarts=1.

First life of every rank: a fault-free run of STEPS steps through ``RecoveringStep(heal=True)``
(the reference), then the same run from the same start in which rank 1 SIGKILLs itself at step K.
The launcher restarts rank 1 alone; its second life builds the same module and optimizer and
``RecoveringStep(heal=True)`` rejoins the survivors' rebuild and receives the state from rank 0;
it runs from ``resume_step``. All three then compare parameters, buffers and the optimizer's
state with each other and with the reference (rank 0 broadcasts its copy). Last, a heal whose
receiver has a module of another shape is refused on every rank and copies nothing.

With ``HEAL_KILL_RANK=2`` another rank is the one killed (tests/watching/test_node_tier_multirank.py:
two hosts of two ranks, the node tier on, host B's agent killed and healed).

``heal_worker.py twice`` (restarts=2): the same, and rank 1's restart dies too, inside the heal (as
its bytes begin to move). The survivors' heal fails, the world is rebuilt again with rank 1's second
restart, which is healed, and every rank ends bit-equal to the fault-free run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

import ncclguard
import ncclguard.recovery.heal as heal_module
from ncclguard import RecoveringStep
from ncclguard.recovery.records import StepResult

rankkit.rank = lambda: int(os.environ["RANK"])  # results go by launch rank, whatever the world
ME = int(os.environ["RANK"])
LIFE = ncclguard.restart_count()
TWICE = sys.argv[1:] == ["twice"]
ELAPSED: list[float] = []  # each step's seconds, the faulty run's last

# A dead peer fails some survivors' collective at once ("Connection reset by peer"); gloo leaves
# another survivor waiting for data the first one will never send until its op's timeout: the step
# bound (collective_timeout) ends it. The group's own timeout bounds DDP's first broadcast on a
# loaded host (3 s was too short there for a rank that reached it late).
GROUP_TIMEOUT_S = 60.0
BOUND_STEP_S = 3.0
COMMIT_S = 30.0  # a hang guard: the dead rank's notice settles the commit once the live ranks are in
REBUILD_S = 60.0  # hang guard: the survivors' meeting ends when the restarted rank arrives
HEAL_S = 30.0  # hang guard for the transfer (a few ms here)
# twice: long enough that a survivor left waiting for it is told apart from one whose wait the dead
# receiver's notice ended (the step took 3-9 s here, with both restarts).
HEAL_TWICE_S = 150.0
CHUNK = 256  # bytes per broadcast: the state (about 3 KiB) goes in many chunks
STEPS, K = 6, 3
KILL = int(os.environ.get("HEAL_KILL_RANK", "1"))  # the launch rank killed at step K (the node tier's test: 2)
TIER_GUARD_S = 30.0  # hang guard of the wait for every rank's link to its node's store (the node tier's test)
BASE = STEPS  # the faulty run's step numbers follow the reference run's


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    return module, torch.optim.Adam(module.parameters(), lr=0.05, betas=(0.8, 0.95))


def batch(step: int, launch_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + launch_rank)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)


def replicated(module: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Parameters and Adam's state (exp_avg, exp_avg_sq, step), flat: the same on every DDP rank."""
    parts = list(module.parameters())
    for s in opt.state_dict()["state"].values():
        parts += [s[k] for k in sorted(s)]
    return torch.cat([t.detach().reshape(-1).double() for t in parts])


def buffers(module: torch.nn.Module) -> torch.Tensor:
    """BatchNorm's running stats and its int64 count, flat. DDP gives every rank rank 0's at the
    start of each forward, and each rank's own forward then updates them: they end per rank."""
    return torch.cat([t.detach().reshape(-1).double() for t in module.buffers()])


def state_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    parts = [*module.parameters(), *module.buffers()]
    for s in opt.state_dict()["state"].values():
        parts += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in parts)


def summary(res: StepResult) -> dict[str, Any]:
    out = {
        "ok": res.ok,
        "attempts": res.attempts,
        "generation": res.generation,
        "rebuilds": res.rebuilds,
        "commits": [[c.ok, c.failed_ranks] for c in res.commits],
        # Ranks a commit knew dead from their launcher's notice (it settled without waiting for them).
        # (a rank's own statement may quote a peer's notice: "a member is gone (rank 1: its process died ...)")
        "died": [
            r for c in res.commits for r, why in c.reasons.items() if any(w.startswith("its process died") for w in why)
        ],
        "early": any(c.early for c in res.commits),  # settled without waiting its bound for the dead
        "error": type(res.error).__name__ if res.error is not None else None,
        "world_size": dist.get_world_size(),
    }
    if res.healed is not None:
        h = res.healed
        out["healed"] = [h.ok, h.role, h.source, h.receivers, h.step, h.bytes, h.chunks]
    return out


def wrap(module: torch.nn.Module) -> torch.nn.Module:
    # DDP rebuilds its gradient buckets after a wrapper's first step, in the order the gradients
    # became ready. A re-wrapped module would start the redone step in the initial layout, where
    # the uninterrupted run was in the rebuilt one, and 3 ranks' ring all_reduce sums an element
    # in an order that depends on its place in the bucket: last-bit differences (2e-11 here).
    # With find_unused_parameters=True DDP never rebuilds them, so both runs use one layout.
    return torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)


def train(kill_at: int | None, base: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, RecoveringStep, list]:
    module, opt = make()
    stepper = RecoveringStep(
        module,
        opt,
        wrap=wrap,
        collective_timeout=BOUND_STEP_S,
        commit_timeout=COMMIT_S,
        rebuild_timeout=REBUILD_S,
        heal=True,
        heal_timeout=HEAL_TWICE_S if TWICE else HEAL_S,
        heal_chunk_bytes=CHUNK,
    )
    results: list[dict[str, Any]] = []
    first = 0 if stepper.resume_step is None else stepper.resume_step - base
    for step in range(first, STEPS):
        x, y = batch(step, ME)

        def step_fn(model: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            if step == kill_at and ME == KILL and LIFE == 0:
                rankkit.fault_fired(f"SIGKILL at step {step}")
                life_file(results)
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye to the peers
            torch.nn.functional.mse_loss(model(x), y).backward()

        res = stepper(step_fn, step=base + step)
        results.append({"step": step, **summary(res)})
        ELAPSED.append(res.elapsed_s)
        if not res:
            break
    return module, opt, stepper, results


def die_in_heal() -> None:
    """Rank 1's first restart dies inside its heal, as the state's bytes begin to move."""
    real = heal_module._send_bytes

    def send_bytes(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        rankkit.kill(ME)
        return real(*args, **kwargs)

    heal_module._send_bytes = send_bytes  # type: ignore[assignment]


def from_hex(values: list[str]) -> torch.Tensor:
    return torch.tensor([float.fromhex(v) for v in values], dtype=torch.float64)


def life_file(results: list) -> None:
    """The first life's results, beside the rank's own file (which its restart writes)."""
    out = Path(os.environ["NCCLGUARD_TEST_OUT"])
    (out / f"life{LIFE}-rank{ME}.json").write_text(json.dumps({"results": results, "pid": os.getpid()}))


def refused_heal() -> None:
    """Rank 1 holds a module of another shape: every rank gets HealFailed naming it, nothing moves."""
    module = torch.nn.Linear(4, 8 if ME != 1 else 9).double()
    before = [t.detach().clone() for t in module.parameters()]
    res = ncclguard.heal_from_peer(module, None, receivers=[1], timeout=HEAL_S)
    put(
        "refused",
        {
            "ok": res.ok,
            "role": res.role,
            "refused_ranks": res.error.refused_ranks if res.error is not None else None,
            "error": str(res.error),
            "untouched": all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)),
            "bytes": res.bytes,
        },
    )


def tier() -> dict[str, Any] | None:
    """With the node tier on (tests/watching/test_node_tier_multirank.py): this rank's watchdog store,
    once linked to its node's store (waited for), and how this
    process's commits went through the tier; else None."""
    from ncclguard.deadlines import Deadline
    from ncclguard.store import node_store
    from ncclguard.store.clients import unprefixed
    from ncclguard.store.tier_round import tier_counts
    from ncclguard.watching.base.near_store import TieredWatchdogStore
    from ncclguard.watching.watchdog import current_watchdog
    from ncclguard.world import current_world

    wd = current_watchdog()
    store = wd.watch.desk.store if wd is not None and wd.watch is not None else None
    if not isinstance(store, TieredWatchdogStore):
        return None
    rankkit.when(lambda: store.near is not None and wd.generation == 1, TIER_GUARD_S).wait(TIER_GUARD_S)
    linked = {"linked": store.near is not None, "near_addr": store.near_addr, "generation": wd.generation}
    linked["launcher"] = store.launcher  # ncclguard run's store of this node (NCCLGUARD_NODE_STORE)
    # What the rebuild's meetings left in the job's store and in this node's (every member has
    # forgotten its share by now: each went through a collective since).
    job, near = unprefixed(current_world().store), node_store.near_client(10.0, Deadline.within(20.0))
    left = {"job": job.list_keys(), "node": near.list_keys() if near is not None else ["no node store"]}
    meeting = {k: sorted(x for x in v if x.startswith("ncclguard/rebuild/")) for k, v in left.items()}
    return {**linked, "commits": tier_counts(), "meeting_keys": meeting}


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    put("life", LIFE)
    if TWICE and ME == 1 and LIFE == 1:
        die_in_heal()
    if LIFE == 0:
        dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        ref_module, ref_opt, _, ref_results = train(kill_at=None, base=0)
        put("reference_results", ref_results)
        reference = replicated(ref_module, ref_opt)
        own = Path(os.environ["NCCLGUARD_TEST_OUT"]) / f"reference-buffers-rank{ME}.json"
        own.write_text(json.dumps([float(v).hex() for v in buffers(ref_module).tolist()]))
    ELAPSED.clear()
    module, opt, stepper, results = train(kill_at=K, base=BASE)
    put("results", results)
    put("elapsed", ELAPSED)
    put("resume_step", stepper.resume_step)
    if stepper.healed is not None:
        h = stepper.healed
        put("healed", [h.ok, h.role, h.source, h.receivers, h.step, h.bytes, h.chunks])
        put("expected_bytes", state_bytes(module, opt))
        put("expected_chunks", -(-state_bytes(module, opt) // CHUNK))
    mine = replicated(module, opt)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
    ref = reference if LIFE == 0 else torch.zeros_like(mine)
    dist.broadcast(ref, src=0)  # the restarted rank never ran the reference: rank 0's copy
    put("equal_to_reference", torch.equal(mine, ref))
    # Buffers against this launch rank's own fault-free run (the first life wrote it).
    own = Path(os.environ["NCCLGUARD_TEST_OUT"]) / f"reference-buffers-rank{ME}.json"
    put("buffers_equal_to_own_reference", torch.equal(buffers(module), from_hex(json.loads(own.read_text()))))
    put("final", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    put("tier", tier())
    refused_heal()
    rankkit.done()


if __name__ == "__main__":
    main()
