"""Train the tiny Qwen2.5-VL classifier with DeepSpeed on CPU, evaluating under ncclguard's guard.

Run (2 ranks, gloo, CPU; no GPU and no download needed):

    torchrun --nproc_per_node 2 docs/examples/deepspeed_guarded_eval.py
    torchrun --nproc_per_node 2 docs/examples/deepspeed_guarded_eval.py --stall-rank 1
    torchrun --nproc_per_node 2 docs/examples/deepspeed_guarded_eval.py --stall-rank 1 --retries 1

``--stall-rank 1`` makes rank 1's first evaluation sleep ``--stall-seconds`` (30) inside its
evaluation loop while the other rank waits in the evaluation's ``dist.all_reduce``. With the
guard, both ranks skip that evaluation at the ``--timeout`` deadline, the monitor records
``eval/evaluation_failed`` and training goes on. With ``--retries 1`` the guard halves the
evaluation batch and tries again; the stall only happens at the full batch size, so the
second attempt succeeds. ``--no-guard`` shows the same run without ncclguard: rank 0 sits in
the all_reduce until rank 1 comes back (on a real job, until the NCCL watchdog kills it).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

# The synthetic Qwen2.5-VL data and the reference trainer are test fixtures (tests/workers).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tests" / "workers"))

from qwen2_5_vl_synthetic import synthetic_batch, tiny_config
from reference_trainer import ReferenceTrainer, ds_config

from ncclguard.integrations.deepspeed import patch_trainer
from ncclguard.integrations.models.qwen2_5_vl import Qwen2_5_VLForClassification


class PrintMonitor:
    """Stands in for wandb: prints what it is told on rank 0."""

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if dist.get_rank() == 0:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}
            print(f"  monitor @ step {step}: {shown}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="training steps")
    p.add_argument("--eval-every", type=int, default=4, help="evaluate after every N steps")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2), help="ZeRO stage")
    p.add_argument("--timeout", type=float, default=3.0, help="evaluation deadline, seconds")
    p.add_argument("--retries", type=int, default=0, help="further attempts after a failed evaluation")
    p.add_argument("--eval-batch-size", type=int, default=4)
    p.add_argument("--stall-rank", type=int, default=None, help="this rank's first evaluation stalls")
    p.add_argument("--stall-seconds", type=float, default=30.0)
    p.add_argument("--no-guard", action="store_true", help="run the trainer's evaluate() unguarded")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = tiny_config()
    evaluations = {"n": 0}

    def on_eval_batch(i: int) -> None:
        # A slow first evaluation on one rank, at the full batch size only (a shrink cures it).
        if (
            rank == args.stall_rank
            and evaluations["n"] == 1
            and i == 0
            and trainer.eval_batch_size == args.eval_batch_size
        ):
            print(f"[rank {rank}] stalling {args.stall_seconds:g} s in the evaluation loop", flush=True)
            time.sleep(args.stall_seconds)

    eval_data = synthetic_batch(cfg, 8, seed=500 + rank)
    trainer = ReferenceTrainer(
        Qwen2_5_VLForClassification(cfg),
        ds_config(args.stage, micro_batch=4),
        eval_data,
        eval_batch_size=args.eval_batch_size,
        monitor=PrintMonitor(),
        on_eval_batch=on_eval_batch,
    )
    if not args.no_guard:

        def halve() -> None:
            trainer.eval_batch_size = max(1, trainer.eval_batch_size // 2)

        patch_trainer(trainer, eval_timeout_s=args.timeout, retries=args.retries, shrink=halve)

    for step in range(1, args.steps + 1):
        loss = trainer.train_step(synthetic_batch(cfg, 4, seed=1000 * step + rank))
        if rank == 0:
            print(f"step {step}: train loss {loss:.4f}", flush=True)
        if step % args.eval_every == 0:
            evaluations["n"] += 1
            start = time.monotonic()
            eval_loss, accuracy = trainer.evaluate(step=step)
            report = getattr(trainer, "last_eval_report", None)
            took = time.monotonic() - start
            if rank != 0:
                pass
            elif report is not None and not report.ok:
                print(
                    f"step {step}: evaluation skipped on every rank after {took:.1f} s "
                    f"(returned the fallback {eval_loss, accuracy}); training goes on",
                    flush=True,
                )
            else:
                tries = f" (attempt {report.attempts})" if report is not None and report.attempts > 1 else ""
                print(
                    f"step {step}: eval loss {eval_loss:.4f}, accuracy {accuracy:.3f}{tries}, {took:.1f} s", flush=True
                )
            trainer.eval_batch_size = args.eval_batch_size

    # Same parameters everywhere? Compare digests as numbers over the training group.
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainer.model.module.parameters()))
    mine = torch.tensor([int(digest.hexdigest()[:12], 16)], dtype=torch.float64)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"done: {args.steps} steps, parameters identical across ranks: {bool(lo == hi)}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
