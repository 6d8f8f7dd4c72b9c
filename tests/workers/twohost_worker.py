"""Rank side of tests/env/test_netns_hostloss.py: plain DDP training on gloo, no ncclguard in it (the job
runs under ``ncclguard run``). Usage: twohost_worker.py STEPS.

Once it has trained 3 steps and for 4 s each rank touches ``$NCCLGUARD_TEST_OUT/step3.rank<r>``, so that
the test strikes a host while the job trains, never while it starts, and after each rank's watchdog has
read its peer's heartbeats (1 s apart in the test): the names it gives a lost host come from them. A
strike after 3 quick steps alone came before the first read on a loaded machine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = Path(os.environ["NCCLGUARD_TEST_OUT"])
    start, told = time.monotonic(), False
    for step in range(steps):
        model(torch.randn(16, 32)).pow(2).mean().backward()  # DDP's gradient all_reduce
        opt.step()
        opt.zero_grad()
        if step >= 3 and not told and time.monotonic() - start >= 4.0:
            (out / f"step3.rank{rank}").touch()
            told = True
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
