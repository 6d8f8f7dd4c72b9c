"""Rank side of tests/integrations/test_hf_trainer_multirank.py: a real ``transformers.Trainer`` on 2 gloo ranks.

Usage: ``hf_worker.py ddp|deepspeed``. torchrun starts the ranks; ``TrainingArguments(use_cpu=True,
ddp_backend="gloo")`` joins them (``ddp``), or ``TrainingArguments(deepspeed=<ZeRO-2 dict>)``
(``deepspeed``). A tiny BERT classifier from a config, 6 steps, evaluation every 2 steps (2
batches per rank), a checkpoint at step 4; ``guard_trainer(eval_timeout_s=4, watchdog=...)``.

1. At the first evaluation (step 2) rank 1 stalls for 60 s after its first batch (an
   ``on_prediction_step`` callback sleeping), while rank 0 waits in the next batch's
   ``gather_for_metrics``. The guard skips the evaluation on both ranks by the deadline.
2. After the save of step 4, rank 0 alone does slow work (an ``on_save`` callback: an upload,
   say) while rank 1 trains on into the next step's collectives (DDP's C++ all_reduce, or ZeRO-2's
   gradient reduction). It goes on once the watchdog's report is merged (bounded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import rankkit
import torch
from hf_parts import Dataset, tiny_bert
from rankkit import put
from transformers import Trainer, TrainerCallback, TrainingArguments

import ncclguard
from ncclguard.integrations.hf import find_guard, guard_trainer
from ncclguard.recording.phase import current_phase

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
# Hang guards, so that a loaded machine only makes the launch longer: the merging rank's watchdog
# draws the incident's timeline.png after the report, and under load (4 CPU burners on 2 cores, in
# tests/workers/accelerate_worker.py's launch) that stood its main thread and its heartbeat ~2 s,
# which raised 3 more incidents at a 1.5 s hang timeout and the 1.8 s peer timeout of 0.3 s beats.
HEARTBEAT_S, HANG_S = 0.5, 8.0  # a hang: over 3x the ~2 s a loaded rank stood between two ops
PEER_TIMEOUT_S = 8.0  # a lost peer: over 3x the ~2 s without a heartbeat seen on a loaded rank
# Below the hang timeout: the guard ends the stalled evaluation before the watchdog would call
# rank 0's wait in the side group a hang, so the only incident is the one of the slow upload. The
# evaluation at step 6 runs while the merging rank may still draw that timeline: the deadline
# leaves it 2x the ~2 s a loaded rank can stand (two batches of a tiny BERT take tens of ms).
EVAL_TIMEOUT_S = 4.0
STALL_S = 60.0  # far past the deadline: only the guard can end it in time
BOUND_S = 60.0  # how long the slow rank waits at most for the watchdog's report: 3x what it needs
STEPS, EVAL_EVERY, SAVE_AT = 6, 2, 4


def reported(count: int) -> bool:
    """The watchdog's ``count``-th incident is merged (its report is on disk)."""
    incidents = OUT / "incidents"
    return incidents.is_dir() and len(list(incidents.glob("*/incident.json"))) >= count


