"""Rank side of tests/recovery/test_take_refused_multirank.py: a take refused by a buddy never fails a step.

2 gloo ranks under torchrun, the script as a user writes it (the process group first, ncclguard
after): an FSDP2 model of 1.1M parameters (Linear layers 512 wide, dropout, Adam, a StepLR the loop
steps), ``RecoveringStep(module, opt, wrap=FSDP2(...), heal=True, snapshot_every=1)``. From step
REFUSE_FROM, launch rank 1's module holds a buffer rank 0's does not (a module changed on one rank
alone): each rank's snapshot now names tensors its buddy's does not, so each refuses the other's
replica at its manifest. Every rank's take is refused, every rank is alive and the side group whole:
the steps go on at their first attempt in the first world, the snapshots of step REFUSE_FROM - 1
stay, and the next takes come later (backing off).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

ME = int(os.environ["RANK"])
STEPS, REFUSE_FROM, WIDTH = 12, 4, 512


def shard(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # as a user writes it: the group first
    import ncclguard
    from ncclguard.world import current_world

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(64, WIDTH), torch.nn.Tanh(), torch.nn.Dropout(0.1),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    stepper = ncclguard.RecoveringStep(
        module, opt, wrap=ncclguard.FSDP2(shard), scheduler=sched, heal=True, snapshot_every=1
    )
    keeper = stepper.engine.keeper
    assert keeper is not None
    rows = []
    for step in stepper.steps(STEPS):
        if step == REFUSE_FROM and ME == 1:
            stepper.model.register_buffer("only_here", torch.zeros(8))
        g = torch.Generator().manual_seed(100 * step + ME)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 1, generator=g)

        def step_fn(model: torch.nn.Module, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            torch.nn.functional.mse_loss(model(x), y).backward()

        res = stepper(step_fn, step=step)
        rows.append([step, res.ok, res.attempts, current_world().generation])
        if not res:
            break
    put("rows", rows)
    put("takes", [keeper.takes, keeper.failed_takes, keeper.refused_takes])
    put("held", [s.manifest.step for s in keeper.own])
    put("world", [dist.get_rank(), dist.get_world_size()])
    rankkit.done()


if __name__ == "__main__":
    main()
