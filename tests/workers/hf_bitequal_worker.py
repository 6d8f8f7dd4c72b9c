"""Rank side of tests/integrations/test_hf_bitequal_multirank.py: issue 44's setup, the HF
Trainer on DeepSpeed ZeRO-3 with a realistic BERT under ``guard_trainer(recover=True, heal=True)``
and nothing else of ncclguard's. Usage: ``hf_bitequal_worker.py kill|host [zero3|zero2|zero1|ddp|short|short2]``
(the stack: the ZeRO stage of the config below, the Trainer's own DDP with no DeepSpeed config,
``short``: issue 59's ZeRO-3 config as users write it, below, or ``short2``/``short1``: its ZeRO-2
case, on ZeRO-2 or ZeRO-1).

``kill`` (3 ranks, each under its supervisor, ``--restarts=1``): a ``BertForSequenceClassification``
from a transformers config with its default dropout (0.1) and vocabulary (hidden 128, 2 layers,
intermediate 512: 4.4 M parameters); a ZeRO-3 config as the Transformers docs write one, with
``"auto"`` values (``train_batch_size`` among them; the bucket sizes and the persistence threshold
follow the hidden size, so most parameters are partitioned and gathered), AdamW with
``torch_adam``, gradient clipping, DeepSpeed's ``WarmupLR`` over WARMUP steps; the Trainer's
shuffled sampler over SAMPLES rows, 3 steps an epoch, so the resume crosses epochs. Every rank's
first life trains STEPS steps with no fault and no ncclguard (the reference), then the same steps
on a new Trainer under ``guard_trainer``; launch rank VICTIM SIGKILLs itself as step KILL begins in
its first life. Restarted, its ``TrainingArguments`` are made on the stand-in world of one, it
joins, takes its partitions from its buddy's replica, and every rank goes back to the newest
snapshot every rank holds (``snapshot_every`` chosen by ncclguard).

Each rank records every micro-batch it computes (the last attempt of a step counts): the step, a
digest of the batch, of the CPU generator's state (dropout draws from it), the loss and the
learning rate, so that a healed run that differs names the first step and what differed. The
reference's record of launch rank VICTIM is kept in a file across its restart.

``kill short`` (3 ranks, as ``kill``): a BERT 32 wide with one layer, DeepSpeed's defaults
(``SHORT_CONFIG``: no sizes, no scheduler; ``stage3_param_persistence_threshold`` 1e5 keeps every
parameter but the word embeddings whole on every rank), the Trainer's own linear schedule with
warm-up (handed to DeepSpeed), 4 rows a batch, 2 batches a step (``gradient_accumulation_steps``,
the config's ``"auto"``), 8 steps an epoch, STEPS 10, launch rank VICTIM SIGKILLed between two
steps: in ``on_step_end`` once 4 steps are applied, before the Trainer logs the step's loss
(``logging_steps=1``: the survivors' ``nested_gather`` of the loss, outside any step, is what fails);
the resume is inside the first epoch.

``kill short2`` (3 ranks, as ``kill short``): issue 59's ZeRO-2 case written short (``SHORT2_CONFIG``:
stage 2, AdamW, clipping at 1.0, nothing else), the Trainer's cosine schedule with warm-up (handed to
DeepSpeed), 2 batches a step, launch rank VICTIM SIGKILLed at an epoch's edge: in ``on_step_end``
once the first epoch's 8 steps are applied; the resume is in the second epoch's first steps or at its
start.

Every rank also records whether the model object it passed to the Trainer is the module trained at
the end (``own_model``), and the sum is read through that object.

``host`` (4 ranks on two simulated hosts of 2, under ncclguard's launcher with one restart: ``GROUP_RANK``
is the launch rank // 2, as torchrun sets it per node): the same two runs, SAMPLES rows for 3 steps
an epoch on 4 ranks; launch ranks 2 and 3, the whole second host, SIGKILL themselves as step KILL
begins in their first life. Both restarted, they join together and take their partitions from
their buddies on the other host (rank 2's from rank 0, rank 3's from rank 1); each rank records its
part in the restore (its role, the step, who held each replica).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from hf_deepspeed_worker import digest  # the full parameters' digest (ZeRO-3: gathered, a collective)
from rankkit import put
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

import ncclguard
from ncclguard.integrations.hf import find_guard, guard_trainer
from ncclguard.recovery.snapshots.restore import Restored

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
SCENARIO = sys.argv[1]
STACK = sys.argv[2] if len(sys.argv) > 2 else "zero3"  # zero1, zero2, zero3, ddp (no DeepSpeed), or short
ME = int(os.environ["RANK"])  # the launch rank: a restarted process keeps it
if SCENARIO == "host":
    os.environ["GROUP_RANK"] = str(ME // 2)  # two hosts of two ranks, as torchrun --nnodes 2 places them
LIFE = ncclguard.restart_count()
SHORT2 = STACK in (
    "short2",
    "short1",
)  # ZeRO-2 (or 1) written short: clipping, the Trainer's cosine schedule, a kill at an epoch's edge
SHORT = STACK == "short" or SHORT2  # the config as users write it short: DeepSpeed's defaults, the Trainer's schedule
STEPS, KILL, VICTIM, WARMUP = (10, 8 if SHORT2 else 4, 2, 3) if SHORT else (8, 5, 2, 3)
KILLED = {"kill": [VICTIM], "host": [2, 3]}[SCENARIO]
# 3 steps an epoch (18 rows on 3 ranks, 24 on 4): the resume crosses epochs and skips batches;
# short: 8 steps an epoch (192 rows on 3 ranks, 4 a batch, 2 batches a step), the kill inside the first
BATCH, ACCUMULATE = (4, 2) if SHORT else (2, 1)
SAMPLES = (16 if SHORT else 3) * BATCH * int(os.environ["WORLD_SIZE"])
rankkit.rank = lambda: ME
# The watchdog guard_trainer starts writes its incidents (the victim's lost heartbeat) with the launch's output.
os.environ.setdefault("NCCLGUARD_WATCHDOG_INCIDENT_DIR", str(OUT / "incidents"))

# A ZeRO-3 config as the Transformers docs write one: "auto" filled in from TrainingArguments and
# the model's hidden size (reduce_bucket_size hidden^2, prefetch 0.9 hidden^2, persistence 10 hidden).
DS_CONFIG: dict[str, Any] = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


# The short way (issue 59): DeepSpeed's defaults (stage3_param_persistence_threshold 1e5: every parameter
# but the word embeddings of the small BERT below stays whole on every rank), no scheduler in it.
SHORT_CONFIG: dict[str, Any] = {
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


# Issue 59's ZeRO-2 case as users write it: the stage, the optimizer and clipping; DeepSpeed's defaults else.
SHORT2_CONFIG: dict[str, Any] = {
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def bert() -> BertForSequenceClassification:
    """A realistic small BERT: the config's default dropout (0.1) and vocabulary."""
    torch.manual_seed(0)
    if SHORT:
        config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        return BertForSequenceClassification(config)
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)
    return BertForSequenceClassification(config)