class Faults(TrainerCallback):
    """Rank 1 stalls in its first evaluation; rank 0 uploads slowly after the save of step 4."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.stalls: list[float] = []
        self.upload: list[float] = []

    def on_prediction_step(self, args, state, control, **kw):
        if self.rank == 1 and state.global_step == EVAL_EVERY and not self.stalls:
            rankkit.fault_fired("stall in an evaluation")
            self.stalls.append(time.time())
            time.sleep(STALL_S)  # MARK: stall

    def on_save(self, args, state, control, **kw):
        if state.global_step != SAVE_AT:
            return
        started = OUT / "upload-started"
        deadline = time.monotonic() + BOUND_S
        if self.rank == 0:
            rankkit.fault_fired("a slow upload after the save")
            self.upload.append(time.time())
            started.touch()
            rankkit.when(lambda: reported(1), deadline - time.monotonic()).wait(BOUND_S)  # MARK: upload
            self.upload.append(time.time())
        else:
            # Rank 0 alone writes the checkpoint files, so it leaves the save later: rank 1 trains
            # on once the upload has begun, so that rank 0 is slow at the upload, not in the save.
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.01)


class Probe(TrainerCallback):
    """What the ranks see from inside the Trainer: phases, the dataloader state, the watchdog."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.phases: dict[str, list[str]] = {"eval": [], "save": [], "log": [], "train_forward": []}
        self.loaders: list[list[str]] = []
        self.skip_logged: list[float] = []
        self.watchdog_running: list[bool] = []
        self.incidents: list[dict] | None = None

    def forward_hook(self, module, args) -> None:
        if module.training:
            self.phases["train_forward"].append(current_phase())

    def on_step_begin(self, args, state, control, **kw):
        self.watchdog_running.append(ncclguard.current_watchdog() is not None)
        # Once in ~30 launches (CI, d5abbf7) DDP's backward found its wrapper gone (`ddp_weakref.reducer`
        # on None) at step 6 of the `ddp` scenario; which wrapper each step starts with, and who holds
        # it, is in the launch's log for the next time.
        wrapped = self.trainer.model_wrapped
        logging.getLogger("hf_worker").info(
            "step %d begins: model_wrapped %s at %#x, %d references",
            state.global_step + 1,
            type(wrapped).__name__,
            id(wrapped),
            sys.getrefcount(wrapped),
        )
        refs = self.trainer.accelerator.gradient_state.dataloader_references
        self.loaders.append([type(r).__name__ for r in refs])

    def on_prediction_step(self, args, state, control, **kw):
        self.phases["eval"].append(current_phase())

    def on_save(self, args, state, control, **kw):
        self.phases["save"].append(current_phase())

    def on_log(self, args, state, control, logs=None, **kw):
        self.phases["log"].append(current_phase())
        if logs and "eval_evaluation_failed" in logs:
            self.skip_logged.append(time.time())

    def on_train_end(self, args, state, control, **kw):  # before the guard's callback stops the watchdog
        watchdog = ncclguard.current_watchdog()
        self.incidents = watchdog.incidents if watchdog is not None else None


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    scenario = sys.argv[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = tiny_bert()
    deepspeed = None
    if scenario == "deepspeed":
        deepspeed = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        }
    args = TrainingArguments(
        output_dir=str(OUT / "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        deepspeed=deepspeed,
        learning_rate=1e-3,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        # The Trainer's default (True) all_gathers the token count before every step, in Python:
        # rank 1 would wait there. Off, it waits in the framework's gradient reduction instead.
        average_tokens_across_devices=False,
        # DDP's default also broadcasts the model's buffers (BERT's position and token-type ids)
        # at the start of every forward, from C++: rank 1 would wait there. Off, it waits in the
        # all_reduce of DDP's reducer. (Both are seen the same way, through the backend's numbers.)
        ddp_broadcast_buffers=False,
        report_to=[],
        disable_tqdm=True,
    )
    faults, probe = Faults(rank), Probe()
    model.register_forward_pre_hook(probe.forward_hook)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset(64, 0),
        eval_dataset=Dataset(16, 1),
        callbacks=[probe, faults],
    )
    probe.trainer = trainer
    guard_trainer(
        trainer,
        eval_timeout_s=EVAL_TIMEOUT_S,
        watchdog={
            "heartbeat_s": HEARTBEAT_S,
            "hang_timeout_s": HANG_S,
            "peer_timeout_s": PEER_TIMEOUT_S,
            "incident_dir": OUT / "incidents",
        },
    )
    trainer.train()
    guard = find_guard(trainer)
    put("global_step", trainer.state.global_step)
    put("digest", digest(trainer.model))
    put("log_history", trainer.state.log_history)
    put("skipped", [dataclasses.asdict(s) for s in guard.skipped])
    put("stalls", faults.stalls)
    put("upload", faults.upload)
    put("skip_logged", probe.skip_logged)
    put("phases", probe.phases)
    put("loaders", probe.loaders)
    put("watchdog_running", probe.watchdog_running)
    put("watchdog_after_train", ncclguard.current_watchdog() is not None)
    put("incidents", probe.incidents)
    put("wrapped", type(trainer.model_wrapped).__name__)
    put("n_params", sum(p.numel() for p in trainer.model.parameters()))
    put("n_tensors", len(list(trainer.model.parameters())))
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
