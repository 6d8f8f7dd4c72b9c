"""A plain DDP training script that hangs the way real jobs do, with no ncclguard in it.

Every rank trains a small model with DDP on gloo (CPU). After step ``--eval-after``, rank
``--slow-rank`` runs a long evaluation (``--eval-s`` seconds: a bigger shard, a slow metric) while
the other ranks go on into the next step and wait in DDP's gradient all_reduce: the silent hang of
an uneven evaluation. Without ncclguard nothing is said until the group's timeout (30 minutes on
gloo, 10 on NCCL); under ``ncclguard run`` the watchdog names the rank and the function it is in::

    ncclguard run --nproc-per-node 2 --ncclguard-hang-timeout-s 10 docs/examples/ddp_hang.py

The evaluation ends by itself, training finishes and the job exits 0.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def evaluate(model: torch.nn.Module, seconds: float) -> float:
    """A slow evaluation on one rank: the others wait for it in their next all_reduce."""
    model.eval()
    with torch.no_grad():
        loss = model(torch.randn(64, 32)).pow(2).mean().item()
    time.sleep(seconds)  # stands for the rank's bigger share of the evaluation set
    model.train()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-after", type=int, default=5, help="the step after which one rank evaluates")
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--eval-s", type=float, default=25.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()  # DDP's gradient all_reduce: where the other ranks wait
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
        if step == args.eval_after and rank == args.slow_rank:
            evaluate(model, args.eval_s)
    if rank == 0:
        print(f"trained {args.steps} steps on {dist.get_world_size()} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
