"""How soon a waiting thread sees a completion, on the CPU alone (no GPU needed).

    .venv/bin/python benchmarks/completion_wakeup.py [--trials 1000]

Three measurements, each a median and p99 over ``--trials`` in microseconds, with the CPU time
the process used per second of waiting:

- ``future``: :func:`ncclguard.collectives.completion.wait_future` on a real
  ``torch.futures.Future`` that another thread completes at a known time: from the
  ``set_result`` call to the waiter running again (one hand-off between threads).
- ``watcher``: the whole NCCL path without the GPU: an event whose ``synchronize()`` returns
  at a known time, a :class:`~ncclguard.collectives.completion.GpuWatcher` thread, its future,
  the waiter (two hand-offs). On a GPU the driver's own wake-up from a blocking event comes on
  top (benchmarks/nccl_completion.py measures it there).
- ``previous``: ncclguard's NCCL wait before issue 13, polling ``is_completed()`` with sleeps
  growing from 50 µs to 2 ms, on an op that completes after 1 ms and after 10 ms: how late it
  notices.

Results: ``benchmarks/results/completion-wakeup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "completion-wakeup.json"


def _sleep_until(t: float) -> None:
    """Sleeps to just before ``t`` (perf_counter), then spins the rest: the completion is on time."""
    left = t - time.perf_counter()
    if left > 2e-4:
        time.sleep(left - 2e-4)
    while time.perf_counter() < t:
        pass


def _stats(xs: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(xs), 1),
        "p99_us": round(statistics.quantiles(xs, n=100)[98], 1),
        "max_us": round(max(xs), 1),
    }


def _measure(trials: int, one: Callable[[], tuple[float, float]]) -> dict[str, float]:
    """Runs ``one`` (returns (latency µs, seconds waited)) ``trials`` times after 20 warm-ups.

    ``cpu_per_wait_s``: CPU time of the waiting thread alone per second it waited (1.0 would be
    a core spinning; the thread that completes the op is not counted)."""
    for _ in range(20):  # imports, thread start-up, caches
        one()
    lat: list[float] = []
    waited = 0.0
    c0 = time.thread_time()
    for _ in range(trials):
        x, w = one()
        lat.append(x)
        waited += w
    cpu = time.thread_time() - c0
    return {**_stats(lat), "trials": trials, "cpu_per_wait_s": round(cpu / waited, 3) if waited else 0.0}


class _Completer:
    """A thread that completes futures at set times, then blocks again (as a watcher does)."""

    def __init__(self) -> None:
        import queue

        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            at, fut, mark = self.jobs.get()
            _sleep_until(at)
            mark.append(time.perf_counter())
            fut.set_result(None)


_completer: _Completer | None = None


def future_trial(delay_s: float = 2e-3) -> tuple[float, float]:
    """A torch Future completed by another thread ``delay_s`` from now; latency of the wake-up."""
    import torch

    from ncclguard.collectives.completion import wait_future

    global _completer
    if _completer is None:
        _completer = _Completer()
    fut: torch.futures.Future = torch.futures.Future()
    mark: list[float] = []
    t0 = time.perf_counter()
    _completer.jobs.put((t0 + delay_s, fut, mark))
    wait_future(fut, time.monotonic() + 10)
    woke = time.perf_counter()
    return (woke - mark[0]) * 1e6, woke - t0


class _TimedEvent:
    """Stands for a blocking CUDA event: ``synchronize()`` returns at a set time and notes when."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.returned = 0.0

    def synchronize(self) -> None:
        _sleep_until(self.at)
        self.returned = time.perf_counter()


def watcher_trial(delay_s: float = 2e-3) -> tuple[float, float]:
    """The watcher path: event returns at a set time -> watcher thread -> future -> waiter."""
    from ncclguard.collectives.completion import wait_future, watcher_for

    event = _TimedEvent(time.perf_counter() + delay_s)
    t0 = time.perf_counter()
    wait_future(watcher_for("bench", event), time.monotonic() + 10)
    woke = time.perf_counter()
    return (woke - event.returned) * 1e6, woke - t0


class _Op:
    """A Work-like op that completes ``after_s`` from its creation."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.perf_counter() + after_s

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> bool:
        return True


def previous_wait(work: _Op, deadline: float) -> None:
    """ncclguard's NCCL wait before issue 13 (kept here for comparison)."""
    pause = 5e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()


def previous_trial(after_s: float) -> tuple[float, float]:
    op = _Op(after_s)
    t0 = time.perf_counter()
    previous_wait(op, time.monotonic() + 10)
    seen = time.perf_counter()
    return (seen - op.done_at) * 1e6, seen - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=OUT)
    ns = ap.parse_args()
    rows = {
        "future": _measure(ns.trials, future_trial),
        "watcher": _measure(ns.trials, watcher_trial),
        "previous, op of 1 ms": _measure(max(ns.trials // 4, 50), lambda: previous_trial(1e-3)),
        "previous, op of 10 ms": _measure(max(ns.trials // 10, 50), lambda: previous_trial(10e-3)),
    }
    for name, row in rows.items():
        print(
            f"{name:24s} median {row['median_us']:8.1f} us  p99 {row['p99_us']:8.1f} us  cpu/wait {row['cpu_per_wait_s']}"
        )
    doc = {
        "what": "latency from a completion to the waiting thread running again, microseconds",
        "cpu": os.cpu_count(),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
        "rows": rows,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
