"""What numerics_worker.py and replicas_worker.py read of their findings' incidents: the watchdog every
rank starts (its incidents under ``$NCCLGUARD_TEST_OUT/incidents``), the wait until each incident is
merged, and, on rank 0 while the job's store lives, ``ncclguard status`` (its JSON and its screen at
200 columns). The report and the pictures are read by the test from the incident directories after
the launch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from ncclguard import start_watchdog
from ncclguard.cli import main
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.watching.watchdog import Watchdog

BOUND_S = 60.0  # a hang guard on each wait: an incident is merged within a few ticks


def watch() -> Watchdog:
    """The watchdog of this rank: ticks ten times a second, so that a finding is raised at once; its
    bounds loose enough that a loaded 2-core machine raises nothing of its own and warns of nothing
    while training (no straggler windows: these runs are not about speed); the merger waits for the
    three statements (a loaded machine may take over a second to give one)."""
    return start_watchdog(
        heartbeat_s=0.5,
        hang_timeout_s=120.0,
        peer_timeout_s=30.0,
        store_timeout_s=10.0,
        merge_wait_s=30.0,
        straggler=False,
        incident_dir=Path(os.environ["NCCLGUARD_TEST_OUT"]) / "incidents",
        incident_plot=False,
    )


def merged(wd: Watchdog, count: int) -> list[dict[str, Any]]:
    """Waits until this rank has handled ``count`` incidents and each is merged on this host; returns
    them (id, kind, reason, directory), oldest first."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        seen = wd.incidents
        if len(seen) >= count and all((Path(i["dir"]) / INCIDENT_FILE).is_file() for i in seen):
            break
        time.sleep(0.05)
    return [{"id": i["id"], "kind": i["kind"], "reason": i["doc"]["reason"], "dir": i["dir"]} for i in wd.incidents]


def status() -> dict[str, Any]:
    """``ncclguard status`` of the job's store (torchrun's), as JSON and as its screen at 200 columns."""
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["status", "--store", addr, "--json", "--timeout", "10"])
    said = json.loads(out.getvalue())
    os.environ["COLUMNS"] = "200"
    screen = io.StringIO()
    with contextlib.redirect_stdout(screen):
        main(["status", "--store", addr, "--timeout", "10"])
    return {
        "code": code,
        "health": said["health"],
        "reasons": said["reasons"],
        "incident_count": said["incident_count"],
        "incidents": [{k: i[k] for k in ("n", "kind", "reason", "open", "suspects")} for i in said["incidents"]],
        "screen": screen.getvalue(),
    }
