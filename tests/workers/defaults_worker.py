"""Rank side of tests/watching/test_defaults_multirank.py. Usage: defaults_worker.py loop|hf.

Launched as ``ncclguard run --ncclguard-restarts 1`` does it (each rank under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default) and nothing else set: no timeout, no
``heal``, no ``allow_shrink``. Under restarts the engine heals by default, so a rank asleep for good
is ended by its supervisor, restarted, healed from a live peer and the job ends on its full world.

``loop`` (3 ranks): a BERT classifier of 2.05M parameters (its config's default dropout), AdamW,
a warm-up schedule, shuffled data from the step number, ``RecoveringStep(module, opt,
scheduler=schedule)``; the loop as docs/recovery.md writes it for DDP. WARM healthy steps (the
judge bound is learned: its 10 s floor), then at step ASLEEP launch rank 2 sleeps in Python for good.

``hf`` (3 ranks): the HF Trainer with ``TrainingArguments``' defaults, ``guard_trainer(trainer,
recover=True)`` and nothing else: at the start of global step HF_ASLEEP (before the judge bound's
warm-up: its 30 s default) launch rank 2 sleeps for good in the model's forward.

Both scripts are written in the order their docs use: the process group first (``dist.init_process_group``,
the Trainer's ``TrainingArguments`` through Accelerate), ncclguard imported after. A restarted process
stands in all the same: the start-up hook (``NCCLGUARD_RESTART_COUNT`` set by the supervisor) wraps
``init_process_group`` before the script's first line. Each life records whether ncclguard was
imported before its group was made (``order``).

Results go by launch rank plus 10 for a restarted process (``rank12.json``): the first life's are
kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

# ncclguard is imported after the process group is made, as a user's script does (see the module doc).
ME, LIFE = int(os.environ["RANK"]), int(os.environ.get("NCCLGUARD_RESTART_COUNT", "0") or 0)
rankkit.rank = lambda: ME + 10 * LIFE
ASLEEP, STEPS = 12, 16  # loop: past the judge bound's warm-up (10 intervals)
HF_ASLEEP, HF_STEPS = 3, 10


def _digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _events(engine: Any) -> list[dict[str, Any]]:
    return list(engine.timing.driver.events)


def _order(before: bool) -> None:
    """Records whether ncclguard was imported before the script made its group (it was not), and the
    group made: a restarted process's is the stand-in world of one until it joins."""
    put("order", {"ncclguard_first": before, "group": [dist.get_rank(), dist.get_world_size()]})


