"""Demo act: a step fails, every rank agrees, training goes on.

Three ranks train a small model with ``RecoveringStep`` (DDP, gloo). At step 3 rank 2 stalls past
the group's timeout. Ranks 0-1's gradient all-reduce times out; rank 2's fails when it comes. Each
rank then reads the same ``should_commit`` outcome (nobody applies the step), the world is rebuilt
in process, the step is redone, and the ranks finish with identical parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

TITLE = "Act: steps every rank agrees on (3 ranks, gloo): rank 2 stalls, the step fails everywhere, and is redone"
STEPS = 6
STALL_AT = 3
GROUP_TIMEOUT_S = 3.0
STALL_S = 6.0


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import RecoveringStep

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    me = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.05), commit_timeout=30)
    out: dict = {"steps": []}
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * step + me)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        tries: list[int] = []

        def step_fn(
            model: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y, tries: list[int] = tries
        ) -> float:
            tries.append(1)
            if step == STALL_AT and me == 2 and len(tries) == 1:
                time.sleep(STALL_S)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        res = stepper(step_fn, step=step)
        out["steps"].append(
            {
                "step": step,
                "ok": res.ok,
                "attempts": res.attempts,
                "generation": res.generation,
                "outcomes": [[c.ok, c.failed_ranks, c.late] for c in res.commits],
                "reasons": {str(k): v[:1] for k, v in res.commits[0].reasons.items()},
            }
        )
        if not res:
            break
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    out["params_equal"] = all(torch.equal(everyone[0], t) for t in everyone)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def run(args: argparse.Namespace) -> int:
    from ncclguard.testing.launch import spawn

    print(
        f"3 ranks train with ncclguard.RecoveringStep for {STEPS} steps; at step {STALL_AT} rank 2 stalls "
        f"{STALL_S:g} s against a {GROUP_TIMEOUT_S:g} s group timeout."
    )
    res = spawn([sys.executable, "-m", "ncclguard.cli.demo_commit"], 3, timeout_s=120)
    results = res.json_lines()
    if res.timed_out or sorted(results) != [0, 1, 2]:
        print("the demo ranks did not report as expected:\n" + res.output()[-4000:])
        return 1
    failed = [results[r]["steps"][STALL_AT - 1] for r in range(3)]
    for rank, s in enumerate(failed):
        ok, ranks, late = s["outcomes"][0]
        print(f"rank {rank}: step {STALL_AT}, first commit: ok={ok}, failed ranks {ranks}, late={late}")
    for rank, why in sorted(failed[0]["reasons"].items()):
        text = why[0] if why else ""
        print(f"  why rank {rank} failed: {text.split('] ', 1)[-1][:110]}")  # gloo's source path cut
    agree = len({json.dumps([v[:2] for v in s["outcomes"]]) for s in failed}) == 1
    redone = all(s["ok"] and s["attempts"] == 2 and s["generation"] == 1 for s in failed)
    finished = all(len(results[r]["steps"]) == STEPS and all(s["ok"] for s in results[r]["steps"]) for r in range(3))
    equal = all(results[r]["params_equal"] for r in range(3))
    print(f"Every rank read the same outcomes: {agree}; the step was redone on world generation 1: {redone}.")
    print(f"All {STEPS} steps committed on every rank: {finished}; parameters identical: {equal}.")
    return 0 if agree and redone and finished and equal else 1


if __name__ == "__main__":
    _rank_main()
