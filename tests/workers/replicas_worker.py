"""Rank side of tests/recovery/test_replicas_multirank.py. Usage: replicas_worker.py drill.

``drill`` (torchrun, 3 ranks): one launch, three runs in a row on the same world, each from the same
start (seed, model, data): a 956,042-parameter classifier with dropout, AdamW, a warm-up LR schedule
stepped every iteration, shuffled data (DistributedSampler), STEPS steps, RecoveringStep with every
default but ``replica_check_every=EVERY`` (and a collective bound, as every test worker):

1. ``clean``: no fault (the reference).
2. ``flipped``: after step FLIP_AFTER is applied, one bit (bit 20) of one element of rank 2's
   ``fc2.weight`` is flipped under no_grad; the next step is a check's (FLIP_AFTER + 1 = 2 * EVERY).
3. ``split``: after step FLIP_AFTER, rank 1 and rank 2 each flip a different bit: three digests, no
   majority; every rank raises ``ReplicasDiverged`` at the check, nothing applied.

A watchdog runs on every rank throughout (numerics_views.py): each finding is raised as a
``numerics`` incident; once the two findings' incidents are merged, rank 0 reads ``ncclguard
status`` from the job's store.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from numerics_views import merged, status, watch
from numerics_worker import BATCH, CLASSES, FEATURES, Net  # the same 956,042-parameter classifier
from rankkit import put
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ncclguard import RecoveringStep
from ncclguard.errors import ReplicasDiverged
from ncclguard.recovery.records import StepResult

STEPS, EVERY, FLIP_AFTER, INDEX, BIT = 10, 4, 7, 12345, 20


def start() -> tuple[Net, torch.optim.Optimizer, Any, DataLoader]:
    """Every run's same start: the model, AdamW, a warm-up schedule, the shuffled shard of this rank."""
    torch.manual_seed(1234)  # the same on every rank
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    g = torch.Generator().manual_seed(99)
    n = BATCH * STEPS * dist.get_world_size()
    data = TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    return model, opt, sched, DataLoader(data, batch_size=BATCH, sampler=sampler)


def state_bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Every parameter and every optimizer state tensor, as int32 words (compared bit for bit)."""
    parts = [p.detach().reshape(-1) for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state[p]):
            parts.append(opt.state[p][key].detach().reshape(-1).float())
    return torch.cat(parts).view(torch.int32)


def summary(res: StepResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "attempts": res.attempts,
        "rebuilds": res.rebuilds,
        "commits": [[c.ok, c.failed_ranks] for c in res.commits],
        "drift": [c.drift.model_dump() if c.drift is not None else None for c in res.commits],
        "healed": type(res.healed).__name__ if res.healed is not None else None,
    }


def flip(model: Net, bit: int) -> None:
    with torch.no_grad():
        model.fc2.weight.data.view(-1).view(torch.int32)[INDEX] ^= 1 << bit


def run(base: int, flips: dict[int, int]) -> dict[str, Any]:
    """A run; ``flips``: by rank, the bit flipped in its ``fc2.weight`` after step FLIP_AFTER."""
    model, opt, sched, loader = start()
    stepper = RecoveringStep(model, opt, scheduler=sched, collective_timeout=30, replica_check_every=EVERY)
    me, results, raised = dist.get_rank(), [], None
    assert stepper.engine.replicas.on
    for step, (x, y) in enumerate(loader):

        def step_fn(m: torch.nn.Module, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            torch.nn.functional.cross_entropy(m(x), y).backward()

        try:
            res = stepper(step_fn, step=base + step)
        except ReplicasDiverged as exc:
            raised = {"step": exc.step - base, "ranks": exc.ranks, "parts": exc.parts, "at": step}
            break
        sched.step()
        results.append(summary(res))
        if step == FLIP_AFTER and me in flips:
            rankkit.fault_fired(f"bit {flips[me]} flipped after step {step}")
            flip(model, flips[me])
    seen = [[s.step - base, s.ranks, s.parts, s.source, s.healed] for s in stepper.engine.replicas.seen]
    return {
        "results": results,
        "seen": seen,
        "suspects": list(stepper.engine.numerics.suspects.named),
        "recoveries": len(stepper.recoveries),
        "raised": raised,
        "bits": state_bits(model, opt),
    }


def same_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], u) for u in everyone)


def drill() -> None:
    rankkit.init(timeout_s=60)
    wd = watch()
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("ncclguard").addHandler(Keep())
    t0 = time.monotonic()
    clean = run(0, {})
    put("clean", {k: v for k, v in clean.items() if k != "bits"})
    put("clean_warnings", list(warnings))
    warnings.clear()
    flipped = run(100, {2: BIT})
    put("flipped", {k: v for k, v in flipped.items() if k != "bits"})
    put("flipped_warnings", list(warnings))
    put("equal_to_clean", torch.equal(flipped["bits"], clean["bits"]))
    put("same_everywhere", same_everywhere(flipped["bits"]))
    warnings.clear()
    split = run(200, {1: BIT, 2: BIT - 1})
    put("split", {k: v for k, v in split.items() if k != "bits"})
    # The engine's own line (the watchdog's incident of it says the same words: tests/recovery/test_replicas_multirank.py).
    put("split_critical", [w for w in warnings if "no digest is held by a majority" in w and "RecoveringStep:" in w])
    put("runs_s", time.monotonic() - t0)
    put("incidents", merged(wd, 2))  # flipped's drift, healed; split's, raised
    if dist.get_rank() == 0:
        put("status", status())
    dist.barrier()
    dist.destroy_process_group()
    rankkit.save()


if __name__ == "__main__":
    {"drill": drill}[sys.argv[1]]()
    sys.exit(0)
