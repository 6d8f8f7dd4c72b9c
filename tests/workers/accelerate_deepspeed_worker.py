"""Rank side of tests/integrations/test_accelerate_deepspeed_multirank.py: an Accelerate loop with the DeepSpeed
plugin under ``recovering_step(accelerator, model, optimizer, rebuild=build, heal=True)``, 3 gloo
ranks on CPU under ncclguard's launcher (``restarts=1``: a rank that dies is restarted alone).

ZeRO-3 (a DeepSpeed WarmupLR scheduler from the config, Dropout in the model): every rank's first
life trains STEPS steps with Accelerate's own loop (``accelerator.backward``) and no ncclguard: the
reference (its gathered parameters' digest, its losses). Then, from a fresh Accelerator and the same
start, the same steps through the stepper, with faults on a step's first attempt only:

- step RAISE: rank 2 raises after its forward (every rank alive: the step is redone on a new engine);
- step KILL: launch rank 1 SIGKILLs itself. Its restarted process builds its Accelerator (a stand-in
  world until the join) and gives the stepper its model unprepared; the stepper's constructor joins
  the survivors, prepares the engine with them and takes its ZeRO-3 partitions from its buddy's replica (rank 2).
  The newest snapshot every rank holds is of step BACK (``snapshot_every=2``): every rank goes back
  to it and the loop with it (``stepper.steps()``).

Then, every rank alive, ZeRO-2 (cheap): a torch LambdaLR that Accelerate steps outside the engine
offered to the stepper (refused); a reference of 3 steps and a guarded run (given the engine
``prepare`` returned) whose step 1 raises on rank 0, then ``stepper.save_checkpoint`` (``accelerator.save_state``, what a preemption
writes) loaded back with ``accelerator.load_state`` after one more step.

Last, ZeRO-3 with ``gradient_accumulation_steps=2`` on a tiny BERT (a PreTrainedModel: no ``rebuild=``,
the stepper builds it afresh from its config): Accelerate's own loop (``accelerator.accumulate``) as the
reference, then the stepper called once per micro-batch, rank 1 raising in window 1's first
micro-batch of 2 windows: the window is redone whole on a new engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

import ncclguard  # before the Accelerator: a restarted process's process group is a stand-in
from ncclguard.recovery.rebuild import generation

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
ME = int(os.environ["RANK"])  # the launch rank: a restarted process keeps it
LIFE = ncclguard.restart_count()
STEPS, RAISE, KILL, VICTIM = 7, 1, 5, 1
BACK = KILL - 1  # snapshot_every=2: the newest snapshot at the kill is of step KILL-1
BOUND_S = 3.0
rankkit.rank = lambda: ME


def config(stage: int, gas: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1_000_000,
    }


def accelerator(stage: int, gas: int = 1) -> Any:
    """A fresh Accelerator with the DeepSpeed plugin (Accelerate's state is per process: reset first)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(stage, gas)), gradient_accumulation_steps=gas
    )


