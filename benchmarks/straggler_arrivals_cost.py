"""What a straggler window's read of torch's flight recorder costs (the backend's arrivals).

When a window's records hold fewer than 3 ops while the world group's backend ran more (a loop that
only calls DDP: its bucket all_reduce is issued from C++), the watchdog thread reads torch's recorder
once as the window closes (``WorldArrivals.arrivals``: dump, then parse only the world group's
entries created in the window, keeping the newest 32). This measures that read, in one process (a
gloo world of one), with the recorder holding ``--entries`` collectives (default 200 and 2000: a
DDP loop of one bucket and 50 ms steps fills 200 a default 10 s window, and the recorder's ring is
full at ``TORCH_FR_BUFFER_SIZE``, 2000 by default, after 100 s, so 2000 is the steady state):

- ``dump``: ``_dump_fr_trace_json`` alone (C++);
- ``arrivals``: the watchdog's read (dump + the window's parse);
- ``parse_dump``: dump + parsing every entry (what a second, full parser would cost), for scale;
- ``training_thread_stall``: the longest a thread spinning in Python stood still while another ran
  the read once: the dump (C++) and ``json.loads`` hold the GIL, so the read stops the training
  thread for about its whole length, once per window.

The verdict per case is the least-disturbed timing (the minimum of the repeats, as timeit's
documentation recommends), medians beside; the per-step cost is the read over the window's length.

Usage: python benchmarks/straggler_arrivals_cost.py [--entries 200 2000] [--repeat 15] [--window-s 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.watching.sensors import torchfr
from ncclguard.watching.sensors.rank_state import WorldArrivals


def per_call_ms(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Milliseconds per call of ``fn``: min, median and max over ``repeat`` single calls."""
    runs = sorted(t * 1e3 for t in timeit.repeat(fn, number=1, repeat=repeat))
    return {"min_ms": round(runs[0], 3), "median_ms": round(statistics.median(runs), 3), "max_ms": round(runs[-1], 3)}


def longest_stall_ms(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """How long this (the training) thread stood still while another thread ran ``fn`` once: the
    longest gap between two turns of a tight loop here, per repeat. Near ``fn``'s own time when ``fn``
    holds the GIL throughout (the watchdog's read then costs the training thread all of it)."""
    gaps = []
    for _ in range(repeat):
        go = threading.Event()  # the read starts once this thread spins (a short one could end in start())
        worker = threading.Thread(target=lambda go=go: (go.wait(), fn()))
        worker.start()
        last = time.perf_counter()
        longest = 0.0
        go.set()
        while worker.is_alive():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        worker.join()
        gaps.append(longest * 1e3)
    gaps.sort()
    return {"min_ms": round(gaps[0], 3), "median_ms": round(statistics.median(gaps), 3), "max_ms": round(gaps[-1], 3)}


def case(entries: int, repeat: int, window_s: float) -> dict[str, Any]:
    """The read with the recorder holding ``entries`` all_reduces of the world group, spread over
    one window (the newest ``entries`` the ring keeps)."""
    t = torch.ones(1024)
    t0 = time.time()
    seq0 = compat.sequence_number(compat.default_group())
    while compat.sequence_number(compat.default_group()) - seq0 < entries:
        dist.all_reduce(t)
    end = time.time() + 1e-3
    text = compat.dump_flight_recorder()
    held = len(json.loads(text)["entries"])
    source = WorldArrivals()
    op, arrivals = source.arrivals(min(t0, end - window_s), end, 32)
    assert len(arrivals) == min(32, entries) and op == "gloo:all_reduce", (op, len(arrivals))
    return {
        "entries_held": held,
        "dump_chars": len(text),
        "dump": per_call_ms(compat.dump_flight_recorder, repeat),
        "arrivals": per_call_ms(lambda: source.arrivals(end - window_s, end, 32), repeat),
        "parse_dump": per_call_ms(lambda: torchfr.parse_dump(compat.dump_flight_recorder()), repeat),
        "training_thread_stall": longest_stall_ms(lambda: source.arrivals(end - window_s, end, 32), repeat),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[200, 2000], help="recorder entries (default 200 2000)")
    ap.add_argument("--repeat", type=int, default=15, help="timings per case (default 15)")
    ap.add_argument("--window-s", type=float, default=10.0, help="the straggler window (default 10 s)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.repeat < 1 or any(n < 1 for n in args.entries):
        ap.error("--entries and --repeat must be >= 1")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    out = {}
    for n in sorted(args.entries):
        # A fresh world per case: the recorder holds this case's entries only (up to its ring's size).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out[str(n)] = case(n, args.repeat, args.window_s)
        dist.destroy_process_group()
    wall = time.monotonic() - started
    load_after = os.getloadavg()[0]
    print(f"A straggler window's read of torch's flight recorder (once per {args.window_s:g} s window, when needed)")
    print(
        f"{'entries':>8s} {'MB':>6s} {'dump ms':>9s} {'arrivals ms':>12s} {'p50 ms':>8s} {'full parse ms':>14s} {'of window':>10s}"
    )
    for row in out.values():
        a = row["arrivals"]
        share = a["min_ms"] / 1e3 / args.window_s
        print(
            f"{row['entries_held']:8d} {row['dump_chars'] / 1e6:6.2f} {row['dump']['min_ms']:9.2f} {a['min_ms']:12.2f} "
            f"{a['median_ms']:8.2f} {row['parse_dump']['min_ms']:14.2f} "
            f"{row['training_thread_stall']['median_ms']:13.2f} {share:10.3%}"
        )
    print(
        f"\n{os.cpu_count()} cores, 1-min load {load_before:.2f} -> {load_after:.2f}, {wall:.1f} s, torch {torch.__version__}, "
        f"Python {platform.python_version()}, TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE', 'default')}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "window_s": args.window_s,
            "cases": out,
            "environment": {
                "cores": os.cpu_count(),
                "load_1min": [load_before, load_after],
                "wall_s": round(wall, 1),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": platform.machine(),
            },
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
