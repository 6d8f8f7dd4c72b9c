"""Rank side of tests/watching/test_watching_stuck_multirank.py: a DDP all_reduce stuck in the transport.

2 ranks in two network namespaces. The store and the watchdog's heartbeats go over one veth pair
(``MASTER_ADDR``), gloo's data over another (``GLOO_SOCKET_IFNAME``). After two DDP steps (the
second rebuilds DDP's buckets), rank 0 takes the data link down and both ranks go into the third
step: DDP's reducer issues the bucket all_reduce from C++, and neither rank can finish it. Once the
watchdog's report is merged, rank 0 brings the link back up; TCP retransmits and the all_reduce
completes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import _torch_compat as compat
from ncclguard import phase, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
INCIDENTS = OUT / "incidents"
DATA_IF = os.environ["GLOO_SOCKET_IFNAME"]  # this rank's end of the data link
HEARTBEAT_S = 0.3
HANG_S = 1.5


def link(state: str) -> None:
    subprocess.run(["ip", "link", "set", DATA_IF, state], check=True, timeout=10)


def restore_once_reported(bound_s: float = 20.0) -> None:
    """Rank 0: brings the data link back up once an incident is merged (at most ``bound_s``)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end and not list(INCIDENTS.glob(f"*/{INCIDENT_FILE}")):
        time.sleep(0.02)
    put("restored_at", time.time())
    link("up")


def main() -> None:
    r = rankkit.init(timeout_s=30)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    x = torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64
    for _ in range(2):  # the second step rebuilds the buckets (a broadcast from rank 0)
        ddp(x).sum().backward()
    wd = start_watchdog(heartbeat_s=HEARTBEAT_S, hang_timeout_s=HANG_S, incident_dir=INCIDENTS, action="report")
    ddp.zero_grad()
    store = compat.default_store()  # over the other link: it stays up
    if r == 0:
        link("down")
        store.set("stuck/data-down", "1")
        threading.Thread(target=restore_once_reported, daemon=True).start()
    else:
        store.wait(["stuck/data-down"])
    seq = compat.sequence_number(compat.default_group())
    put("start", time.time())
    with phase("train", step=3):
        ddp(x).sum().backward()  # MARK: stuck
    put("done", time.time())
    put("seq", [seq, compat.sequence_number(compat.default_group())])
    ref = copy.deepcopy(ddp.module)  # the same model and input on both ranks: the average is the local gradient
    ref.zero_grad()
    ref(x).sum().backward()
    put("grad_exact", bool(torch.equal(ddp.module.weight.grad, ref.weight.grad)))
    put("incidents", wd.wait_for_incident(10, merged=r == 0))
    dist.barrier()
    put("fr", json.loads(compat.dump_flight_recorder())["pg_status"])
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
