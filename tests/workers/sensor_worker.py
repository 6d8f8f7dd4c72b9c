"""Rank side of tests/watching/test_sensor_multirank.py. Usage: sensor_worker.py

One launch, torchrun, 2 ranks, the watchdog at its default ladder (report) with a short beat.
Each rank registers two sensors of its own before the watchdog starts:
    queue   publishes this rank's "queue depth" (rank 1's grows, rank 0's stays 0) in its heartbeat's
            readings; on rank 0 it reads rank 1's from rank 1's heartbeat and finds it too deep once
            (an incident of kind ``sensor``, a report that never climbs past ``report``);
    broken  raises in every call: logged, and the watchdog and the other sensor go on.
The ranks train (all_reduce in a loop) until rank 0's incident is merged and settled, then say what they saw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import start_watchdog
from ncclguard.incidents.base import IncidentKind
from ncclguard.incidents.beats import Heartbeat
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.registry import register_sensor, registered
from ncclguard.watching.sensors.sensor import SensorSite

H = TypeVar("H", bound=Heartbeat)
OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
HEARTBEAT_S = 0.3
DEEP = 5  # a peer's queue this deep is a finding


class QueueSensor:
    """A user's sensor: this rank's queue depth in its heartbeat, a peer's too deep queue found."""

    name = "queue"

    def __init__(self, site: SensorSite) -> None:
        self.rank, self.depth, self.found = site.rank, 0, False
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.rank == 1:
            self.depth = self.ticks // 5  # grows, a tick at a time

    def stamp(self, beat: H) -> H:
        readings = {**(beat.readings or {}), self.name: {"depth": self.depth}}
        return beat.model_copy(update={"readings": readings})

    def check(self, peers: Mapping[int, Heartbeat]) -> Detection | None:
        for r, hb in peers.items():
            depth = (hb.readings or {}).get(self.name, {}).get("depth")
            if not self.found and isinstance(depth, int) and depth >= DEEP:
                self.found = True
                return Detection(IncidentKind.SENSOR, f"rank {r}'s queue is {depth} deep", f"queue/{r}", ranks=(r,))
        return None


class BrokenSensor:
    """A sensor with a bug in every call."""

    name = "broken"

    def __init__(self, site: SensorSite) -> None:
        self.calls = 0

    def tick(self) -> None:
        self.calls += 1
        raise RuntimeError("broken tick")

    def stamp(self, beat: H) -> H:
        raise RuntimeError("broken stamp")

    def check(self, peers: Mapping[int, Heartbeat]) -> Detection | None:
        raise RuntimeError("broken check")


def main() -> None:
    rank = rankkit.init()
    register_sensor("queue", QueueSensor)
    rankkit.fault_fired("a sensor that raises in every call")
    register_sensor("broken", BrokenSensor)
    put("registered", list(registered()))
    try:
        register_sensor("queue", QueueSensor)
    except ValueError as exc:
        put("taken", str(exc))
    wd = start_watchdog(heartbeat_s=HEARTBEAT_S, peer_timeout_s=6.0, incident_dir=str(OUT / "incidents"))
    t = torch.ones(4)
    deadline = time.monotonic() + 60  # a hang guard: the finding comes within a few beats
    flag = torch.zeros(1)
    while time.monotonic() < deadline:
        dist.all_reduce(t)
        seen = wd.incidents
        flag.fill_(1.0 if seen and seen[0]["settled"] and seen[0]["doc"] is not None else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank has it settled: stop together
        if flag.item() == 1.0:
            break
        time.sleep(0.05)
    put("incidents", [{"kind": i["kind"], "actions": i["actions"], "settled": i["settled"]} for i in wd.incidents])
    put("reason", wd.incidents[0]["doc"]["reason"] if wd.incidents else None)
    peer = wd.peer_heartbeats().get(1 - rank)
    put("peer_readings", None if peer is None else peer.readings)
    broken, queue = wd.sensor("broken"), wd.sensor("queue")
    put("broken_calls", getattr(broken, "calls", 0))
    put("queue_ticks", getattr(queue, "ticks", 0))
    put("beats", wd.watch.beats if wd.watch is not None else 0)
    wd.stop()
    rankkit.done()


if __name__ == "__main__":
    main()