def build() -> tuple[torch.nn.Module, Any]:
    """The model and optimizer as the loop builds them before ``prepare`` (also the stepper's rebuild)."""
    from accelerate.utils import DummyOptim

    torch.manual_seed(0)
    w = 1024  # 2.1M parameters: a replica three times a fresh rank's state
    module = torch.nn.Sequential(
        torch.nn.Linear(6, w), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(w, w), torch.nn.Tanh(),
        torch.nn.Linear(w, w), torch.nn.Tanh(), torch.nn.Linear(w, 1),
    )  # fmt: skip
    return module, DummyOptim(module.parameters())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + ME)
    x = torch.randn(4, 6, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def mlp_loss(engine: Any, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(engine(x), y)


def build_bert() -> tuple[torch.nn.Module, Any]:
    """A tiny BERT classifier (a PreTrainedModel: the stepper builds it afresh itself, no rebuild=)."""
    from accelerate.utils import DummyOptim
    from hf_parts import tiny_bert

    torch.manual_seed(0)
    module = tiny_bert()
    return module, DummyOptim(module.parameters())


def bert_loss(engine: Any, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + ME)
    ids = torch.randint(0, 100, (4, 16), generator=g)
    return engine(input_ids=ids, labels=(ids[:, 0] > 50).long()).loss


def gathered_digest(engine: Any) -> str:
    """The digest of the full parameters (ZeRO-3: gathered for the read)."""
    import deepspeed

    params = list(engine.module.parameters())
    partitioned = [p for p in params if getattr(p, "ds_status", None) is not None]
    h = hashlib.sha256()
    with deepspeed.zero.GatheredParameters([p for p in partitioned if p.ds_status.name != "AVAILABLE"]):
        for name, p in engine.module.named_parameters():
            h.update(name.encode())
            h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def reference(
    stage: int, steps: int, gas: int = 1, make: Any = build, loss_of: Any = mlp_loss
) -> tuple[str, list[float], list[float]]:
    """Accelerate's own loop, no ncclguard: the run every guarded run must equal (its gathered
    parameters' digest, this rank's losses, the learning rate at the end). ``steps``: micro-batches."""
    acc = accelerator(stage, gas)
    torch.manual_seed(1)  # the generators every run starts from (Dropout draws from them)
    engine, _ = acc.prepare(*make())
    losses = []
    for step in range(steps):
        with acc.accumulate(engine):
            loss = loss_of(engine, step)
            acc.backward(loss)
        losses.append(float(loss.detach()))
    return gathered_digest(engine), losses, engine.get_lr()


def guarded(
    stage: int,
    steps: int,
    faults: dict[int, str],
    base: int = 0,
    prepared: bool = False,
    gas: int = 1,
    make: Any = build,
    loss_of: Any = mlp_loss,
    **options: Any,
) -> tuple[Any, list[Any], list[float]]:
    """The same steps through ``recovering_step``, numbered from ``base`` (the commit's step numbers
    grow for the whole process); ``faults``: step -> "raise" on this rank, or "kill". ``prepared``:
    the stepper is given what ``accelerator.prepare`` returned, not the model to prepare. ``make``:
    builds the model and optimizer (and is the stepper's ``rebuild`` unless ``options`` say otherwise)."""
    from ncclguard.integrations.accelerate import recovering_step

    acc = accelerator(stage, gas)
    torch.manual_seed(1)
    # Given unprepared, the stepper prepares them: in a restarted process only once it joined the
    # survivors (ZeRO-3 cannot be built on the stand-in world of one it has until then).
    given = acc.prepare(*make()) if prepared else make()
    options.setdefault("rebuild", make)
    stepper = recovering_step(
        acc, *given, collective_timeout=BOUND_S, commit_timeout=60, rebuild_timeout=120, **options
    )
    results: list[Any] = []
    losses: dict[int, float] = {}

    def step_fn(engine: Any, step: int) -> None:
        loss = loss_of(engine, step)
        fault = faults.pop(step, None)
        if fault == "kill":
            put("results", results)
            rankkit.kill(VICTIM)
        if fault == "raise":
            rankkit.fault_fired(f"raise at step {step}")
            raise RuntimeError(f"injected failure at step {step}")
        acc.backward(loss)
        losses[step] = float(loss.detach())

    for step in stepper.steps(base + steps, start=base):
        res = stepper(step_fn, step - base, step=step)
        back = res.rewound_to and res.rewound_to - base
        results.append([step - base, bool(res), res.attempts, back, generation()] + ([res.pending] if gas > 1 else []))
    return stepper, results, [losses[s] for s in sorted(losses)]


def zero3() -> None:
    kept = OUT / f"reference-rank{ME}.json"  # the restarted process reads its first life's
    if LIFE == 0:
        kept.write_text(json.dumps(reference(3, STEPS)))
    digest, losses, lr = json.loads(kept.read_text())
    put("reference", digest)
    put("reference_losses", losses)
    put("reference_lr", lr)
    faults = {RAISE: "raise"} if ME == 2 else {KILL: "kill"} if ME == VICTIM and LIFE == 0 else {}
    stepper, results, losses = guarded(3, STEPS, faults, heal=True, snapshot_every=2)
    put("results", results)
    put("losses", losses)
    put("digest", gathered_digest(stepper.model))
    put("global_steps", stepper.model.global_steps)
    put("lr", stepper.model.get_lr())
    put("resume_step", stepper.resume_step)
    healed = stepper.healed
    put("healed", healed and [healed.role, healed.step, healed.bytes > 0])
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in stepper.recoveries])
    put("world", [dist.get_rank(), dist.get_world_size(), generation()])


def scheduler_outside_the_engine() -> str:
    """What the stepper says to a torch LR scheduler Accelerate steps outside the engine."""
    from ncclguard.integrations.accelerate import recovering_step

    cfg = {k: v for k, v in config(2).items() if k not in ("optimizer", "scheduler")}
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    module = torch.nn.Linear(6, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    engine, opt, sched = acc.prepare(module, opt, sched)
    try:
        recovering_step(acc, engine, opt, rebuild=lambda: (module, opt, sched))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def zero2() -> None:
    put("refused_scheduler", scheduler_outside_the_engine())
    digest, losses, _ = reference(2, 3)
    put("z2_reference", digest)
    stepper, results, z2_losses = guarded(2, 3, {1: "raise"} if ME == 0 else {}, base=STEPS, prepared=True)
    put("z2_digest", gathered_digest(stepper.model))
    put("z2_results", results)
    put("z2_losses_equal", z2_losses == losses)
    # What a preemption writes (accelerator.save_state), loaded back by Accelerate's resume call.
    path = stepper.save_checkpoint(OUT / "preempt", 3)
    saved = gathered_digest(stepper.model)
    x, y = batch(3)
    stepper(lambda engine: stepper.accelerator.backward(torch.nn.functional.mse_loss(engine(x), y)), step=STEPS + 3)
    moved = gathered_digest(stepper.model)
    stepper.accelerator.load_state(str(path))
    put("z2_resume", [path.name, saved != moved, gathered_digest(stepper.model) == saved])


def accumulation() -> None:
    """ZeRO-3 with gradient_accumulation_steps=2, a tiny BERT the stepper builds afresh itself (no
    rebuild=): rank 1 raises in window 1's first micro-batch; the window is redone whole on a new engine."""
    bert = {"make": build_bert, "loss_of": bert_loss}
    digest, losses, _ = reference(3, 4, gas=2, **bert)
    faults = {2: "raise"} if ME == 1 else {}
    stepper, results, acc_losses = guarded(3, 4, faults, base=STEPS + 10, gas=2, rebuild=None, **bert)
    put("acc_reference", digest)
    put("acc_digest", gathered_digest(stepper.model))
    put("acc_results", results)
    put("acc_losses_equal", acc_losses == losses)
    put("acc_global_steps", stepper.model.global_steps)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    put("life", LIFE)
    seconds = {}
    for part in (zero3, zero2, accumulation):
        start = time.monotonic()
        part()
        seconds[part.__name__] = round(time.monotonic() - start, 1)
    put("seconds", seconds)  # where the launch's time goes (read, not asserted)
    rankkit.done()


if __name__ == "__main__":
    main()
