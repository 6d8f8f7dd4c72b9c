"""Process side of tests/watching/test_job_end.py: a job whose ranks end at different times, each
the way a user's script ends, under a watchdog whose ladder goes past ``report``. Usage:
job_end_worker.py {on,off}.

Three gloo ranks under ``ncclguard.testing.launch`` (rank 0's process hosts the store, as under any
plain launcher), a watchdog each whose ladder is report, then exit with 75. Five steps
of all_reduce, then:

1. rank 2 is done: it ends its script (``dist.destroy_process_group()``, then the interpreter's exit);
2. ranks 0 and 1 go on for 6 s (1.5x ``peer_timeout_s``: a checkpoint each saves), then
   rank 0 is done and ends the way nanoGPT's train.py does (``destroy_process_group`` imported
   from ``torch.distributed`` before ncclguard, called by that name), and with it the store;
3. rank 1 goes on alone for 3 s more (an upload of its shard), then ends.

``on`` is the library. ``off`` takes away what a watchdog says when it stops on purpose
(``ending.leave`` and ``ending.announce_closing`` do nothing), so that the test sees the harm it prevents: rank 2's silence is a
lost peer and the store's end an incident, and the exit rung ends the ranks still at work with 75.
Each rank saves ``incidents`` (the kinds its watchdog handled), ``destroy_s`` (how long its
``destroy_process_group()`` took: the store's host waits there for every rank to know) and ``closing``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group  # bound before ncclguard, as nanoGPT's train.py does

import ncclguard
from ncclguard.watching import ending

HEARTBEAT_S = 0.5
PEER_S = 4.0  # above a loaded machine's starved heartbeats (tests/workers/diagnosis_worker.py)
STORE_S = 2.0  # store_timeout_s: the store's host waits 2 heartbeats + this + 2 ticks at most
SAVE_S = 1.5 * PEER_S
UPLOAD_S = 3.0


def finish(wd: ncclguard.Watchdog) -> None:
    """The end of a user's script: the results, then destroy_process_group(), then the exit. Rank 0,
    the store's host, calls the name bound at import (nanoGPT's train.py), the others
    ``dist.destroy_process_group()``: both reach torch's one function."""
    rankkit.put("incidents", [i["kind"] for i in wd.incidents])
    t0 = time.monotonic()
    (destroy_process_group if dist.get_rank() == 0 else dist.destroy_process_group)()
    rankkit.put("destroy_s", time.monotonic() - t0)
    rankkit.put("running", ncclguard.current_watchdog() is not None)
    assert wd.watch is not None
    rankkit.put("closing", wd.watch.desk.store_closing)
    rankkit.put("incidents_after", [i["kind"] for i in wd.incidents])
    rankkit.save()


def main() -> None:
    if sys.argv[1] == "off":
        rankkit.fault_fired("ranks end without saying so")
        ending.leave = lambda *args, **kwargs: None  # type: ignore[assignment]
        ending.announce_closing = lambda *args, **kwargs: None  # type: ignore[assignment]
    rank = rankkit.init()
    wd = ncclguard.start_watchdog(
        heartbeat_s=HEARTBEAT_S,
        peer_timeout_s=PEER_S,
        store_timeout_s=STORE_S,
        hang_timeout_s=30.0,
        actions=["report", "exit"],
        escalate_after_s=0.4,
        incident_dir=Path(os.environ["NCCLGUARD_TEST_OUT"]) / f"incidents{rank}",
    )
    pair = dist.new_group([0, 1])
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    if rank == 2:
        return finish(wd)
    dist.all_reduce(t, group=pair)
    time.sleep(SAVE_S)  # no collective: one rank's exit rung must not end the other's work by its error
    if rank == 0:
        return finish(wd)
    time.sleep(UPLOAD_S)
    finish(wd)


if __name__ == "__main__":
    main()
