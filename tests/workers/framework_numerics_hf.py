"""The ``hf`` part of tests/workers/framework_numerics_worker.py: the NaN check on the HF Trainer's DDP wrapper.

``TrainingArguments(use_cpu=True, ddp_backend="gloo")`` makes the group; three Trainers in a row from
the same start (numerics_worker's 956,042-parameter classifier with dropout, as a model that returns its
loss; the Trainer's AdamW and its own shuffled, sharded data, the same seed: every run sees the same
batches), each under ``guard_trainer(recover=True, on_nonfinite=...)``, STEPS optimizer steps:

1. ``off``: ``on_nonfinite="off"``: no hook, DDP's own path (the reference);
2. ``clean``: ``on_nonfinite="redo"``, no fault: the check on the Trainer's wrapper;
3. ``redo``: the same, rank 1's loss times NaN at step K in the first attempt only (``compute_loss``);
4. ``flipped``: ``replica_check_every=EVERY``, no NaN; once step FLIP_AFTER is applied, one bit of one
   element of rank 2's ``fc2.weight`` flipped (``replicas_worker.flip``, in ``on_step_end``): the next
   step's check names rank 2, heals it from rank 0 and redoes the step.

Each step's ``StepResult`` is read where the adapter settles it (the engine's transactions, wrapped).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from rankkit import fault_fired, put
from transformers import Trainer, TrainerCallback, TrainingArguments

STEPS, K = 6, 3  # framework_numerics_worker's
EVERY, FLIP_AFTER = 3, 2  # the flipped run's check period, and the step after which rank 2's bit flips


class Said(logging.Handler):
    """What the ncclguard logger said at info level and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Rows(torch.utils.data.Dataset):
    """numerics_worker's samples as the Trainer's dicts (``x``, ``labels``)."""

    def __init__(self, n: int) -> None:
        from numerics_worker import CLASSES, FEATURES

        g = torch.Generator().manual_seed(99)
        self.x, self.y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Faulty(Trainer):
    """Rank 1's loss times NaN at step K, in the step's first attempt only (``fault``); or (``never``)
    batch K never trained on: no forward, no backward, every rank (the reference of a skipped batch,
    with :class:`NoStep`)."""

    fault = False
    never = False

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self.never and self.state.global_step == K:
            return torch.zeros(())
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step == K:
            self.tries_at_k = getattr(self, "tries_at_k", 0) + 1
            if self.fault and dist.get_rank() == 1 and self.tries_at_k == 1:
                fault_fired(f"a NaN loss at step {K}")
                loss = loss * float("nan")
        return loss


def recorded(engine: Any, results: list[dict[str, Any]], base: int = 0) -> None:
    """Each settled step's summary appended to ``results`` (the engine's transactions, wrapped); a step
    the adapter numbers positionally is given to the engine as ``base`` + it (the commit's step numbers
    must grow across the runs of one process)."""
    from numerics_worker import summary

    begin = engine.begin

    def wrapped_begin(step: int | None = None, **kwargs: Any) -> Any:
        tx = begin(None if step is None else base + step, **kwargs)
        settle = tx.settle

        def wrapped_settle(redo: Any) -> Any:
            res = settle(redo)
            results.append(summary(res))
            return res

        tx.settle = wrapped_settle
        return tx

    engine.begin = wrapped_begin


class NoStep(TrainerCallback):
    """The reference of a skipped batch: at step K no gradient reaches AdamW (it leaves a parameter
    without one alone) and the LR scheduler is not stepped."""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == K:
            for p in model.parameters():
                p.grad = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if state.global_step == K:
            own = lr_scheduler.step

            def once(*args: Any, **kwargs: Any) -> None:
                lr_scheduler.step = own  # stepped from the next step on

            lr_scheduler.step = once


