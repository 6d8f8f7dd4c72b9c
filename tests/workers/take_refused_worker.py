"""Rank side of tests/recovery/test_take_refused_multirank.py: a take that fails or is refused never
fails a step.

2 gloo ranks under torchrun, the script as a user writes it (the process group first, ncclguard
after): an FSDP2 model of 1.1M parameters (Linear layers 512 wide, dropout, Adam, a StepLR the loop
steps), ``RecoveringStep(module, opt, wrap=FSDP2(...), heal=True, snapshot_every=1,
heal_timeout=HEAL_TIMEOUT_S)``.

- At step SLOW_AT, rank 1 takes SLOW_S to capture its state (a host busy elsewhere), past its take's
  deadline: rank 0's wait for rank 1's replica times out (closing their gloo pair), rank 1's swap
  starts after its deadline. Both come to the take's agreement in the job's store: the take failed,
  every rank there. The step goes on, the snapshots of step SLOW_AT - 1 stay, the side group is made
  again at the next take (SLOW_AT + 2, backing off), which commits.
- From step REFUSE_FROM, launch rank 1's module holds a buffer rank 0's does not (a module changed on
  one rank alone): each rank's snapshot now names tensors its buddy's does not, so each refuses the
  other's replica at its manifest. The steps go on at their first attempt in the first world, the
  snapshots of step REFUSE_FROM - 1 stay, and the next takes come later (backing off).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

ME = int(os.environ["RANK"])
STEPS, SLOW_AT, REFUSE_FROM, WIDTH = 14, 2, 6, 512
# Rank 0 gives up on rank 1's replica about HEAL_TIMEOUT_S into the take; the agreement waits for a
# rank up to twice that. Rank 1 comes at SLOW_S: 2.5 s from each edge on a loaded machine.
HEAL_TIMEOUT_S, SLOW_S = 5.0, 7.5


def slow_capture(keeper: Any) -> None:
    """Rank 1's next capture takes SLOW_S (its host busy), then the keeper's own runs."""
    real = keeper.codec.capture

    def capture() -> Any:
        time.sleep(SLOW_S)
        keeper.codec.capture = real
        return real()

    keeper.codec.capture = capture


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
    from ncclguard.watching.sensors.progress import SNAPSHOTS_SAY
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
        module, opt, wrap=ncclguard.FSDP2(shard), scheduler=sched, heal=True, snapshot_every=1,
        heal_timeout=HEAL_TIMEOUT_S,
    )  # fmt: skip
    keeper = stepper.engine.keeper
    assert keeper is not None
    rows = []
    for step in stepper.steps(STEPS):
        if step == SLOW_AT and ME == 1:
            rankkit.fault_fired(f"a slow capture at step {step}")
            slow_capture(keeper)
        if step == REFUSE_FROM and ME == 1:
            rankkit.fault_fired(f"a buffer of its own from step {step}")
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
    put("takes", [keeper.takes, keeper.lost.failed, keeper.lost.refused, keeper.lost.in_a_row])
    put("deadline_s", keeper.deadline_s)
    put("heartbeat_says", current_world().get(SNAPSHOTS_SAY).text)  # what `ncclguard status` shows
    put("held", [s.manifest.step for s in keeper.own])
    put("world", [dist.get_rank(), dist.get_world_size()])
    rankkit.done()


if __name__ == "__main__":
    main()
