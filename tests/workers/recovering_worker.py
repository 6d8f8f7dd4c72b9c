"""Rank side of tests/test_recovering_multirank.py. Usage: recovering_worker.py SCENARIO.

``stall`` (torchrun, 3 ranks): a fault-free DDP run of STEPS steps, then the same run from the same
start through RecoveringStep with rank 2 stalled past the group's timeout at step K: every rank
redoes step K in generation 1, and the parameters end bit-equal to the fault-free run's.

``shrink`` (torchrun, 3 ranks): rank 2 is stuck for good at step K (it sleeps until the survivors
are done, then finds itself left out and exits 0); ranks 0-1 go on in a world of 2.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import RecoveringStep, StepResult

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

GROUP_TIMEOUT_S = 6.0  # the deadline of DDP's gradient all_reduce (the group's timeout)
STALL_S = 10.0  # past it
STEPS, K = 5, 2


def make_module() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def batch(step: int, launch_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + launch_rank)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [t.detach().reshape(-1) for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    )


def summary(res: StepResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "attempts": res.attempts,
        "generation": res.generation,
        "rebuilds": res.rebuilds,
        "left_out": res.left_out,
        "commits": [[c.ok, c.failed_ranks] for c in res.commits],
        "error": type(res.error).__name__ if res.error is not None else None,
    }


def train(
    stall_at: int | None, stall: Any = None, base: int = 0, shrink: bool = False
) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    module = make_module()
    # The commit waits for the stalled rank (10 s, then its own failure) unless it is stuck for good.
    wait_s = 20 if shrink else 60
    stepper = RecoveringStep(
        module,
        torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
        commit_timeout=wait_s,
        rebuild_timeout=wait_s,
        allow_shrink=shrink,
    )
    me = int(os.environ["RANK"])
    results = []
    for step in range(STEPS):
        x, y = batch(step, me)
        tries = []

        def step_fn(
            model: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y, tries: list[int] = tries
        ) -> float:
            tries.append(dist.get_world_size())
            if step == stall_at and len(tries) == 1 and stall is not None:
                stall()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        res = stepper(step_fn, step=base + step)  # the loop's step, growing across both runs
        results.append({**summary(res), "world_sizes": tries})
        if not res:
            break
    return module, results


def stall() -> None:
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    reference, ref_results = train(stall_at=None)
    put("reference_results", ref_results)
    t0 = time.monotonic()
    module, results = train(stall_at=K, stall=lambda: rankkit.stall(2, STALL_S), base=STEPS)
    put("results", results)
    put("faulty_s", time.monotonic() - t0)
    put("equal_to_reference", torch.equal(flat(module), flat(reference)))
    mine = flat(module)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
    put("final", [dist.get_rank(), dist.get_world_size()])
    rankkit.done()


def shrink() -> None:
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    me = int(os.environ["RANK"])

    def stuck() -> None:
        if me == 2:  # stuck for good, as far as the others can tell: until they are done
            store, deadline = rankkit._job_store(), time.monotonic() + 300
            while time.monotonic() < deadline and not store.check(
                ["rankkit/survivors-done-0", "rankkit/survivors-done-1"]
            ):
                time.sleep(0.2)
            put("woke_after_survivors", store.check(["rankkit/survivors-done-0", "rankkit/survivors-done-1"]))

    module, results = train(stall_at=K, stall=stuck, shrink=True)
    put("results", results)
    if me != 2:
        mine = flat(module)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
        put("final", [dist.get_rank(), dist.get_world_size()])
        # A single-process reference: steps before K average 3 ranks' gradients, from K on 2 ranks'.
        put("max_diff_to_reference", float((mine - reference_shrunk()).abs().max()))
        rankkit.save()
        rankkit.announce(f"survivors-done-{me}")
    rankkit.done()


def reference_shrunk() -> torch.Tensor:
    """One process: steps before K average 3 ranks' losses, from K on ranks 0-1's (as DDP does)."""
    module = make_module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        ranks = range(3) if step < K else range(2)
        loss = sum(torch.nn.functional.mse_loss(module(batch(step, k)[0]), batch(step, k)[1]) for k in ranks)
        (loss / len(ranks)).backward()
        opt.step()
    return flat(module)


if __name__ == "__main__":
    {"stall": stall, "shrink": shrink}[sys.argv[1]]()
