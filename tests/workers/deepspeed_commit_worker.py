"""Rank side of tests/test_deepspeed_commit_multirank.py: CommittedEngineStep on a real DeepSpeed
ZeRO-2 engine, 2 gloo ranks on CPU (ncclguard's launcher), a step's collectives bounded at 3 s by the
stepper's ``collective_timeout`` (DeepSpeed's groups keep their own timeouts).

Usage: ``deepspeed_commit_worker.py fail|resume CKPT_DIR``.

- ``fail``: steps 0-1 commit and apply; at step 2 rank 1 stalls 9 s (3x the timeout) before its
  forward, so rank 0 times out in ZeRO's gradient reduction. The commit fails on both ranks;
  both save a checkpoint in CKPT_DIR and exit 75 (the results are written before step 2).
- ``resume``: what a restart does: a new engine loads CKPT_DIR and trains steps 2-4; then a
  second engine trains steps 0-4 without a fault, for comparison bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time

import deepspeed
import rankkit
import torch
from rankkit import put

import ncclguard
from ncclguard.integrations.deepspeed import CommittedEngineStep

BOUND_STEP_S = 3.0  # ZeRO reduces on DeepSpeed's clone of the world group: the bound covers it
STALL_S = 9.0
STEPS, K = 5, 2


def engine() -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
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


def step_fn(step: int, rank: int, stall: bool = False):
    def run(eng: deepspeed.DeepSpeedEngine) -> float:
        if stall:
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
    for s in range(eng.global_steps, STEPS):
        stepper(step_fn(s, rank), step=s)
    put("digest_resumed", digest(eng))
    put("global_steps_resumed", eng.global_steps)
    reference = engine()
    for s in range(STEPS):
        loss = torch.nn.functional.mse_loss(reference(batch(s, rank)[0]), batch(s, rank)[1])
        reference.backward(loss)
        reference.step()
    put("digest_reference", digest(reference))
    rankkit.done()


def main() -> None:
    mode, ckpt = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank = rankkit.init(timeout_s=60)  # the groups keep 60 s; a step's collectives get the 3 s bound
    deepspeed.init_distributed(dist_backend="gloo")
    {"fail": fail, "resume": resume}[mode](ckpt, rank)


if __name__ == "__main__":
    main()
