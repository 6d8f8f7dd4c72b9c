"""What flight-recording costs per call: the instrument() wrapper around a torch.distributed op.

The issue's budget is at most 5 microseconds per call. Two measurements, one process:

1. ``wrapper``: the recording wrapper around a no-op that has the op's signature, minus the
   no-op called directly. This is the recording cost alone: argument lookup, size and dtype,
   group name, phase, the call-site frame walk, the record, the lock, the ring. Variants: the
   caller right above the op; the caller 10 frames up behind framework frames (as under
   DeepSpeed: each frame's file is one of torch's, so the walk skips it); an async op; a send.
2. ``gloo``: a real 1-element all_reduce on a gloo group of one rank, plain against
   instrumented, in interleaved blocks so machine noise lands on both alike.

The verdict against the budget takes each case's least-disturbed timing (the minimum of the
repeats, as Python's timeit documentation recommends for repeat()); medians are shown too.

Usage: python benchmarks/recording_cost.py [--calls N] [--repeat R] [--json PATH]
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

from ncclguard import instrument, phase, recorder, uninstrument
from ncclguard.diagnosis.instrument import _spec, _wrap

BUDGET_US = 5.0


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _Work:
    """Stands in for the Work an async op returns (only the wrapper's cost is measured here)."""

    def is_completed(self) -> bool:
        return True

    def exception(self) -> None:
        return None


def _noop_async(*args: Any, **kwargs: Any) -> _Work:
    return _Work()


def _deep_caller(depth: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    """A chain of ``depth`` frames whose code claims a torch source file, ending in ``fn()``."""
    torch_file = dist.distributed_c10d.__file__
    namespace: dict[str, Any] = {"leaf": fn}
    src = "def f0():\n    return leaf()\n"
    for i in range(1, depth):
        src += f"def f{i}():\n    return f{i - 1}()\n"
    exec(compile(src, torch_file, "exec"), namespace)
    return namespace[f"f{depth - 1}"]


def per_call_us(fn: Callable[[], Any], calls: int, repeat: int) -> list[float]:
    """Microseconds per call of ``fn``, one value per repeat."""
    return [t / calls * 1e6 for t in timeit.repeat(fn, number=calls, repeat=repeat)]


def wrapper_costs(calls: int, repeat: int) -> dict[str, dict[str, float]]:
    t = torch.ones(1)
    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    ar = _wrap(_spec("all_reduce", dist.all_reduce), _noop)
    cases["all_reduce, caller right above"] = (lambda: ar(t), lambda: _noop(t))
    deep_wrapped, deep_plain = _deep_caller(10, lambda: ar(t)), _deep_caller(10, lambda: _noop(t))
    cases["all_reduce, caller 10 framework frames up"] = (deep_wrapped, deep_plain)
    ar_async = _wrap(_spec("all_reduce", dist.all_reduce), _noop_async)

    def async_then_sweep() -> None:
        ar_async(t, async_op=True)
        recorder.sweep()  # the watchdog's side: notices completion and closes the record

    cases["all_reduce async_op=True (+ the sweep that closes it)"] = (
        async_then_sweep,
        lambda: _noop_async(t, async_op=True),
    )
    send = _wrap(_spec("send", dist.send), _noop)
    cases["send (point to point)"] = (lambda: send(t, dst=0), lambda: _noop(t, dst=0))
    out = {}
    with phase("train", step=1201):
        for name, (wrapped, plain) in cases.items():
            recorder.clear()
            w = per_call_us(wrapped, calls, repeat)
            p = per_call_us(plain, calls, repeat)
            # Per repeat, wrapped minus plain; the min is the least-disturbed run, the median the typical one.
            diffs = sorted(a - b for a, b in zip(w, p, strict=True))
            out[name] = {
                "min_us": round(diffs[0], 3),
                "median_us": round(statistics.median(diffs), 3),
                "max_us": round(diffs[-1], 3),
            }
    recorder.clear()
    return out


def gloo_costs(pairs: int, calls: int) -> dict[str, float]:
    """Plain and instrumented blocks, alternating; the per-pair difference cancels slow drifts."""
    t = torch.ones(1)
    instrument()
    ops = {True: dist.all_reduce, False: dist.all_reduce.__ncclguard_original__}
    uninstrument()
    # Warm-up: a fresh gloo group runs its first thousands of calls in a slower regime (threads
    # not yet settled on cores), which would drown the difference in noise.
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        ops[False](t)
    plain, recorded, diffs = [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {}
        for wrapped in order:
            op = ops[wrapped]
            got[wrapped] = per_call_us(lambda op=op: op(t), calls, 1)[0]
            recorder.clear()
        plain.append(got[False])
        recorded.append(got[True])
        diffs.append(got[True] - got[False])
    return {
        "plain_p50_us": round(statistics.median(plain), 2),
        "instrumented_p50_us": round(statistics.median(recorded), 2),
        "difference_p50_us": round(statistics.median(diffs), 2),
        "difference_of_minima_us": round(min(recorded) - min(plain), 2),
        "pairs": pairs,
        "calls_per_block": calls,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50_000, help="calls per timing (default 50000)")
    ap.add_argument("--repeat", type=int, default=9, help="timings per case (default 9)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.calls < 1 or args.repeat < 1:
        ap.error("--calls and --repeat must be >= 1")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    wrapper = wrapper_costs(args.calls, args.repeat)
    gloo = gloo_costs(pairs=40, calls=max(args.calls // 100, 100))
    wall = time.monotonic() - started
    load_after = os.getloadavg()[0]
    dist.destroy_process_group()

    print(f"Recording cost per call (instrument() wrapper minus the bare call), budget {BUDGET_US:g} us")
    print(f"{'case':55s} {'min us':>8s} {'median us':>10s} {'max us':>8s}")
    for name, row in wrapper.items():
        print(f"{name:55s} {row['min_us']:8.2f} {row['median_us']:10.2f} {row['max_us']:8.2f}")
    # The verdict uses each case's least-disturbed timing: on a shared machine the higher ones
    # measure the other processes (Python's timeit docs say the same of repeat()'s minimum).
    worst = max(row["min_us"] for row in wrapper.values())
    worst_median = max(row["median_us"] for row in wrapper.values())
    print(
        f"worst case: {worst:.2f} us (least disturbed), {worst_median:.2f} us (median) -> "
        f"{'within' if worst <= BUDGET_US else 'OVER'} the {BUDGET_US:g} us budget"
    )
    print(
        f"\ngloo world of one, 1-element all_reduce, per call: plain p50 {gloo['plain_p50_us']:.1f} us, "
        f"instrumented p50 {gloo['instrumented_p50_us']:.1f} us; difference p50 over {gloo['pairs']} interleaved pairs "
        f"{gloo['difference_p50_us']:+.1f} us, difference of the minima {gloo['difference_of_minima_us']:+.1f} us"
    )
    print("(around a real call the same code runs with cold caches: dearer than in the loop above)")
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
                    "budget_us": BUDGET_US,
                    "wrapper": wrapper,
                    "worst_min_us": worst,
                    "worst_median_us": worst_median,
                    "gloo_world_of_one": gloo,
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
    return 0 if worst <= BUDGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