class Texts(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 30522, (n, 16), generator=gen)
        self.y = (self.x[:, 0] > 15000).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def ds_config() -> dict[str, Any] | None:
    """The DeepSpeed config of STACK (its ZeRO stage), or None for the Trainer's own DDP."""
    if STACK == "ddp":
        return None
    if SHORT:
        config = json.loads(json.dumps(SHORT2_CONFIG if SHORT2 else SHORT_CONFIG))
        if STACK == "short1":
            config["zero_optimization"]["stage"] = 1
        return config
    config: dict[str, Any] = json.loads(json.dumps(DS_CONFIG))
    config["zero_optimization"]["stage"] = int(STACK.removeprefix("zero"))
    return config


def arguments(name: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(OUT / name),
        use_cpu=True,
        ddp_backend="gloo",
        deepspeed=ds_config(),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,  # short: 2, into the config's "auto"
        learning_rate=1e-3,
        warmup_steps=WARMUP,
        # The Trainer's default, written out (short hands it to DeepSpeed); short2: cosine after the warm-up.
        lr_scheduler_type="cosine" if SHORT2 else "linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )


def _sha(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Traced(Trainer):
    """Records every micro-batch it computes: the step, the batch, the generator, the loss, the LR."""

    trace: list[list[Any]]
    script_model: torch.nn.Module

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        rng = _sha(torch.get_rng_state())
        out = super().compute_loss(model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else None
        batch = _sha(inputs["input_ids"], inputs["labels"])
        self.trace.append(["micro", self.state.global_step, batch, rng, float(loss.detach()).hex(), lr])
        return out


class Steps(TrainerCallback):
    """The launch ranks KILLED die with SIGKILL in their first life: as step KILL begins, or
    (``short``) between two steps, in ``on_step_end`` once KILL steps are applied, before the
    Trainer's logging gathers the loss over the ranks."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not SHORT:
            self._maybe_die(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if SHORT:
            self._maybe_die(state)

    def _maybe_die(self, state: Any) -> None:
        if state.global_step == KILL and ME in KILLED and LIFE == 0:
            rankkit.kill(ME)


def parameter_sum(model: torch.nn.Module) -> float:
    """The sum of ``model``'s full parameters (ZeRO-3: gathered for the read, a collective)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return float(sum(p.detach().double().sum() for p in model.parameters()))


def record_restores(engine: Any) -> None:
    """Records this rank's part in each restore from snapshots (the test's evidence of who held what)."""
    original = engine.put_snapshot_back
    restores: list[dict[str, Any]] = []
    put("restores", restores)  # the list itself: saved with what it holds at the end

    def put_snapshot_back(fetched: Any) -> Restored:
        r = original(fetched)
        restores.append(
            {"ok": r.ok, "role": r.role, "step": r.step, "rolled_back": r.rolled_back, "holders": r.holders}
        )
        return r

    engine.put_snapshot_back = put_snapshot_back


def train(name: str, guarded: bool) -> Traced:
    args = arguments(name)
    model = bert()  # the script's own object: after a heal it must still be the module trained
    trainer = Traced(model=model, args=args, train_dataset=Texts(SAMPLES, seed=1))
    trainer.trace, trainer.script_model = [], model
    if guarded:
        trainer.add_callback(Steps())
        guard_trainer(trainer, recover=True, heal=True)  # and nothing else, as issue 44's user
        record_restores(find_guard(trainer).recovery.engine)
    trainer.train()
    return trainer


def kill() -> None:
    put("life", LIFE)
    kept = OUT / f"reference_rank{ME}.json"
    if LIFE == 0:
        ref = train("reference", guarded=False)
        kept.write_text(json.dumps({"digest": digest(ref), "sum": parameter_sum(ref.script_model), "trace": ref.trace}))
    reference = json.loads(kept.read_text())
    put("reference", reference["digest"])
    put("reference_sum", reference["sum"])
    put("reference_trace", reference["trace"])
    trainer = train("guarded", guarded=True)
    put("digest", digest(trainer))
    trained = trainer.model_wrapped.module
    # The model object the script passed is the module trained (a heal used to leave it behind:
    # ZeRO-2 kept it at the failed step, ZeRO-3 with partitions of a destroyed engine).
    put("own_model", trained is trainer.script_model)
    put("sum", parameter_sum(trainer.script_model if trained is trainer.script_model else trained))
    # ZeRO-3: the parameters kept whole on every rank (DeepSpeed's persistence threshold), of all
    params = list(trained.parameters())
    put("persistent", [sum(bool(getattr(q, "ds_persist", False)) for q in params), len(params)])
    put("trace", trainer.trace)
    put("global_step", trainer.state.global_step)
    put("global_steps", getattr(trainer.model_wrapped, "global_steps", trainer.state.global_step))  # DeepSpeed's
    recovery = find_guard(trainer).recovery
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in recovery.recoveries])
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    {"kill": kill, "host": kill}[SCENARIO]()
    rankkit.done()


if __name__ == "__main__":
    main()
