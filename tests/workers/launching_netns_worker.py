"""Rank side of tests/env/test_netns_no_harm.py: one gloo all_reduce across two network-namespace hosts,
launched by ``ncclguard run --nnodes 2`` (no ncclguard in it). Usage: launching_netns_worker.py.

Each rank writes ``$NCCLGUARD_TEST_OUT/rank<r>.json``: the sum it got, the socket variables it ran
with, and the local and remote addresses of its established TCP connections (gloo's pairs among them).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a plan that cannot work fails, not hangs
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    links = [
        [c.laddr.ip, c.raddr.ip]
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr
    ]
    dist.barrier()  # every rank has read its links before any closes them
    out = Path(os.environ["NCCLGUARD_TEST_OUT"])
    record = {
        "sum": t.item(),
        "expected": world * (world + 1) / 2,
        "env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")},
        "links": links,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
