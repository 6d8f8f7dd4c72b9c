"""A plain DDP training script with no ncclguard in it: one rank spends long in an evaluation.

Run under ``ncclguard run`` or ``NCCLGUARD_AUTO=1 torchrun``: the watchdog must name the rank in
``evaluate`` without a line here changed. ``--mesh`` makes the group with ``init_device_mesh``
instead of ``init_process_group``. Exits with ``--exit-code`` on every rank; prints
``RESULT {json}`` with what the test checks from inside the rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def evaluate(model: torch.nn.Module, seconds: float) -> None:
    """Stands for an evaluation that runs long on one rank (a bigger shard, a slow metric)."""
    time.sleep(seconds)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--eval-s", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--mesh", action="store_true")
    args = ap.parse_args()
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()  # DDP's bucket all_reduce, issued from C++
        opt.step()
        opt.zero_grad()
        if step == 1 and rank == args.slow_rank:
            evaluate(model, args.eval_s)  # the others wait in step 2's all_reduce meanwhile
    watchdogs = [t.name for t in threading.enumerate() if t.name == "ncclguard-watchdog"]
    # One write with its newline: the ranks share torchrun's output (print writes the line and its end apart).
    sys.stdout.write("RESULT " + json.dumps({"rank": rank, "watchdog_threads": len(watchdogs)}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
