"""The 1,024-rank `python -m ncclguard status` screen of docs/status.md.

Fills a TCPStore made here with what 1,024 ranks' watchdogs would publish (rank 512 slow, ranks
640-641 still checkpointing, rank 999 silent), then runs the command against it as a user would.

Usage: python docs/examples/status_1024.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ncclguard.incidents.model import Heartbeat
from ncclguard.store.keys import index_key
from ncclguard.watching.base.index import WatchIndex


def main() -> int:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    world = 1024
    index = WatchIndex(
        run_id="llm-7b",
        restart="0",
        session="main",
        generation=0,
        world_size=world,
        heartbeat_s=5,
        peer_timeout_s=30,
        hang_timeout_s=300,
        written=time.time(),
    )
    server.set(index_key("main"), index.model_dump_json())
    now = time.time()
    for r in range(world):
        if r == 999:
            continue  # silent
        fields = {
            "phase": "train",
            "step": 1200,
            "last_seq": {"0": 4810, "3": 1204},
            "backend_seq": {"0": 9620, "3": 2408},
            "straggler_score": 0.74 if r == 512 else 0.97,
        }
        if r in (640, 641):
            fields.update(
                phase="checkpoint", step=1199, last_seq={"0": 4809, "3": 1204}, backend_seq={"0": 9618, "3": 2408}
            )
        hb = Heartbeat(
            rank=r,
            host=f"node{r // 8:03d}",
            pid=4000 + r % 8,
            beat=240,
            time=now - (r % 5) * 0.4,
            site="train.py:88",
            last_completed=fields["last_seq"],
            inflight=[],
            **fields,
        )
        server.set(index.keys.heartbeat(r), hb.model_dump_json())
    cmd = [sys.executable, "-m", "ncclguard", "status", "--store", f"127.0.0.1:{server.port}"]
    print("$ python -m ncclguard status --store", cmd[-1])
    width = os.environ.get("COLUMNS", "80")  # the screen the command lays itself out for
    done = subprocess.run(cmd, env={**os.environ, "COLUMNS": width}, capture_output=True, text=True, check=False)
    print(done.stdout + f"(exit status {done.returncode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
