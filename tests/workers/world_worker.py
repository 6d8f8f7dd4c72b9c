"""Rank side of tests/base/test_world_multirank.py: the watchdog follows the world across rebuilds.
Usage: world_worker.py SCENARIO.

Scenarios (each one launch, the ncclguard launcher, so a rank that leaves never tears the others down):
    same_size  3 ranks: every rank rebuilds (generation 1, same numbers); then rank 2 evaluates
               while ranks 0-1 wait in an instrumented all_reduce: a hang incident of generation 1
               names rank 2 as the culprit, ranks 0-1 as its victims.
    shrink     4 ranks: rank 1 is alive but comes to the rebuild after the others went on
               without it (it is left out); the new world is old ranks 0, 2, 3 renumbered 0, 1, 2.
               Then new rank 1 (old rank 2) evaluates while new ranks 0 and 2 wait in an
               all_reduce that Python does not record (instrument=False): the backend's numbers
               show the desync, reported in the new numbering, the left-out rank in none of its lists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import phase, rebuild_world, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.world import current_world

# A rebuild renumbers ranks: the result files go by the rank the launcher gave.
rankkit.rank = lambda: int(os.environ["RANK"])

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
INCIDENTS = OUT / "incidents"
GROUP_TIMEOUT_S = 30.0
WAIT_BOUND_S = 30.0  # hang guard for the evaluating rank: the report comes in ~4 s


def merged() -> list[Path]:
    return sorted(INCIDENTS.glob(f"*/{INCIDENT_FILE}")) if INCIDENTS.is_dir() else []


def evaluate_until_reported() -> None:
    """This rank "evaluates" until a report of the hang it causes has been merged."""
    deadline = time.monotonic() + WAIT_BOUND_S
    with phase("eval", batch=3):
        while not merged() and time.monotonic() < deadline:
            time.sleep(0.05)


def report_fields() -> dict[str, Any]:
    """What the merged report says, read from incident.json (same host for every rank)."""
    files = merged()
    if not files:
        return {"merged": False}
    doc = json.loads(files[0].read_text())
    summary = (files[0].parent / "summary.txt").read_text()
    return {
        "merged": True,
        "count": len(files),
        "kind": doc["incident"]["kind"],
        "generation": doc["incident"]["generation"],
        "rank_map": doc["incident"]["rank_map"],
        "left_out": doc["incident"]["left_out"],
        "id": doc["incident"]["id"],
        "culprits": sorted(c["rank"] for c in doc["culprits"]),
        "culprit_phases": [c.get("phase") for c in doc["culprits"]],
        "victims": doc["victims"],
        "world_size": doc["world_size"],
        "statements_from": doc["statements_from"],
        "missing_statements": doc["missing_statements"],
        "summary_head": summary.splitlines()[:3],
        "summary": summary,
    }


def watchdog(instrument: bool) -> Any:
    return start_watchdog(
        heartbeat_s=0.3,
        # Far above the ms between the victims' meeting below and their all_reduce, so that a victim
        # starved there is still in the op when the hang is judged (it was 1.5 s, with no meeting).
        hang_timeout_s=3.0,
        peer_timeout_s=60.0,  # no rank is lost here: a left-out rank leaving must not read as one
        incident_dir=INCIDENTS,
        action="report",
        instrument=instrument,
    )


def hang_in_the_new_world(wd: Any, culprit: int) -> None:
    """In the rebuilt world: every rank all-reduces once (its watchdog beats there meanwhile), then
    ``culprit`` evaluates until the report is merged while the others wait in an all_reduce."""
    dist.all_reduce(torch.ones(1))
    time.sleep(1.0)
    put("watchdog_follows", {"generation": wd.generation, "rank": wd.rank, "world_size": wd.world_size})
    me = dist.get_rank()
    if me == culprit:
        evaluate_until_reported()
    else:
        # The victims meet (through the store, which the watchdog does not judge) and enter the
        # all_reduce together: on a loaded fresh clone, one that came over 1.5 s after the other was
        # named a culprit beside the real one (behind: it had not reached the op yet).
        rankkit.announce(f"victim-{me}")
        for other in range(dist.get_world_size()):
            if other != culprit:
                rankkit.wait_for(f"victim-{other}", timeout_s=WAIT_BOUND_S)
    x = torch.ones(4)
    dist.all_reduce(x)
    put("sum", x.tolist())
    incidents = wd.wait_for_incident(WAIT_BOUND_S, merged=True)
    put("incidents", [{"kind": i["kind"], "generation": i["doc"]["generation"]} for i in incidents])
    put("report", report_fields())
    dist.barrier()


def same_size() -> None:
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    wd = watchdog(instrument=True)
    dist.all_reduce(torch.ones(1))
    rankkit.fault_fired("a rebuild the scenario asks for")  # not a fault, but no fault-free run either
    res = rebuild_world(timeout=20)
    world = current_world()
    put("rebuild", {"ok": res.ok, "generation": res.generation, "rank": res.rank, "size": res.world_size})
    put("world", {"generation": world.generation, "rank": world.rank, "size": world.size})
    hang_in_the_new_world(wd, culprit=2)  # ranks 0-1 wait for rank 2
    wd.stop()
    rankkit.done()


def shrink() -> None:
    r = rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    wd = watchdog(instrument=False)
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(1))
    if r == 1:
        # Alive, but busy past the others' meeting: they go on without it.
        rankkit.fault_fired("late to the rebuild")
        time.sleep(5.0)
        res = rebuild_world(timeout=10, allow_shrink=True)
        put("rebuild", {"ok": res.ok, "late": res.late, "generation": res.generation})
        put("watchdog_follows", {"generation": wd.generation, "rank": wd.rank, "world_size": wd.world_size})
        wd.stop()
        store.set("test/left_out_done", "1")
        rankkit.done()
    res = rebuild_world(timeout=2, allow_shrink=True)
    world = current_world()
    put(
        "rebuild",
        {
            "ok": res.ok,
            "generation": res.generation,
            "rank": res.rank,
            "size": res.world_size,
            "rank_map": {str(k): v for k, v in res.rank_map.items()},
            "missing": res.missing_ranks,
        },
    )
    put(
        "world",
        {"generation": world.generation, "rank": world.rank, "size": world.size, "left_out": list(world.left_out)},
    )
    new_rank = dist.get_rank()
    hang_in_the_new_world(wd, culprit=1)  # new ranks 0 and 2 wait for new rank 1 (old rank 2)
    wd.stop()
    if new_rank == 0:  # rank 0's process serves the job's store: stay until the left-out rank read its verdict
        from datetime import timedelta

        store.wait(["test/left_out_done"], timedelta(seconds=WAIT_BOUND_S))
    rankkit.done()


if __name__ == "__main__":
    {"same_size": same_size, "shrink": shrink}[sys.argv[1]]()