class FlipAfter(TrainerCallback):
    """Rank 2 flips one bit of its ``fc2.weight`` once step FLIP_AFTER is applied."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from replicas_worker import BIT, flip

        if state.global_step == FLIP_AFTER + 1 and dist.get_rank() == 2:
            flip(self.module, BIT)  # type: ignore[arg-type]  # a Net's fc2


def replicas_seen(engine: Any, base: int = 0) -> list[list[Any]]:
    """The engine's replica findings: step (from ``base``), drifted ranks, the source, healed."""
    return [[s.step - base, s.ranks, s.source, s.healed] for s in engine.replicas.seen]


def hf_run(policy: str, fault: bool, every: int | None = None, never: bool = False) -> dict[str, Any]:
    """One Trainer from the same start; with ``every``, replicas checked that often and rank 2's bit flipped;
    with ``never``, batch K never trained on (:class:`NoStep`)."""
    from numerics_worker import BATCH, Net, flat

    from ncclguard.integrations.hf import find_guard, guard_trainer

    class LossNet(Net):  # the same parameters and names as numerics_worker's
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = super().forward(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    torch.manual_seed(1234)
    module = LossNet()
    args = TrainingArguments(
        output_dir=f"{os.environ['NCCLGUARD_TEST_OUT']}/hf-{policy}-{fault}-{never}",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,  # as Accelerate's default: the same buckets
        learning_rate=1e-3,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=STEPS,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Faulty(model=module, args=args, train_dataset=Rows(BATCH * STEPS * dist.get_world_size()))
    trainer.fault, trainer.never = fault, never
    if never:
        trainer.add_callback(NoStep())
    checks = {} if every is None else {"replica_check_every": every}
    guard_trainer(trainer, recover=True, watchdog=False, collective_timeout=30, on_nonfinite=policy, **checks)
    if every is not None:
        trainer.add_callback(FlipAfter(module))  # after the guard's own callbacks
    engine = find_guard(trainer).recovery.engine
    results: list[dict[str, Any]] = []
    recorded(engine, results)
    trainer.train()
    check = engine.numerics.check
    seen = [[s.step, s.ranks, s.finite_ranks, s.action] for s in engine.numerics.seen]
    return {
        "carries": check is not None and check.carries(trainer.model_wrapped),
        "results": results,
        "seen": seen,
        "replicas_seen": replicas_seen(engine),
        "global_step": trainer.state.global_step,
        "tries_at_k": getattr(trainer, "tries_at_k", 0),
        "params": flat(module),
        "lr": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
    }


def hf() -> None:
    from numerics_worker import same_everywhere

    said = Said()
    logging.getLogger("ncclguard").addHandler(said)
    off = hf_run("off", fault=False)  # its TrainingArguments make the group (gloo)
    put("off", {k: v for k, v in off.items() if k != "params"})
    said.lines.clear()
    clean = hf_run("redo", fault=False)
    put("clean", {k: v for k, v in clean.items() if k != "params"})
    put("clean_said", [line for line in said.lines if "non-finite" in line or "not checked for NaN" in line])
    redo = hf_run("redo", fault=True)
    put("redo", {k: v for k, v in redo.items() if k != "params"})
    put("clean_equal_to_off", torch.equal(clean["params"], off["params"]))
    put("redo_equal_to_off", torch.equal(redo["params"], off["params"]))
    put("redo_same_everywhere", same_everywhere(redo["params"]))
    # on_nonfinite="skip": rank 1's NaN at step K drops the batch on every rank, as a run that never trained on it.
    skip, never = hf_run("skip", fault=True), hf_run("off", fault=False, never=True)
    put("skip", {k: v for k, v in skip.items() if k != "params"})
    put("never", {k: v for k, v in never.items() if k != "params"})
    put("skip_equal_to_never", torch.equal(skip["params"], never["params"]))
    put("skip_equal_to_off", torch.equal(skip["params"], off["params"]))
    flipped = hf_run("redo", fault=False, every=EVERY)
    put("flipped", {k: v for k, v in flipped.items() if k != "params"})
    put("flipped_equal_to_off", torch.equal(flipped["params"], off["params"]))
    put("flipped_same_everywhere", same_everywhere(flipped["params"]))
    dist.barrier()
