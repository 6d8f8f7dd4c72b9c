"""Rank side of tests/recovery/test_preempt_multirank.py: a loop under a recovery engine, told to stop by SIGTERM.

``python preempt_worker.py STACK PHASE OUT`` (STACK: ddp, fsdp2, hf, hf-deepspeed, deepspeed, accelerate or
lightning; PHASE: train or resume; hf-deepspeed is the HF Trainer on DeepSpeed ZeRO-3, lightning a Lightning
Trainer with the DDP strategy under ``NcclGuardCallback(recover=True)``):

- train: trains until stopped (no step limit in sight). After every applied step each rank writes
  its local state (parameters and optimizer state, the shards under FSDP2) to ``OUT/state-<rank>.pt``
  and the step to ``OUT/progress-<rank>``: the last one written is the state at the stop, since the
  engine stops when the loop comes back for its next step. The checkpoint goes to
  ``NCCLGUARD_PREEMPT_DIR`` (the launch sets it).
- resume: a new launch builds the same model and optimizer and loads the checkpoint named in
  ``PREEMPTED.json`` with the framework's own resume call (``dcp.load`` + ``set_state_dict``;
  ``trainer.train(resume_from_checkpoint=...)``; ``engine.load_checkpoint``; ``accelerator.load_state``;
  ``trainer.fit(model, ckpt_path=...)``), then writes ``OUT/resumed-<rank>.json``: whether
  every tensor equals the one recorded at the stop, bit for bit, and the step it resumed at.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STACK, PHASE, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
STEP_SLEEP_S = 0.05  # a step this short leaves the SIGTERM to land between steps as well as inside
NO_END = 100_000  # steps: the job only ends by the stop
# benchmarks/preempt_stop.py --params-m: the width of two square layers (the loop's and DeepSpeed's
# model at a real size); 0: the tiny model the tests use.
WIDTH = int(os.environ.get("NCCLGUARD_PREEMPT_WIDTH", "0"))


def local(t: Any) -> Any:
    """A tensor's local part (FSDP2's parameters and optimizer state are DTensors), detached, on CPU."""
    if isinstance(t, torch.Tensor):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().clone().cpu()
    return t


def snapshot(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and optimizer state (the optimizer's own parameters too: ZeRO's fp32
    partitions), by name or by place, as plain tensors; of a DeepSpeed engine (the Trainer's on ZeRO-3,
    whose module holds no whole parameter), its own partitions as DeepSpeedState takes them."""
    if callable(getattr(module, "zero_optimization_stage", None)):  # a DeepSpeed engine: its own ZeRO state
        from ncclguard.integrations.deepspeed.state import DeepSpeedState

        own = DeepSpeedState(module).capture().tensors
        return {
            "params": {k: local(t) for k, t in own.items() if not k.startswith("optimizer.")},
            "optim": {k: local(t) for k, t in own.items() if k.startswith("optimizer.")},
        }
    params = {name: local(p) for name, p in module.named_parameters()}
    state = {}
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's and DeepSpeed's wrappers
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            state[f"{g}.{i}"] = local(p)
            for key, value in inner.state.get(p, {}).items():
                state[f"{g}.{i}.{key}"] = local(value)
    return {"params": params, "optim": state}


def record(module: torch.nn.Module, optimizer: Any, step: int) -> None:
    rank = dist.get_rank()
    if WIDTH:  # the benchmark at a real size: its progress only (it stops the job, never resumes it)
        (OUT / f"progress-{rank}").write_text(str(step))
        return
    tmp = OUT / f".state-{rank}.pt"
    torch.save({"step": step, **snapshot(module, optimizer)}, tmp)
    os.replace(tmp, OUT / f"state-{rank}.pt")
    (OUT / f"progress-{rank}").write_text(str(step))


