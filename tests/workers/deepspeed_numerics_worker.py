"""Rank side of tests/integrations/test_deepspeed_numerics_multirank.py: DeepSpeed ZeRO-2 and ZeRO-3
gradients checked for NaN before ZeRO reduces them, 3 gloo ranks under torchrun.

``deepspeed.init_distributed`` first, as DeepSpeed's docs write it, then per stage (2, then 3) two
runs of STEPS steps through ``CommittedEngineStep(engine, rebuild_engine=make,
on_nonfinite="redo")`` from the same seed, on a 2.1M-parameter model with dropout (two square layers
1024 wide) and AdamW: a fault-free one (the reference), and one in which launch rank 1's loss is
multiplied by NaN in the first attempt of step K. The check names rank 1 and its parameters, every
rank refuses the step, a new engine takes the last applied step's state without the refused
gradients, and the step runs again with the same dropout masks: the run ends bit-equal to the
reference. Before that, the bad input: ``on_nonfinite="redo"`` without ``rebuild_engine`` is refused
before anything runs, and ``"auto"`` leaves a CPU engine unchecked. Last, ``on_nonfinite="skip"`` on ZeRO-2:
the poisoned step's batch is dropped on every rank, and the run ends bit-equal to one that never
trained on it.
"""

from __future__ import annotations

import logging
import os
import sys

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from deepspeed_commit_worker import batch, engine, gathered_digest
from rankkit import put

from ncclguard.integrations.deepspeed import CommittedEngineStep
from ncclguard.recovery.rebuild import generation

ME = int(os.environ["RANK"])
STEPS, K, POISONED = 6, 3, 1
OUT = os.environ["NCCLGUARD_TEST_OUT"]


def make(stage: int) -> deepspeed.DeepSpeedEngine:
    return engine(stage=stage, dropout=0.1, width=1024, depth=2)


def train(stage: int, base: int, poison: bool, policy: str = "redo", drop: int | None = None) -> dict:
    built: list[deepspeed.DeepSpeedEngine] = []

    def rebuild() -> deepspeed.DeepSpeedEngine:
        built.append(make(stage))
        return built[-1]

    first = make(stage)
    stepper = CommittedEngineStep(
        first, checkpoint_dir=OUT, rebuild_engine=rebuild, on_nonfinite=policy, collective_timeout=30.0
    )
    attempts = {s: 0 for s in range(STEPS)}
    losses = []
    applied = []
    for s in range(STEPS):
        if s == drop:  # the reference of a skip: that batch never trained on
            continue

        def step_fn(eng: deepspeed.DeepSpeedEngine, s: int = s) -> float:
            attempts[s] += 1
            x, y = batch(s, ME)
            loss = torch.nn.functional.mse_loss(eng(x), y)
            if poison and s == K and ME == POISONED and attempts[s] == 1:
                rankkit.fault_fired(f"a NaN loss at step {s}")
                loss = loss * float("nan")  # MARK: poison
            eng.backward(loss)
            return float(loss.detach())

        res = stepper(step_fn, step=base + s)
        applied.append(bool(res))
        assert res or res.skipped, f"step {s} was neither applied nor skipped: {res.commit}"
        losses.append(res.output)
    seen = stepper.recovery.numerics.seen
    return {
        "losses": losses,
        "attempts": [attempts[s] for s in range(STEPS)],
        "applied": applied,
        "digest": gathered_digest(stepper.engine),
        "global_steps": stepper.engine.global_steps,
        "seen": [
            {
                "step": f.step,
                "ranks": f.ranks,
                "finite": f.finite_ranks,
                "action": f.action,
                "buckets": {str(r): [[b.index, b.kind, b.params] for b in bs] for r, bs in f.buckets.items()},
            }
            for f in seen
        ],
        "new_engines": len(built),
        "recoveries": len(stepper.recovery.recoveries),
        "checked": stepper.recovery.numerics.check is not None and stepper.recovery.numerics.check.installed,
    }


def bad_input() -> None:
    eng = make(2)
    try:
        CommittedEngineStep(eng, checkpoint_dir=OUT, on_nonfinite="redo")
    except ValueError as exc:
        put("refused", str(exc))
    auto = CommittedEngineStep(eng, checkpoint_dir=OUT)
    numerics = auto.recovery.numerics
    put("auto_checked", numerics.check is not None and numerics.check.installed)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rankkit.init(timeout_s=60)
    deepspeed.init_distributed(dist_backend="gloo")
    bad_input()
    for stage in (2, 3):
        put(f"z{stage}.reference", train(stage, 100 * stage, poison=False))
        put(f"z{stage}.poisoned", train(stage, 100 * stage + 50, poison=True))
    # on_nonfinite="skip" (ZeRO-2): the poisoned batch dropped on every rank, against a run without it.
    put("skip.reference", train(2, 400, poison=False, drop=K))
    put("skip.poisoned", train(2, 450, poison=True, policy="skip"))
    put("generation", generation())
    put("world", [dist.get_rank(), dist.get_world_size()])
    rankkit.done()


if __name__ == "__main__":
    main()
