"""Straggler detection at 1,024 simulated ranks against one real TCPStore (issue 21, point 5).

Each simulated rank has its own :class:`WatchdogStore` (the watchdog's store protocol) over a client
that counts its requests, and its own :class:`StragglerWatch`. Per window every rank publishes its
heartbeat with its window figures and reads its ``watch_peers`` (16) watched peers' heartbeats, as the
watchdog does each beat; then it assesses its window against theirs. The figures come from the
lockstep model of a synchronous step (tests/watching/test_straggler.py) with +-3% noise per rank and window;
rank 700 computes 20% more. What is measured here is the protocol, the decoding and the assessment
at scale, not the measurement of the figures from flight records (tests/watching/test_straggler.py and the
multi-rank tests cover that).

Asserted: rank 700, and no other rank, raises a compute straggler incident within 3 windows; the
store requests per rank per window are the same at 64 and at 1,024 ranks (flat: each reads 16 peers).
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ncclguard.incidents.model import Heartbeat, StragglerWindow
from ncclguard.recording.steps import StepMarks
from ncclguard.store.keys import Keys
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import WatchdogStore
from ncclguard.watching.sensors.liveness import watched_peers
from ncclguard.watching.sensors.straggler import StragglerWatch

pytestmark = pytest.mark.multirank  # tens of seconds at 1,024 ranks

SLOW_RANK = 700
WINDOWS = 4
WINDOW_S = 10.0


class Counting:
    """A store client that counts the requests made through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count = inner, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            self.count += 1
            return method(*args)

        return counted


def window(rank: int, n: int, computes: list[float], transfer: float) -> StragglerWindow:
    step = max(computes) + transfer
    count = WINDOW_S / step
    c = computes[rank]
    return StragglerWindow(
        n=n,
        end=WINDOW_S * (n + 1),
        length_s=WINDOW_S,
        compute_s=c * count,
        wait_s=(step - c) * count,
        ops=int(count),
        op_wait_s=step - c,
        transfer_ops=int(count),
        phase="train",
        op="all_reduce(SUM)",
    )


def simulate(world: int, client: Any, session: str) -> dict[str, Any]:
    cfg = WatchdogConfig()
    rnd = random.Random(world)
    keys = Keys(session)
    counters = [Counting(client) for _ in range(world)]
    stores = [WatchdogStore(counters[r], keys, 30.0, 60.0) for r in range(world)]
    watches = [
        StragglerWatch(
            r,
            WINDOW_S,
            cfg.straggler_threshold,
            cfg.straggler_min_share,
            cfg.straggler_windows,
            cfg.straggler_link_threshold,
            marks=StepMarks(),
            thread=0,
        )
        for r in range(world)
    ]
    peers = [watched_peers(r, world, cfg.watch_peers) for r in range(world)]
    found: dict[int, tuple[int, Any]] = {}
    t0 = time.perf_counter()
    try:
        for n in range(WINDOWS):
            computes = [(1.2 if r == SLOW_RANK else 1.0) * (1 + rnd.uniform(-0.03, 0.03)) for r in range(world)]
            for r in range(world):  # every rank closes its window and beats
                watches[r].window = window(r, n, computes, 0.3)
                hb = Heartbeat(
                    rank=r,
                    host="sim",
                    pid=r,
                    beat=n + 1,
                    time=WINDOW_S * (n + 1),
                    phase="train",
                    site="",
                    last_seq={},
                    last_completed={},
                    inflight=[],
                )
                stores[r].publish_heartbeat(watches[r].stamp(hb))
            for r in range(world):  # then reads its peers' and assesses
                det = watches[r].check(stores[r].read_heartbeats(peers[r]))
                if det is not None:
                    found[r] = (n, det)
    finally:
        for s in stores:
            s.close()
    return {
        "found": found,
        "requests": [c.count for c in counters],
        "seconds": time.perf_counter() - t0,
    }


@pytest.fixture(scope="module")
def runs():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    return {world: simulate(world, client, f"straggler-scale-{world}") for world in (64, 1024)}


def test_the_straggler_alone_is_named_within_3_windows_at_1024_ranks(runs) -> None:
    found = runs[1024]["found"]
    assert sorted(found) == [SLOW_RANK], {r: d.reason for r, (_, d) in found.items()}
    n, det = found[SLOW_RANK]
    assert n <= 2
    assert det.straggler.cause == "compute" and det.straggler.rank == SLOW_RANK
    assert det.straggler.slowdown == pytest.approx(1.2, abs=0.08)
    assert runs[64]["found"] == {}  # rank 700 is not in a world of 64: nobody is slow there


def test_store_requests_per_rank_are_flat_with_world_size(runs) -> None:
    small, large = runs[64]["requests"], runs[1024]["requests"]
    # Per window: one set (the heartbeat), one check and one multi_get of the 16 watched peers.
    assert set(small) == set(large) == {3 * WINDOWS}
