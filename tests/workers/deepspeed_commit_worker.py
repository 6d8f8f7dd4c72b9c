"""Rank side of tests/integrations/test_deepspeed_commit_multirank.py: CommittedEngineStep on a real DeepSpeed
engine (ZeRO-2; ``memory`` also ZeRO-3), 2 gloo ranks on CPU (ncclguard's launcher; ``memory`` under torchrun),
a step's collectives bounded at 3 s by the stepper's ``collective_timeout`` (DeepSpeed's groups keep
their own timeouts).

Usage: ``deepspeed_commit_worker.py fail|resume|memory|memory-kill CKPT_DIR [STAGES]``.

- ``fail``: steps 0-1 commit and apply; at step 2 rank 1 stalls 9 s (3x the timeout) before its
  forward, so rank 0 times out in ZeRO's gradient reduction. The commit fails on both ranks;
  both save a checkpoint in CKPT_DIR and exit 75 (the results are written before step 2).
- ``resume``: what a restart does: a new engine loads CKPT_DIR and trains steps 2-4; then a
  second engine trains steps 0-4 without a fault, for comparison bit for bit.
- ``memory``: per ZeRO stage in STAGES (e.g. ``2,3``), the stepper has ``rebuild_engine``: the same
  stall at step 2 is recovered in process (a new engine from another seed, given the old one's
  state) and steps 0-4 end bit-equal to an engine that trained them without a fault; nothing is
  written to CKPT_DIR.
- ``memory-kill``: ZeRO-2 with ``rebuild_engine``, rank 1 killed (SIGKILL) at step 2: no world can be
  rebuilt without it, so rank 0 exits 75 without a checkpoint (its partition alone is no checkpoint).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path

import deepspeed
import rankkit
import torch
from rankkit import put

import ncclguard
from ncclguard.integrations.deepspeed import CommittedEngineStep
from ncclguard.recovery.rebuild import generation

BOUND_STEP_S = 3.0  # ZeRO reduces on DeepSpeed's clone of the world group: the bound covers it
STALL_S = 9.0
STEPS, K = 5, 2


def engine(
    stage: int = 2, seed: int = 0, dropout: float = 0.0, width: int = 16, depth: int = 0
) -> deepspeed.DeepSpeedEngine:
    """The workers' engine: ``Linear(6, width)``, ``depth`` more square layers, ``Linear(width, 1)``."""
    torch.manual_seed(seed)
    # Dropout (memory mode): the redo must draw what the failed attempt drew, whatever the new engine's
    # initialisation drew meanwhile
    drop = [torch.nn.Dropout(dropout)] if dropout else []
    square = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    model = torch.nn.Sequential(torch.nn.Linear(6, width), *drop, torch.nn.Tanh(), *square, torch.nn.Linear(width, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1_000_000,
    }
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 6, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def digest(eng: deepspeed.DeepSpeedEngine) -> str:
    h = hashlib.sha256()
    for name, p in eng.module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def gathered_digest(eng: deepspeed.DeepSpeedEngine) -> str:
    """The digest of the full parameters (ZeRO-3: gathered; the persistent ones are whole already)."""
    partitioned = [p for p in eng.module.parameters() if getattr(p, "ds_status", None) is not None]
    with deepspeed.zero.GatheredParameters([p for p in partitioned if p.ds_status.name != "AVAILABLE"]):
        return digest(eng)


def step_fn(step: int, rank: int, stall: bool | list[bool] = False):
    def run(eng: deepspeed.DeepSpeedEngine) -> float:
        if stall is True or (isinstance(stall, list) and stall and stall.pop()):  # a list: the first attempt only
            rankkit.fault_fired(f"stall {STALL_S} s at step {step}")
            time.sleep(STALL_S)
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        return float(loss.detach())

    return run


def fail(ckpt: str, rank: int) -> None:
    eng = engine()
    try:  # the DDP adapter given a DeepSpeed engine: refused before any step, with the adapter to use
        ncclguard.RecoveringStep(eng, eng.optimizer)
    except ValueError as exc:
        put("ddp_adapter_refused", str(exc))
    stepper = CommittedEngineStep(
        eng, checkpoint_dir=ckpt, collective_timeout=BOUND_STEP_S, commit_timeout=30, rebuild_timeout=30
    )
    losses = [stepper(step_fn(s, rank), step=s).output for s in range(K)]
    put("losses", losses)
    put("digest_before_failed_step", digest(eng))
    put("global_steps_before_failed_step", eng.global_steps)
    rankkit.save()  # the step below ends the process with status 75 (os._exit)
    stepper(step_fn(K, rank, stall=rank == 1), step=K)
    put("not_exited", True)  # never reached: the test would see it
    rankkit.done()


def resume(ckpt: str, rank: int) -> None:
    eng = engine()
    path, _ = eng.load_checkpoint(ckpt)
    put("loaded", path is not None)
    put("digest_loaded", digest(eng))
    put("global_steps_loaded", eng.global_steps)
    stepper = CommittedEngineStep(eng, checkpoint_dir=ckpt, collective_timeout=BOUND_STEP_S, commit_timeout=30)
    applied = [bool(stepper(step_fn(s, rank), step=s)) for s in range(eng.global_steps, STEPS)]
    # A fault-free run: every step applied at its first commit, no rebuild.
    put("resumed_run", [applied, len(stepper.recovery.recoveries), generation()])
    put("digest_resumed", digest(eng))
    put("global_steps_resumed", eng.global_steps)
    reference = engine()
    for s in range(STEPS):
        loss = torch.nn.functional.mse_loss(reference(batch(s, rank)[0]), batch(s, rank)[1])
        reference.backward(loss)
        reference.step()
    put("digest_reference", digest(reference))
    rankkit.done()


def memory(ckpt: str, rank: int, stages: str) -> None:
    for stage in map(int, stages.split(",")):
        first = engine(stage, dropout=0.25)
        built: list[deepspeed.DeepSpeedEngine] = []

        def rebuild(stage: int = stage, built: list = built) -> deepspeed.DeepSpeedEngine:
            built.append(engine(stage, seed=123, dropout=0.25))  # another seed: all must come from the old engine
            return built[-1]

        stepper = CommittedEngineStep(
            first,
            checkpoint_dir=ckpt,
            rebuild_engine=rebuild,
            collective_timeout=BOUND_STEP_S,
            commit_timeout=30,
            rebuild_timeout=30,
        )
        # step= grows across the stages (should_commit checks it per world)
        stall = {s: [rank == 1 and s == K] for s in range(STEPS)}  # the first attempt of step K only
        losses = [stepper(step_fn(s, rank, stall=stall[s]), step=10 * stage + s).output for s in range(STEPS)]
        put(f"z{stage}.losses", losses)
        put(f"z{stage}.digest", gathered_digest(stepper.engine))
        put(f"z{stage}.global_steps", stepper.engine.global_steps)
        put(f"z{stage}.new_engine", stepper.engine is not first and built == [stepper.engine])
        put(f"z{stage}.recoveries", [{**r.metrics(), "timings": r.timings} for r in stepper.recovery.recoveries])
        reference = engine(stage, dropout=0.25)
        ref_losses = []
        for s in range(STEPS):
            ref_losses.append(step_fn(s, rank)(reference))
            reference.step()
        put(f"z{stage}.reference_losses", ref_losses)
        put(f"z{stage}.reference_digest", gathered_digest(reference))
    put("generation", generation())
    put("checkpoint_files", sorted(str(p) for p in Path(ckpt).rglob("*")))
    rankkit.done()


def memory_kill(ckpt: str, rank: int) -> None:
    stepper = CommittedEngineStep(
        engine(),
        checkpoint_dir=ckpt,
        rebuild_engine=engine,
        collective_timeout=BOUND_STEP_S,
        commit_timeout=5,
        rebuild_timeout=5,
    )
    for s in range(K):
        stepper(step_fn(s, rank), step=s)
    put("global_steps_before_failed_step", stepper.engine.global_steps)
    rankkit.save()  # rank 0 ends in the step below with status 75 (os._exit); rank 1 dies in it

    def killed(eng: deepspeed.DeepSpeedEngine) -> float:
        rankkit.kill(1)
        return step_fn(K, rank)(eng)

    stepper(killed, step=K)
    put("not_exited", True)  # never reached: the test would see it
    rankkit.done()


def main() -> None:
    mode, ckpt = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank = rankkit.init(timeout_s=60)  # the groups keep 60 s; a step's collectives get the 3 s bound
    deepspeed.init_distributed(dist_backend="gloo")
    if mode == "memory":
        memory(ckpt, rank, sys.argv[3])
    if mode == "memory-kill":
        memory_kill(ckpt, rank)
    {"fail": fail, "resume": resume}[mode](ckpt, rank)


if __name__ == "__main__":
    main()
