"""Rank side of tests/watching/test_views_multirank.py: a job the test watches from outside.

Two ranks (torchrun), watchdog with metrics served on ``$VIEWS_PORT + LOCAL_RANK`` (127.0.0.1)
and written to ``$VIEWS_DIR/metrics-{rank}.prom``. The test drives the job through marker files
in ``$VIEWS_DIR``:

1. ``train``: both ranks all_reduce step after step (phase ``train``) until ``go-hang`` exists
   (the ranks agree on it through the all_reduce itself, so they leave the loop together);
2. ``hang``: rank 1 stays in phase ``eval`` without the collective until ``go-end`` exists, while
   rank 0 waits in an all_reduce (phase ``sync``): the watchdog raises a hang incident;
3. rank 1 joins the all_reduce; both ranks wait for the incident's ``timeline.png`` and exit.

Every wait is bounded (the test's own bound is the launch's).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import phase, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.incidents.pictures import PICTURE_FILE

DIR = Path(os.environ["VIEWS_DIR"])
BOUND_S = 90.0


def exists(name: str) -> bool:
    return (DIR / name).exists()


def main() -> None:
    r = rankkit.init(timeout_s=120)
    wd = start_watchdog(
        # Loose enough that a loaded 2-core machine raises nothing while training (1.5 s raised
        # spurious hangs and lost peers there), tight enough for the planned hang to come soon.
        heartbeat_s=0.5,
        hang_timeout_s=4.0,
        peer_timeout_s=15.0,
        incident_dir=DIR / "incidents",
        metrics_port=int(os.environ["VIEWS_PORT"]),
        metrics_addr="127.0.0.1",
        metrics_textfile=DIR / "metrics-{rank}.prom",
    )
    if r == 0:  # how the test, outside the job, finds its store: torchrun's address
        tmp = DIR / ".store.txt"
        tmp.write_text(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        tmp.replace(DIR / "store.txt")
    x = torch.ones(4)
    steps = 0
    deadline = time.monotonic() + BOUND_S
    with phase("train"):
        while time.monotonic() < deadline:
            flag = torch.tensor([1.0 if exists("go-hang") else 0.0])
            dist.all_reduce(flag)
            dist.all_reduce(x)
            steps += 1
            if flag.item() > 0:
                break
            time.sleep(0.05)
    put("steps", steps)
    if r == 1:
        rankkit.fault_fired("a hang: stays in eval while rank 0 waits in an all_reduce")
        with phase("eval"):
            rankkit.when(lambda: exists("go-end"), BOUND_S).wait(BOUND_S)
    with phase("sync"):
        dist.all_reduce(x)
    incidents = wd.wait_for_incident(BOUND_S, merged=True)
    put("incidents", [{"id": i["id"], "kind": i["kind"], "dir": i["dir"]} for i in incidents])
    where = Path(incidents[0]["dir"])
    rankkit.when(lambda: (where / INCIDENT_FILE).is_file() and (where / PICTURE_FILE).is_file(), 30).wait(30)
    put("picture", (where / PICTURE_FILE).is_file())
    dist.barrier()
    wd.stop()
    rankkit.done()


if __name__ == "__main__":
    main()