def loop() -> None:
    import transformers

    before = "ncclguard" in sys.modules
    dist.init_process_group("gloo")  # as a user writes it, first: no timeout; a restarted process stands in
    _order(before)
    from ddp_bitequal_worker import batch, dataset, make  # imports ncclguard: after the group, as users do

    import ncclguard
    from ncclguard.world import current_world

    rankkit.rank = lambda: ME + 10 * LIFE  # that module sets its own on import
    module, opt = make()
    schedule = transformers.get_linear_schedule_with_warmup(opt, 3, STEPS)
    stepper = ncclguard.RecoveringStep(module, opt, scheduler=schedule)  # nothing else
    put("heal", stepper.engine.options.heal)
    put("plan", [ASLEEP, STEPS])
    put("pid", os.getpid())
    put("resume_step", stepper.resume_step)
    put("lane", getattr(stepper.healed, "lane", None))  # the group a restarted process was healed over
    rankkit.save()
    data, results = dataset(), []
    for step in range(stepper.resume_step or 0, STEPS):
        ids, labels = batch(data, step, world=int(os.environ["WORLD_SIZE"]))  # the launch's (the drill runs 4 too)

        def step_fn(model: torch.nn.Module, step: int = step, ids: torch.Tensor = ids, labels: torch.Tensor = labels):
            if ME == 2 and LIFE == 0 and step == ASLEEP:
                put("results", results)
                rankkit.stuck_for_good()
            model(input_ids=ids, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        t0 = time.time()
        res = stepper(step_fn, step=step)
        results.append(
            {
                "step": step,
                "ok": res.ok,
                "attempts": res.attempts,
                "size": dist.get_world_size(),
                "healed": res.healed.role if res.healed is not None else None,
                "lane": getattr(res.healed, "lane", None),
                "started": t0,
                "ended": time.time(),
            }
        )
        if not res:
            break
        schedule.step()
    put("results", results)
    put("events", _events(stepper.engine))
    put("judge_s", stepper.engine.timing.judge_s())
    put("digest", _digest(module))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


def accelerate() -> None:
    """The ``loop`` run as docs/reference/integrations-accelerate.md writes it: ``Accelerator()`` makes the
    group, the model and optimizer prepared, ``recovering_step(accelerator, model, optimizer,
    scheduler=schedule)`` and nothing else; the scheduler stepped by the loop once per applied step."""
    import transformers
    from accelerate import Accelerator

    before = "ncclguard" in sys.modules
    accelerator = Accelerator(cpu=True)  # makes the process group first; a restarted process's stands in
    _order(before)
    from ddp_bitequal_worker import batch, dataset, make  # imports ncclguard: after the group, as users do

    from ncclguard.integrations.accelerate import recovering_step
    from ncclguard.world import current_world

    rankkit.rank = lambda: ME + 10 * LIFE  # that module sets its own on import
    module, opt = make()
    schedule = transformers.get_linear_schedule_with_warmup(opt, 3, STEPS)
    model, opt = accelerator.prepare(module, opt)
    stepper = recovering_step(accelerator, model, opt, scheduler=schedule)  # nothing else
    put("heal", stepper.engine.options.heal)
    put("plan", [ASLEEP, STEPS])
    put("pid", os.getpid())
    put("resume_step", stepper.resume_step)
    rankkit.save()
    data, results = dataset(), []
    for step in range(stepper.resume_step or 0, STEPS):
        ids, labels = batch(data, step, world=int(os.environ["WORLD_SIZE"]))

        def step_fn(m: torch.nn.Module, step: int = step, ids: torch.Tensor = ids, labels: torch.Tensor = labels):
            if ME == 2 and LIFE == 0 and step == ASLEEP:
                put("results", results)
                rankkit.stuck_for_good()
            accelerator.backward(m(input_ids=ids, labels=labels).loss)
            accelerator.clip_grad_norm_(m.parameters(), 1.0)

        t0 = time.time()
        res = stepper(step_fn, step=step)
        healed = res.healed.role if res.healed is not None else None
        results.append(
            {"step": step, "ok": res.ok, "attempts": res.attempts, "size": dist.get_world_size(), "healed": healed,
             "started": t0, "ended": time.time()}
        )  # fmt: skip
        if not res:
            break
        schedule.step()
    put("results", results)
    put("events", _events(stepper.engine))
    put("processes", [accelerator.process_index, accelerator.num_processes])
    put("digest", _digest(module))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


def lightning() -> None:
    """The ``loop``'s BERT as a LightningModule, as docs/reference/integrations-lightning.md writes it:
    ``Trainer(callbacks=[NcclGuardCallback(recover=True)])`` with Lightning's defaults (the DDP
    strategy on gloo, its DistributedSampler), AdamW and a warm-up schedule from
    ``configure_optimizers`` (stepped every step); the fit makes the process group."""
    import transformers
    from ddp_bitequal_worker import dataset, make
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from ncclguard.integrations.lightning import NcclGuardCallback
    from ncclguard.world import current_world

    rankkit.rank = lambda: ME + 10 * LIFE  # that module sets its own on import
    ends: dict[int, float] = {}

    class Bert(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.bert, _ = make()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if ME == 2 and LIFE == 0 and self.trainer.global_step == ASLEEP:
                rankkit.stuck_for_good()
            ids, labels = batch
            return self.bert(input_ids=ids, labels=labels).loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
            schedule = transformers.get_linear_schedule_with_warmup(opt, 3, STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            ends[trainer.global_step] = time.time()

    guard = NcclGuardCallback(recover=True)  # nothing else: every timeout at its default, heal by default
    trainer = Trainer(
        accelerator="cpu", devices=3, max_steps=STEPS, gradient_clip_val=1.0, callbacks=[guard, StepEnds()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    put("pid", os.getpid())
    rankkit.save()
    model = Bert()
    trainer.fit(model, DataLoader(dataset(), batch_size=4))
    assert guard.recovery is not None
    put("heal", guard.recovery.engine.options.heal)
    put("plan", [ASLEEP, STEPS])
    put("global_step", trainer.global_step)
    put("recoveries", [{"step": r.step, "world_size": r.world_size} for r in guard.recoveries])
    put("events", _events(guard.recovery.engine))
    put("step_ends", ends)
    put("digest", _digest(model))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


def hf() -> None:
    from hf_parts import Dataset, cpu_arguments, tiny_bert
    from transformers import Trainer

    out = os.environ["NCCLGUARD_TEST_OUT"]
    torch.manual_seed(0)
    model = tiny_bert()
    holder: dict[str, Trainer] = {}

    def asleep(_module: torch.nn.Module, _inputs: object) -> None:
        if ME == 2 and LIFE == 0 and holder["t"].state.global_step == HF_ASLEEP:
            rankkit.stuck_for_good()

    model.register_forward_pre_hook(asleep)
    before = "ncclguard" in sys.modules
    # TrainingArguments makes the process group (through Accelerate's state), before ncclguard is imported.
    args = cpu_arguments(f"{out}/hf", HF_STEPS)
    from transformers import TrainerCallback

    ends: dict[int, float] = {}

    class StepEnds(TrainerCallback):
        """When each global step ended here (the drill's time from the stall to training going on)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends[state.global_step] = time.time()

    t = holder["t"] = Trainer(model=model, args=args, train_dataset=Dataset(96, seed=1), callbacks=[StepEnds()])
    _order(before)
    from ncclguard.integrations.hf import find_guard, guard_trainer
    from ncclguard.world import current_world

    guard_trainer(t, recover=True)  # nothing else: every timeout at its default, heal by default
    put("pid", os.getpid())
    rankkit.save()
    t0 = time.time()
    t.train()
    guard = find_guard(t)
    assert guard is not None and guard.recovery is not None
    engine = guard.recovery.engine
    put("heal", engine.options.heal)
    put("plan", [HF_ASLEEP, HF_STEPS])
    put("global_step", t.state.global_step)
    put("recoveries", [{"step": r.step, "s": r.elapsed_s, "world_size": r.world_size} for r in engine.recoveries])
    put("events", _events(engine))
    put("train_s", round(time.time() - t0, 3))
    put("train_end", time.time())
    put("step_ends", ends)
    put("digest", _digest(t.model))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    put("life", LIFE)
    {"loop": loop, "hf": hf, "accelerate": accelerate, "lightning": lightning}[sys.argv[1]]()
