"""What the watchdog's read of the backend costs: per heartbeat (every group's sequence number)
and per suspect (torch's flight recorder, read, parsed and joined to ncclguard's records).

The issue's budget: the per-heartbeat read stays under 20 microseconds per group, and nothing is
added to a collective's path (the reads run in the watchdog thread). One process, a gloo world of
one, with 1, 8 and 32 process groups:

1. ``per_heartbeat``: ``RankState.backend_seq()`` (every group's name and backend sequence number,
   through ``ncclguard._torch_compat``), which each heartbeat publishes, and the same plus the
   ``SeqClock`` update that each watchdog tick does (every ``heartbeat_s / 5``).
2. ``per_suspect``: ``snapshot.backend_ops`` for one group with torch's recorder full
   (``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default) and ncclguard's newest records: what the
   watchdog does once per ``(group, number)`` that stood still for ``hang_timeout_s``, and for each
   incident's statement.

The verdict takes each case's least-disturbed timing (the minimum of the repeats, as Python's
timeit documentation recommends for repeat()); medians are shown too.

Usage: python benchmarks/investigations/backend_read_cost.py [--calls N] [--repeat R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.recording.flight import recorder
from ncclguard.recording.instrument import instrument, uninstrument
from ncclguard.watching.sensors.liveness import SeqClock
from ncclguard.watching.sensors.rank_state import RECENT, RankState, backend_ops

BUDGET_US_PER_GROUP = 20.0
GROUP_COUNTS = (1, 8, 32)


def per_call_us(fn: Callable[[], Any], calls: int, repeat: int) -> dict[str, float]:
    """Microseconds per call of ``fn``: min, median and max over ``repeat`` timings of ``calls`` calls."""
    runs = sorted(t / calls * 1e6 for t in timeit.repeat(fn, number=calls, repeat=repeat))
    return {"min_us": round(runs[0], 3), "median_us": round(statistics.median(runs), 3), "max_us": round(runs[-1], 3)}


def per_heartbeat(calls: int, repeat: int) -> dict[str, dict[str, Any]]:
    """The per-heartbeat read with 1, 8 and 32 groups (the default group and ``new_group([0])``s)."""
    out = {}
    clock = SeqClock()
    for n in GROUP_COUNTS:
        while len(compat.group_names()) < n:
            dist.new_group([0])
        seqs = RankState.backend_seq()
        assert seqs is not None and len(seqs) == n, seqs
        read = per_call_us(RankState.backend_seq, calls, repeat)
        tick = per_call_us(lambda: clock.update(RankState.backend_seq(), time.monotonic()), calls, repeat)
        out[str(n)] = {
            "groups": n,
            "read": read,
            "read_and_clock": tick,
            "per_group_min_us": round(tick["min_us"] / n, 3),
            "per_group_median_us": round(tick["median_us"] / n, 3),
        }
    return out


def per_suspect(repeat: int) -> dict[str, Any]:
    """``backend_ops`` for the default group with torch's recorder full and ncclguard's ring full."""
    t = torch.ones(1)
    instrument()  # every call recorded by ncclguard too: the join has the most records to look at
    try:
        for _ in range(2100):  # past TORCH_FR_BUFFER_SIZE's default of 2000: the ring is full
            dist.all_reduce(t)
    finally:
        uninstrument()
    text = compat.dump_flight_recorder()
    entries = len(json.loads(text)["entries"])
    name = compat.group_names()[compat.default_group()]
    seqs = {name: compat.sequence_number(compat.default_group())}
    state = RankState(0, 1)
    ops = backend_ops(seqs, state.records(RECENT))
    assert ops[name].record is not None, "the newest entry was not joined to its record"
    return {
        "fr_entries": entries,
        "fr_dump_chars": len(text),
        "dump_only": per_call_us(compat.dump_flight_recorder, 5, repeat),
        "dump_parse_join": per_call_us(lambda: backend_ops(seqs, state.records(RECENT)), 5, repeat),
        "records_in_ring": len(recorder.records()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000, help="calls per timing (default 20000)")
    ap.add_argument("--repeat", type=int, default=9, help="timings per case (default 9)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.calls < 1 or args.repeat < 1:
        ap.error("--calls and --repeat must be >= 1")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    beat = per_heartbeat(args.calls, args.repeat)
    suspect = per_suspect(args.repeat)
    wall = time.monotonic() - started
    load_after = os.getloadavg()[0]
    dist.destroy_process_group()

    print(f"Per-heartbeat backend read (every group's sequence number), budget {BUDGET_US_PER_GROUP:g} us per group")
    print(
        f"{'groups':>6s} {'read min us':>12s} {'read p50 us':>12s} {'+clock min us':>14s} {'+clock p50 us':>14s} {'per group us':>13s}"
    )
    for row in beat.values():
        print(
            f"{row['groups']:6d} {row['read']['min_us']:12.2f} {row['read']['median_us']:12.2f} "
            f"{row['read_and_clock']['min_us']:14.2f} {row['read_and_clock']['median_us']:14.2f} "
            f"{row['per_group_min_us']:13.3f}"
        )
    worst = max(row["per_group_min_us"] for row in beat.values())
    worst_median = max(row["per_group_median_us"] for row in beat.values())
    verdict = "within" if worst <= BUDGET_US_PER_GROUP else "OVER"
    print(
        f"worst per group: {worst:.3f} us (least disturbed), {worst_median:.3f} us (median) -> {verdict} the "
        f"{BUDGET_US_PER_GROUP:g} us budget"
    )
    print(
        f"\nPer suspect (once per (group, number) still for hang_timeout_s, and per incident): torch's recorder with "
        f"{suspect['fr_entries']} entries ({suspect['fr_dump_chars'] / 1e6:.2f} MB of JSON): dump "
        f"{suspect['dump_only']['min_us'] / 1e3:.1f} ms, dump + parse + join {suspect['dump_parse_join']['min_us'] / 1e3:.1f} ms "
        f"(medians {suspect['dump_only']['median_us'] / 1e3:.1f} and {suspect['dump_parse_join']['median_us'] / 1e3:.1f} ms)"
    )
    print(
        f"\n{os.cpu_count()} cores, 1-min load {load_before:.2f} -> {load_after:.2f}, {wall:.1f} s, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "budget_us_per_group": BUDGET_US_PER_GROUP,
                    "per_heartbeat": beat,
                    "worst_per_group_min_us": worst,
                    "worst_per_group_median_us": worst_median,
                    "per_suspect": suspect,
                    "environment": {
                        "cores": os.cpu_count(),
                        "load_1min": [load_before, load_after],
                        "wall_s": round(wall, 1),
                        "torch": torch.__version__,
                        "python": platform.python_version(),
                        "machine": platform.machine(),
                    },
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if worst <= BUDGET_US_PER_GROUP else 1


if __name__ == "__main__":
    sys.exit(main())
