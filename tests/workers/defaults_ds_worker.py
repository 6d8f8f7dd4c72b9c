"""Rank side of tests/watching/test_defaults_deepspeed_multirank.py: a DeepSpeed ZeRO-2 loop as
docs/recovery.md writes it, with every default, and a rank asleep for good.

Launched as ``ncclguard run --ncclguard-restarts 1`` does it (each rank under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default) on 3 gloo ranks, and nothing else set:
``CommittedEngineStep(engine, checkpoint_dir=..., rebuild_engine=make)``, no timeout, no ``heal``,
no ``snapshot_every``; ``deepspeed.init_distributed(dist_backend="gloo")`` without a timeout. Under
restarts the engine heals by default: a rank asleep for good is ended by its supervisor, restarted,
restored from its buddy's in-memory snapshot, and every rank goes back to that snapshot's step
(``stepper.steps()``) and ends on the full world.

The model: ``Linear(6, 1024)``, dropout 0.1, two square layers 1024 wide, ``Linear(1024, 1)``
(2.11M parameters), AdamW. WARM healthy steps (the judge bound is learned: its 10 s floor), then
at step ASLEEP launch rank 2 sleeps in Python for good inside its step function.

The script is written in the order users write it: ``deepspeed.init_distributed`` first, on every
process (a restarted one too: there the start-up hook makes it the stand-in world of one), ncclguard
imported after. Each life records whether ncclguard was imported before its group was made
(``order``).

Results go by launch rank plus 10 for a restarted process (``rank12.json``): the first life's are
kept.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from rankkit import put

# ncclguard is imported after the process group is made, as a user's script does (see the module doc).
ME, LIFE = int(os.environ["RANK"]), int(os.environ.get("NCCLGUARD_RESTART_COUNT", "0") or 0)
rankkit.rank = lambda: ME + 10 * LIFE
ASLEEP, STEPS = 12, 16  # past the judge bound's warm-up (10 intervals)


def make() -> deepspeed.DeepSpeedEngine:
    from deepspeed_commit_worker import engine

    # 2.11M parameters with dropout: a new module, the same config (every rank, after a rebuild too).
    return engine(stage=2, dropout=0.1, width=1024, depth=2)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    put("life", LIFE)
    before = "ncclguard" in sys.modules
    deepspeed.init_distributed(dist_backend="gloo")  # as a user writes it, first: no timeout
    put("order", {"ncclguard_first": before, "group": [dist.get_rank(), dist.get_world_size()]})
    from deepspeed_commit_worker import batch, gathered_digest  # imports ncclguard: after the group

    import ncclguard
    from ncclguard.integrations.deepspeed import CommittedEngineStep
    from ncclguard.world import current_world

    restarted = ncclguard.restart_count() > 0  # a restarted process joins the survivors instead
    stepper = CommittedEngineStep(
        None if restarted else make(),
        checkpoint_dir=os.path.join(os.environ["NCCLGUARD_TEST_OUT"], "ckpt"),
        rebuild_engine=make,
    )  # nothing else
    put("heal", stepper.recovery.options.heal)
    put("plan", [ASLEEP, STEPS])
    put("pid", os.getpid())
    put("resume_step", stepper.resume_step)
    healed = stepper.healed  # a restarted process: how it was restored
    put("healed", healed and {"role": healed.role, "step": healed.step})
    rankkit.save()
    results: list[dict[str, Any]] = []
    for step in stepper.steps(STEPS):

        def step_fn(eng: deepspeed.DeepSpeedEngine, step: int = step) -> float:
            if ME == 2 and LIFE == 0 and step == ASLEEP:
                put("results", results)
                rankkit.stuck_for_good()
            x, y = batch(step, ME)
            loss = torch.nn.functional.mse_loss(eng(x), y)
            eng.backward(loss)
            return float(loss.detach())

        t0 = time.time()
        res = stepper(step_fn, step=step)
        r = res.restored
        results.append(
            {
                "step": step,
                "applied": bool(res),
                "rewound_to": res.rewound_to,
                "restored": r and r.role,
                "size": dist.get_world_size(),
                "started": t0,
                "ended": time.time(),
            }
        )
    put("results", results)
    put("events", list(stepper.recovery.timing.driver.events))
    put("judge_s", stepper.recovery.timing.judge_s())
    put("global_steps", stepper.engine.global_steps)
    put("digest", gathered_digest(stepper.engine))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    put("end", time.time())
    rankkit.done()


if __name__ == "__main__":
    main()
