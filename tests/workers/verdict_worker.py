"""Rank side of tests/test_verdict_multirank.py. Usage: verdict_worker.py stuck|busy.

Launched as ``ncclguard run --ncclguard-restarts 1`` does it (each rank under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default), with ``RecoveringStep(allow_shrink=True)``
and no timeout set anywhere: the group keeps gloo's 30 min, the step bound its 300 s default.

``stuck`` (3 ranks): WARM healthy steps (the step bound is learned: its floor), then at step
ASLEEP launch rank 2 sleeps in Python for good; ranks 0-1 go on as a world of 2. At step STOPPED
launch rank 1 stops itself (SIGSTOP); rank 0 goes on alone and, once done, lets it continue
(SIGCONT): it finds itself left out and exits 0.

``hf`` (3 ranks): the HF Trainer with ``TrainingArguments``' defaults and ``guard_trainer(trainer,
recover=True, allow_shrink=True)``: at global step ASLEEP launch rank 2 sleeps for good in the
model's forward; ranks 0-1 finish HF_STEPS steps as a world of 2.

``busy`` (2 ranks): WARM healthy steps, then at step BUSY rank 1 computes in Python for BUSY_S
seconds (its stack and CPU time move): reported, no action; the run ends on its 2 ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from recovering_worker import batch, make_module, summary

from ncclguard import RecoveringStep
from ncclguard.world import current_world

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

WARM = 12  # steps before the first fault: past the warm-up (10 intervals)
ASLEEP, STOPPED, STEPS = 12, 15, 18
BUSY, BUSY_S, BUSY_STEPS = 12, 15.0, 14


def busy_for(seconds: float) -> int:
    """CPU work in Python for ``seconds``: the stack and the main thread's CPU time move."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += sum(i * i for i in range(2000)) % 7
    return n


def main(mode: str) -> None:
    dist.init_process_group("gloo")  # no timeout: gloo's own 30 min
    me = int(os.environ["RANK"])
    module = make_module()
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1), allow_shrink=True)
    timing = stepper.engine.timing
    steps = STEPS if mode == "stuck" else BUSY_STEPS
    results, stalls = [], {}
    put("pid", os.getpid())
    rankkit.save()
    for step in range(steps):
        x, y = batch(step, me)

        def step_fn(model: torch.nn.Module, step: int = step, x=x, y=y) -> float:
            if mode == "stuck" and me == 2 and step == ASLEEP:
                put("stall_at", time.time())
                rankkit.save()
                while True:  # asleep in Python for good
                    time.sleep(0.1)
            if mode == "stuck" and me == 1 and step == STOPPED:
                put("stall_at", time.time())
                rankkit.save()
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "busy" and me == 1 and step == BUSY:
                busy_for(BUSY_S)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        before = timing.judge_s()
        t0 = time.time()
        res = stepper(step_fn, step=step)
        results.append({**summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)})
        stalls[step] = {"judge_s": before, "started": t0, "ended": time.time()}
        if not res:
            break
    put("results", results)
    put("steps", stalls)
    put("events", stepper.engine.timing.driver.events)
    put("judge_s", timing.judge_s())
    put("learned", timing.learner.state.model_dump())
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    if mode == "stuck":
        # The learned state in the job's store, as a restarted process reads it.
        from ncclguard.store.learned import LEARNED_KEY

        put("stored", bytes(rankkit._job_store().get(LEARNED_KEY)).decode())
        rankkit.save()
        pid1 = json.loads((Path(os.environ["NCCLGUARD_TEST_OUT"]) / "rank1.json").read_text())["pid"]
        os.kill(int(pid1), signal.SIGCONT)  # let it find itself left out and exit 0
    rankkit.done()


HF_STEPS = 16


def hf() -> None:
    from hf_worker import Dataset, tiny_bert
    from transformers import Trainer, TrainingArguments

    from ncclguard.integrations.hf import find_guard, guard_trainer

    me = int(os.environ["RANK"])
    out = os.environ["NCCLGUARD_TEST_OUT"]
    torch.manual_seed(0)
    model = tiny_bert()
    holder: dict[str, Trainer] = {}

    def asleep(_module: torch.nn.Module, _inputs: object) -> None:
        if me == 2 and holder["t"].state.global_step == ASLEEP:
            put("stall_at", time.time())
            rankkit.save()
            while True:  # asleep in Python for good
                time.sleep(0.1)

    model.register_forward_pre_hook(asleep)
    args = TrainingArguments(
        output_dir=f"{out}/hf",
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=HF_STEPS,
        per_device_train_batch_size=4,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    t = holder["t"] = Trainer(model=model, args=args, train_dataset=Dataset(96, seed=1))
    guard_trainer(t, recover=True, allow_shrink=True)  # nothing else: every timeout at its default
    put("pid", os.getpid())
    rankkit.save()
    t0 = time.time()
    t.train()
    engine = find_guard(t).recovery.engine  # type: ignore[union-attr]
    put("global_step", t.state.global_step)
    put("recoveries", [{"step": r.step, "s": r.elapsed_s, "world_size": r.world_size} for r in engine.recoveries])
    put("events", engine.timing.driver.events)
    put("judge_s", engine.timing.judge_s())
    put("train_s", round(time.time() - t0, 3))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        hf()
    else:
        main(sys.argv[1]) if sys.argv[1] in ("stuck", "busy") else sys.exit(f"unknown scenario {sys.argv[1]}")
