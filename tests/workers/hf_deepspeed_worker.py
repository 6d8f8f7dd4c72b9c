"""Rank side of tests/integrations/test_hf_deepspeed_multirank.py: the HF Trainer on DeepSpeed ZeRO under
``guard_trainer(recover=True, heal=True)``, on real gloo ranks under torchrun.
Usage: ``hf_deepspeed_worker.py heal|stages|numerics``.

``heal`` (3 ranks, each under its supervisor, ``--restarts=1``): every rank's first life trains
STEPS steps of a tiny BERT on ZeRO-3 with no fault and no ncclguard (the reference: its gathered
parameters' digest, its losses), then the same steps on a new Trainer under ``guard_trainer``,
with, on the first attempt of a step only:

- step RAISE: rank 2 raises inside ``compute_loss`` (every rank alive: the step is redone on a
  new engine);
- step STALL: rank 0 sleeps STALL_S, past the step bound (the others' ZeRO-3 collectives fail at
  the bound; the step is redone on a new engine);
- step KILL: launch rank 1 SIGKILLs itself as the step begins. Its supervisor restarts it; its
  Trainer's ``train()`` joins the survivors, builds its engine with them, and takes its ZeRO-3
  partitions from its buddy's replica; every rank goes back to the newest snapshot (step KILL-1,
  with ``snapshot_every=2``) through the Trainer's resume path.

``stages`` (2 ranks): first what ``guard_trainer(recover=True)`` refuses before any step (a config
it cannot recover, ``allow_shrink``, a model it cannot build afresh) and what the Trainer makes of
``fsdp=`` on the CPU; then ZeRO-1 and ZeRO-2 Trainers (ZeRO-2: ``model_init`` and 2 micro-batches a
step), each a reference run and a guarded run whose step 1 raises on rank 1; then a ZeRO-2 Trainer's
snapshot state is offered to the ZeRO-1 engine, and the ZeRO-1 Trainer's to a wider model: both refused.

``numerics`` (3 ranks): ZeRO-2 and ZeRO-3 Trainers under ``on_nonfinite="redo"``, a NaN loss on rank 1 at
step NAN_AT and on rank 2 at the next step (each in its first attempt), against a reference run; then
ZeRO-2 under ``"raise"``; ``"skip"`` refused before any step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from hf_parts import Dataset, tiny_bert
from rankkit import put
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

import ncclguard
from ncclguard.errors import NonFiniteGradient
from ncclguard.integrations.hf import find_guard, guard_trainer

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
ME = int(os.environ["RANK"])  # the launch rank: a restarted process keeps it
LIFE = ncclguard.restart_count()
STEPS, RAISE, STALL, KILL, VICTIM = 8, 1, 2, 5, 1
NAN_STEPS, NAN_AT = 4, 2  # the numerics launch: rank 1's loss times NaN in step NAN_AT's first attempt
BOUND_S, STALL_S = 3.0, 8.0
rankkit.rank = lambda: ME


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }


def arguments(stage: int, name: str, steps: int, **kw: Any) -> TrainingArguments:
    kw.setdefault("deepspeed", ds_config(stage))
    return TrainingArguments(
        output_dir=str(OUT / name),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **kw,
    )


class FaultyTrainer(Trainer):
    """The Trainer with faults on the first attempt of some steps (``faults``: step -> (rank, what,
    the micro-batch of the step it falls in, from 1))."""

    faults: dict[int, tuple[int, str, int]] = {}
    calls: dict[int, int] = {}

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.state.global_step
        self.calls[step] = self.calls.get(step, 0) + 1
        fault = self.faults.get(step)
        if fault is not None and fault[2] == self.calls[step]:
            del self.faults[step]
        else:
            fault = None
        if fault is not None and fault[0] == ME:
            rankkit.fault_fired(f"{fault[1]} at step {step}")
            if fault[1] == "raise":
                raise RuntimeError(f"injected failure at step {self.state.global_step}")
            if fault[1] == "nan":  # a NaN loss: every gradient of this rank's backward is NaN
                return super().compute_loss(model, inputs, *args, **kwargs) * float("nan")
            time.sleep(STALL_S)  # "stall": past the step bound; the others fail their collectives
        return super().compute_loss(model, inputs, *args, **kwargs)


class Steps(TrainerCallback):
    """Records the step every step begins at; launch rank VICTIM dies at step KILL in its first life."""

    def __init__(self, kill: bool) -> None:
        self.begun: list[int] = []
        self.kill = kill

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.begun.append(state.global_step)
        if self.kill and state.global_step == KILL and ME == VICTIM and LIFE == 0:
            put("begun_life0", self.begun)
            rankkit.kill(VICTIM)


def digest(trainer: Trainer) -> str:
    """The digest of the full parameters (ZeRO-3: gathered for the read)."""
    h = hashlib.sha256()
    model = trainer.model_wrapped.module
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def losses(trainer: Trainer) -> list[list[float]]:
    return [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]


def model(init: bool) -> dict[str, Any]:
    """The Trainer's model: built here, or by the Trainer with ``model_init`` (at every ``train()``)."""
    torch.manual_seed(0)
    return {"model_init": tiny_bert} if init else {"model": tiny_bert()}