def compare(module: torch.nn.Module, optimizer: Any, step: int) -> None:
    """Writes whether this rank's state equals the one recorded at the stop, tensor by tensor."""
    rank = dist.get_rank()
    want = torch.load(OUT / f"state-{rank}.pt", weights_only=True)
    have = snapshot(module, optimizer)
    differ = [
        f"{part}:{name}"
        for part in ("params", "optim")
        for name in sorted(set(want[part]) | set(have[part]))
        if name not in want[part] or name not in have[part] or not torch.equal(want[part][name], have[part][name])
    ]
    result = {
        "recorded_step": want["step"],
        "resumed_step": step,
        "tensors": len(want["params"]) + len(want["optim"]),
        "optim_tensors": len(want["optim"]),
        "differ": differ,
    }
    (OUT / f"resumed-{rank}.json").write_text(json.dumps(result))


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    if WIDTH:
        w = WIDTH
        layers = [torch.nn.Linear(8, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 4))
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def shard(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def loop() -> None:
    """RecoveringStep over DDP (the default wrap) or FSDP2, until SIGTERM stops it."""
    import ncclguard

    module = tiny()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    wrap = ncclguard.FSDP2(shard, device_type="cpu") if STACK == "fsdp2" else None
    stepper = ncclguard.RecoveringStep(module, opt, wrap=wrap, collective_timeout=30.0)
    for step in range(NO_END):
        x, y = batch(step)
        res = stepper(lambda model, x=x, y=y: torch.nn.functional.mse_loss(model(x), y).backward(), step=step)
        res.raise_for_error()
        record(stepper.module, opt, step)
        time.sleep(STEP_SLEEP_S)


def resume_loop() -> None:
    """The framework's own resume: get_state_dict, dcp.load, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module = tiny()
    if STACK == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        shard(module, init_device_mesh("cpu", (dist.get_world_size(),)))
        model: torch.nn.Module = module
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    marker = json.loads((Path(os.environ["NCCLGUARD_PREEMPT_DIR"]) / "PREEMPTED.json").read_text())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "ncclguard": {"step": torch.tensor(-1)}}
    dcp.load(state, checkpoint_id=marker["path"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    compare(module, opt, int(state["ncclguard"]["step"]))


def engine() -> Any:
    import deepspeed

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1_000_000,
    }
    model = tiny()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def deepspeed_loop(phase: str) -> None:
    """DeepSpeed ZeRO-2 under CommittedEngineStep; resumed with engine.load_checkpoint."""
    from ncclguard.integrations.deepspeed import CommittedEngineStep

    eng = engine()
    if phase == "resume":
        path, _ = eng.load_checkpoint(os.environ["NCCLGUARD_PREEMPT_DIR"])
        assert path is not None, "engine.load_checkpoint found no checkpoint"
        compare(eng.module, eng.optimizer, eng.global_steps)
        return
    stepper = CommittedEngineStep(eng, checkpoint_dir=str(OUT / "failed"), collective_timeout=30.0)
    for step in range(NO_END):
        x, y = batch(step)
        stepper(lambda e, x=x, y=y: e.backward(torch.nn.functional.mse_loss(e(x), y)), step=step)
        record(eng.module, eng.optimizer, eng.global_steps)
        time.sleep(STEP_SLEEP_S)


def accelerate_loop(phase: str) -> None:
    """An Accelerate loop under recovering_step; resumed with accelerator.load_state."""
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    acc = Accelerator(cpu=True)
    module = tiny()
    model, opt = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    if phase == "resume":
        marker = json.loads((Path(os.environ["NCCLGUARD_PREEMPT_DIR"]) / "PREEMPTED.json").read_text())
        acc.load_state(marker["path"])
        compare(module, opt, marker["step"])
        return
    stepper = recovering_step(acc, model, opt, collective_timeout=30.0)
    for step in range(NO_END):
        x, y = batch(step)
        stepper(lambda m, x=x, y=y: acc.backward(torch.nn.functional.mse_loss(m(x), y)), step=step).raise_for_error()
        record(module, opt, step)
        time.sleep(STEP_SLEEP_S)


DEEPSPEED = {  # the Trainer's usual ZeRO-3 config, its values filled from TrainingArguments
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def trainer(phase: str) -> Any:
    os.environ.setdefault("NCCLGUARD_TEST_OUT", str(OUT))  # hf_worker reads it at import
    from hf_parts import Dataset, tiny_bert  # the HF tests' tiny dataset and model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ncclguard.integrations.hf import guard_trainer

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.compared = False

        def on_step_end(self, args, state, control, **kw):
            if phase == "train":
                record(self.model(), self.trainer.optimizer, state.global_step)
                time.sleep(STEP_SLEEP_S)

        def on_step_begin(self, args, state, control, **kw):
            if phase == "resume" and not self.compared:  # the checkpoint is loaded; no step ran yet
                self.compared = True
                compare(self.model(), self.trainer.optimizer, state.global_step)

        def model(self) -> Any:
            return self.trainer.model_wrapped if STACK == "hf-deepspeed" else self.trainer.model

    args = TrainingArguments(
        output_dir=str(OUT / f"hf-{phase}"),
        use_cpu=True,
        ddp_backend="gloo",
        learning_rate=1e-3,
        max_steps=NO_END,
        per_device_train_batch_size=4,
        logging_steps=1000,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=DEEPSPEED if STACK == "hf-deepspeed" else None,
    )
    torch.manual_seed(0)
    probe = Record()
    t = Trainer(model=tiny_bert(), args=args, train_dataset=Dataset(NO_END * 8, seed=1), callbacks=[probe])
    probe.trainer = t
    if phase == "train":
        guard_trainer(t, recover=True, collective_timeout=30.0, watchdog=False)
    return t


class Samples(torch.utils.data.Dataset):
    """Sample ``i``, the same in every launch (an epoch longer than the job)."""

    def __len__(self) -> int:
        return NO_END * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=gen), torch.randn(4, generator=gen)


def lightning(phase: str) -> None:
    """A Lightning Trainer (DDP) under NcclGuardCallback(recover=True); resumed with
    ``trainer.fit(model, ckpt_path=...)``, plain Lightning, its state compared before any step."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from ncclguard.integrations.lightning import NcclGuardCallback

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(Samples(), batch_size=4)

    class Probe(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if phase == "train":  # the step is applied: the state a stop after it must write
                record(pl_module, trainer.optimizers[0], trainer.global_step)
                time.sleep(STEP_SLEEP_S)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if phase == "resume":  # the checkpoint is loaded; no step ran yet
                compare(pl_module, trainer.optimizers[0], trainer.global_step)

    callbacks: list[Any] = [Probe()]
    marker: dict[str, Any] = {}
    if phase == "train":
        callbacks.append(NcclGuardCallback(recover=True, collective_timeout=30.0, watchdog=False))
    else:
        marker = json.loads((Path(os.environ["NCCLGUARD_PREEMPT_DIR"]) / "PREEMPTED.json").read_text())
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=NO_END if phase == "train" else marker["step"] + 3,  # resume: two steps past the checkpoint's
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(OUT / f"lightning-{phase}"),
    )
    torch.manual_seed(0)
    trainer.fit(Net(), ckpt_path=marker.get("path"))


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if STACK == "accelerate":
        accelerate_loop(PHASE)
    elif STACK == "lightning":
        lightning(PHASE)
    elif STACK in ("hf", "hf-deepspeed"):
        t = trainer(PHASE)
        if PHASE == "train":
            t.train()
        else:
            marker = json.loads((Path(os.environ["NCCLGUARD_PREEMPT_DIR"]) / "PREEMPTED.json").read_text())
            t.args.max_steps = marker["step"] + 3  # a step past the checkpoint's: its on_step_begin compares
            t.train(resume_from_checkpoint=marker["path"])
    else:
        dist.init_process_group("gloo")
        if STACK == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            deepspeed_loop(PHASE)
        elif PHASE == "train":
            loop()
        else:
            resume_loop()
    if PHASE != "train":
        # The resume is the framework's own code (ncclguard is not on). Its teardown aborted now and
        # then: the Trainer on DeepSpeed resumed and trained, then one rank died of SIGABRT ("terminate
        # called without an active exception"), rank 0 once, rank 1 once since its group was destroyed
        # as torch's docs ask. What this launch checks is on disk once every rank is here: it leaves
        # without the interpreter's finalization, which is not what it tests.
        if dist.is_initialized():
            dist.barrier()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # As torch's docs ask ("Shutdown"): a gloo group left to the interpreter's finalization can abort
    # the process (pytorch/pytorch#190489).
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
