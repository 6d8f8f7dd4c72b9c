"""Rank side of tests/watching/test_node_tier_multirank.py. Usage: node_tier_worker.py two_nodes.

Two hosts (network namespaces), two ranks each (``torchrun --nnodes 2 --nproc-per-node 2``), the
node tier turned on as a user would (``NCCLGUARD_WATCHDOG_NODE_TIER=on``), the group made first,
ncclguard imported and the watchdog started after it:

1. a few seconds of all_reduces: every rank's heartbeats go through its node's store (the one
   ``ncclguard run``'s launcher serves), and each node's agent (the rank that holds its lease) puts
   one digest a beat in the job's store;
2. a desync across the nodes: rank 3 (host B, not an agent) skips an all_reduce and evaluates
   until the report is merged; the report names it, with its phase and site;
3. rank 2 (host B's ``LOCAL_RANK`` 0) stops (SIGSTOP): its node's store, its launcher's, goes on;
   rank 3 stays linked to it and runs host B's agent (it takes the lease over if rank 2 held it),
   and the lost incident names rank 2 alone. Rank 3 then continues rank 2 (SIGCONT), which ends at
   once, so that both torchruns end with success.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put, skip_collective

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
INCIDENTS = OUT / "incidents"
HEARTBEAT_S = 0.5
HANG_S = 3.0
PEER_S = 8.0  # rank 2's silence is a loss after this; far above a loaded machine's late beat (1.9 s seen)
WARM_S = 4.0  # all_reduces this long before the desync: 8 beats, the tier linked on every rank
WARM_STEPS = 40
WAIT_GUARD_S = 60.0  # hang guard of each wait for an incident (a report comes within HANG_S/PEER_S + beats)


def merged_incidents() -> int:
    return len(list(INCIDENTS.glob("*/incident.json"))) if INCIDENTS.is_dir() else 0


def tier_state(wd) -> dict:
    """What this rank's watchdog store says of the tier: tiered, linked to its node's store (the
    launcher's?), running its node's agent."""
    from ncclguard.watching.base.near_store import TieredWatchdogStore

    store = wd.watch.desk.store
    agent = getattr(store, "agent", None)
    return {
        "tiered": isinstance(store, TieredWatchdogStore),
        "linked": getattr(store, "near", None) is not None,
        "near_addr": getattr(store, "near_addr", ""),
        "launcher": getattr(store, "launcher", ""),
        "agent": bool(getattr(agent, "holding", agent is not None)),
        "generation": wd.generation,
    }


def job_view(wd) -> dict:
    """Rank 0's read of the job's store: the digests, and the heartbeats published there directly."""
    from ncclguard.cli.status_read import StatusReader, read_index, read_status
    from ncclguard.errors import StoreTimeout
    from ncclguard.store.clients import connect
    from ncclguard.watching.base.near_store import read_digests

    keys = wd.watch.desk.store.keys
    client = connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 10.0)
    # Through the watchdog's own bounded calls, which its thread uses too: a call of its that outlived
    # its bound on a loaded machine refuses this one ("an earlier call ... has not returned") until it
    # returns. Read again then, within the hang guard.
    deadline = time.monotonic() + WAIT_GUARD_S
    while True:
        try:
            digests = read_digests(wd.watch.desk.store, keys, [0, 1])
            break
        except StoreTimeout:
            if time.monotonic() > deadline:
                raise
            time.sleep(HEARTBEAT_S)
    direct = {}
    for r in range(dist.get_world_size()):
        if client.check([keys.heartbeat(r)]):
            direct[r] = rankkit.json.loads(client.get(keys.heartbeat(r)))["beat"]
    reader = StatusReader(client, 10.0)  # what `python -m ncclguard status` reads from outside
    index = read_index(reader, "main")
    status = read_status(reader, index, "here") if not isinstance(index, str) else None
    reader.close()
    return {
        "status": None if status is None else {"nodes": status.index.nodes, "states": [r.state for r in status.ranks]},
        "digests": {n: {"beat": d.beat, "ranks": sorted(d.beats)} for n, d in digests.items()},
        "digest_beats": {n: {r: rankkit.json.loads(t)["beat"] for r, t in d.beats.items()} for n, d in digests.items()},
        "direct_beats": direct,
    }


def two_nodes() -> None:
    r = rankkit.init()  # the group first, ncclguard imported after: the user's order
    from ncclguard import phase, safe_barrier, start_watchdog

    wd = start_watchdog(
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=HANG_S,
        peer_timeout_s=PEER_S,
        incident_dir=INCIDENTS,
        incident_plot=False,
    )
    # 1. Training: all_reduces for WARM_S (as many on every rank).
    x = torch.ones(1024)
    with phase("train", step=1):
        for _ in range(WARM_STEPS):
            dist.all_reduce(x)
            time.sleep(WARM_S / WARM_STEPS)
    put("tier", tier_state(wd))
    put("peers", {p: hb.beat for p, hb in wd.peer_heartbeats().items()})
    if r == 0:
        put("job", job_view(wd))
    safe_barrier(timeout=30)

    # 2. A desync: rank 3 skips this all_reduce and evaluates until the report is merged.
    with phase("train", step=4):
        if not skip_collective(3):
            put("desync_start", time.time())
            dist.all_reduce(torch.ones(4))  # MARK: desync
    if r == 3:
        with phase("eval", batch=7):
            rankkit.when(lambda: merged_incidents() >= 1, WAIT_GUARD_S).wait(WAIT_GUARD_S)  # MARK: eval
        dist.all_reduce(torch.ones(4))  # back in step: the others are released
    put("after_desync", wd.wait_for_incident(WAIT_GUARD_S, count=1, merged=True))
    put("carried", getattr(getattr(wd.watch.desk.store, "filing", None), "carried", None))
    safe_barrier(timeout=30)
    # Out of the barrier, said on the shared disk: rank 2 stops only once no rank waits on it in one.
    (OUT / f"out{r}").write_text("")

    # 3. Host B's agent stops, its node's store with it (every thread of its process stands).
    if r == 2:
        others = [OUT / f"out{p}" for p in (0, 1, 3)]
        rankkit.when(lambda: all(p.exists() for p in others), WAIT_GUARD_S).wait(WAIT_GUARD_S)
        rankkit.fault_fired("stops its process (SIGSTOP)")
        put("stall_at", time.time())
        rankkit.save()
        os.kill(os.getpid(), signal.SIGSTOP)
        rankkit.done()  # continued by rank 3 once the others are done: torchrun's exit barrier wants every node's success
    put("after_lost", wd.wait_for_incident(WAIT_GUARD_S, count=2))
    time.sleep(4 * HEARTBEAT_S)  # a few more beats: rank 3's through the job's store
    put("tier_after", tier_state(wd))
    put("peers_after", {p: [hb.beat, round(age, 2)] for p, (hb, age) in wd.peer_beats()[1].items()})
    # Every rank read before any leaves (the job's store is host A's torchrun's).
    (OUT / f"end{r}").write_text("")
    ends = [OUT / f"end{p}" for p in (0, 1, 3)]
    rankkit.when(lambda: all(p.exists() for p in ends), WAIT_GUARD_S).wait(WAIT_GUARD_S)
    if r == 3:
        pid = wd.peer_heartbeats()[2].pid
        put("continued", pid)
        rankkit.save()
        os.kill(pid, signal.SIGCONT)
    rankkit.done()


if __name__ == "__main__":
    {"two_nodes": two_nodes}[sys.argv[1]]()