def reference(stage: int, name: str, steps: int, init: bool = False, **kw: Any) -> tuple[str, list[list[float]]]:
    trainer = Trainer(**model(init), args=arguments(stage, name, steps, **kw), train_dataset=Dataset(96, seed=96))
    trainer.train()
    return digest(trainer), losses(trainer)


def guarded(
    stage: int,
    name: str,
    steps: int,
    faults: dict[int, tuple[int, str, int]],
    kill: bool,
    init: bool = False,
    policy: str = "auto",
    **kw: Any,
) -> tuple[Trainer, Steps]:
    steps_seen = Steps(kill)
    args = arguments(stage, name, steps, **kw)
    trainer = FaultyTrainer(**model(init), args=args, train_dataset=Dataset(96, seed=96), callbacks=[steps_seen])
    trainer.faults, trainer.calls = dict(faults), {}
    guard_trainer(
        trainer,
        recover=True,
        heal=True,
        watchdog=False,
        collective_timeout=BOUND_S,
        commit_timeout=60,
        rebuild_timeout=120,  # the restarted process imports torch, transformers and DeepSpeed again
        heal_timeout=60,
        snapshot_every=2,
        on_nonfinite=policy,
    )
    trainer.train()
    return trainer, steps_seen


def report(trainer: Trainer, seen: Steps, prefix: str = "") -> None:
    recovery = find_guard(trainer).recovery
    put(prefix + "digest", digest(trainer))
    put(prefix + "losses", losses(trainer))
    put(prefix + "begun", seen.begun)
    put(prefix + "global_step", trainer.state.global_step)
    put(prefix + "global_steps", trainer.model_wrapped.global_steps)  # DeepSpeed's own count
    put(prefix + "recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in recovery.recoveries])
    put(
        prefix + "logged",
        [e["ncclguard_recover_attempts"] for e in trainer.state.log_history if "ncclguard_recover_s" in e],
    )


def heal() -> None:
    put("life", LIFE)
    if LIFE == 0:
        ref, ref_losses = reference(3, "reference", STEPS)
        put("reference", ref)
        put("reference_losses", ref_losses)
    faults = {RAISE: (2, "raise", 1), STALL: (0, "stall", 1)}
    trainer, seen = guarded(3, "guarded", STEPS, faults, kill=True)
    report(trainer, seen)
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])


def refused(trainer: Trainer, **kw: Any) -> str:
    try:
        guard_trainer(trainer, recover=True, watchdog=False, **kw)
    except ValueError as exc:
        assert "training_step" not in vars(trainer), "wrapped before the refusal"
        return str(exc)
    return "accepted"


def setups() -> None:
    """What guard_trainer(recover=True) refuses, before any step, and what fsdp= is on the CPU."""
    data = Dataset(96, seed=96)
    fsdp = Trainer(
        model=tiny_bert(), args=arguments(0, "fsdp", 1, deepspeed=None, fsdp="full_shard"), train_dataset=data
    )
    put("fsdp_on_cpu", [fsdp.is_fsdp_enabled, str(fsdp.accelerator.distributed_type), refused(fsdp)])
    put("refused_stage0", refused(Trainer(model=tiny_bert(), args=arguments(0, "s0", 1), train_dataset=data)))
    nvme = ds_config(3)
    nvme["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(OUT)}
    put(
        "refused_nvme",
        refused(Trainer(model=tiny_bert(), args=arguments(3, "nvme", 1, deepspeed=nvme), train_dataset=data)),
    )
    put(
        "refused_shrink",
        refused(Trainer(model=tiny_bert(), args=arguments(2, "shrink", 1), train_dataset=data), allow_shrink=True),
    )
    plain = torch.nn.Sequential(torch.nn.Embedding(100, 8))
    put("refused_module", refused(Trainer(model=plain, args=arguments(2, "plain", 1), train_dataset=data)))
    made = Trainer(model_init=tiny_bert, args=arguments(2, "init", 1), train_dataset=data)
    put("accepted_model_init", refused(made))


def stages() -> None:
    setups()
    trainers = {}
    for stage in (1, 2):
        # ZeRO-2's Trainer builds its model with model_init (at every train()) and accumulates 2
        # micro-batches a step: the raise falls in the second, after the first's backward.
        init, gas, micro = (True, 2, 2) if stage == 2 else (False, 1, 1)
        ref, ref_losses = reference(stage, f"reference{stage}", 3, init, gradient_accumulation_steps=gas)
        put(f"reference{stage}", ref)
        put(f"reference_losses{stage}", ref_losses)
        faults = {RAISE: (1, "raise", micro)}
        trainer, seen = guarded(
            stage, f"guarded{stage}", 3, faults, kill=False, init=init, gradient_accumulation_steps=gas
        )
        report(trainer, seen, prefix=f"z{stage}_")
        put(f"z{stage}_generation", ncclguard.recovery.generation())
        trainers[stage] = trainer
    refusals(trainers[1], trainers[2])


def refusals(zero1: Trainer, zero2: Trainer) -> None:
    """A snapshot's state that does not fit the engine it is offered to is refused before any copy."""
    codec1 = find_guard(zero1).recovery.state_codec()
    codec2 = find_guard(zero2).recovery.state_codec()
    state = codec2.capture()
    put("stage_refusal", codec1.check(state))
    before = digest(zero1)
    try:
        codec1.apply(state)
    except ValueError as exc:
        put("apply_refused", str(exc))
    put("unchanged_after_refusal", digest(zero1) == before)
    wide = BertForSequenceClassification(BertConfig(**{**zero1.model.config.to_dict(), "hidden_size": 64}))
    other = Trainer(model=wide, args=arguments(1, "other", 1), train_dataset=Dataset(96, seed=96))
    guard_trainer(other, recover=True, heal=True, watchdog=False, collective_timeout=BOUND_S)
    other.train()
    put("shape_refusal", find_guard(other).recovery.state_codec().check(codec1.capture()))


def numerics() -> None:
    """ZeRO-2 and ZeRO-3 Trainers, each a reference run, a clean run under ``on_nonfinite="redo"`` and
    one whose step NAN_AT gives rank 1 a NaN loss in its first attempt, and step NAN_AT + 1 rank 2 (on
    the new engine the first redo built); then ZeRO-2 under ``"raise"``."""
    for stage in (2, 3):
        ref, ref_losses = reference(stage, f"nan_reference{stage}", NAN_STEPS)
        put(f"reference{stage}", ref)
        put(f"reference_losses{stage}", ref_losses)
        twice = {NAN_AT: (1, "nan", 1), NAN_AT + 1: (2, "nan", 1)}
        for name, faults in (("clean", {}), ("nan", twice)):
            trainer, seen = guarded(stage, f"{name}{stage}", NAN_STEPS, faults, kill=False, policy="redo")
            report(trainer, seen, prefix=f"{name}{stage}_")
            numerics = find_guard(trainer).recovery.engine.numerics
            found = [
                [
                    f.step,
                    f.ranks,
                    f.finite_ranks,
                    f.action,
                    {str(r): [b.params for b in bs] for r, bs in f.buckets.items()},
                ]
                for f in numerics.seen
            ]
            put(f"{name}{stage}_seen", found)
            put(f"{name}{stage}_checked", numerics.check is not None and numerics.check.installed)
    try:
        guarded(2, "raise2", NAN_STEPS, {NAN_AT: (1, "nan", 1)}, kill=False, policy="raise")
        put("raised", None)
    except NonFiniteGradient as exc:
        put("raised", str(exc))
    skip = Trainer(model=tiny_bert(), args=arguments(2, "skip", 1), train_dataset=Dataset(96, seed=96))
    put("refused_skip", refused(skip, on_nonfinite="skip"))
    put("generation", ncclguard.recovery.generation())


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    {"heal": heal, "stages": stages, "numerics": numerics}[sys.argv[1]]()
    rankkit.done()


if __name__ == "__main__":
    main()
