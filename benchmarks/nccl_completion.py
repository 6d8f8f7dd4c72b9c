"""How late an NCCL collective's completion is seen on the CPU, by each way of waiting (needs a GPU).

    python benchmarks/nccl_completion.py [--trials 200] [--ms 2 10 | --sleep-us 200 2000] [--out PATH]

A world-of-one NCCL group on GPU 0. Each trial enqueues ``torch.cuda._sleep`` for a known time on
the current stream, then an all_reduce of one element (NCCL's stream waits for the current
stream, so the collective ends right after the sleep), and waits for it in one of these ways,
rotating the order per trial:

- ``spin``: ``while not work.is_completed(): pass``: the earliest the CPU can see it (the
  reference; it burns a core);
- ``previous``: ncclguard's wait before issue 13, polling ``is_completed()`` with sleeps that
  grow from 50 µs to 2 ms;
- ``ncclguard``: :func:`ncclguard.collectives.wire.wait_work` as configured by default
  (``Config.nccl_wait="poll"``: ``is_completed()`` every 20 µs, timer slack 1 µs);
- ``ncclguard-event``: its ``"event"`` mode (a blocking CUDA event, a watcher thread, a torch
  Future; see ncclguard.collectives.completion);
- ``event-sync``: ``work.wait()`` then a blocking CUDA event synchronized on the calling thread
  (the driver's own wake-up, without a hand-off between threads; it cannot keep a deadline);
- ``get_future``: a done-callback on ``work.get_future()`` setting a ``threading.Event``;
  ``fired_before_gpu_finished`` counts the trials where it fired before the GPU had finished;
- ``poll-20us-default-slack``, ``poll-50us-slack1us``: fixed-period polls, for comparison.

Reported per way and sleep: median and p99 of the time from issue to "seen", how much later
than ``spin`` (the difference of the medians and of the p99s, in µs), and the CPU time the
whole process used per second of waiting (1.0 = a core spinning; the part every way pays, the
launches and NCCL's own threads, is what ``event-sync`` shows). Finally a 300 ms kernel is
waited on with a 50 ms deadline: ncclguard must give up at ~50 ms while the GPU is still busy.
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

OUT = Path(__file__).resolve().parent / "results" / "nccl-completion.json"


def _previous_wait(work: object, deadline: float) -> None:
    """ncclguard's wait for NCCL before issue 13, kept here for comparison."""
    pause = 5e-5
    while not work.is_completed():  # type: ignore[attr-defined]
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", "--iters", type=int, default=200, help="timed trials per way and sleep")
    ap.add_argument("--ms", type=float, nargs="+", default=[2.0, 10.0], help="GPU sleeps, milliseconds")
    ap.add_argument("--sleep-us", type=float, nargs="+", help="GPU sleeps, microseconds (instead of --ms)")
    ap.add_argument("--out", "--json", type=Path, default=OUT)
    ns = ap.parse_args()
    if ns.sleep_us:
        ns.ms = [us / 1000 for us in ns.sleep_us]

    import torch
    import torch.distributed as dist

    from ncclguard.collectives.completion import wait_gpu_work
    from ncclguard.collectives.wire import wait_work

    if not torch.cuda.is_available():
        print("no GPU: this benchmark needs CUDA and NCCL", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    pg = dist.group.WORLD
    t = torch.ones(1, device=device)

    # Cycles per millisecond of torch.cuda._sleep on this GPU.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def spin(work: object) -> None:
        while not work.is_completed():  # type: ignore[attr-defined]
            pass
        work.wait()  # type: ignore[attr-defined]

    def previous(work: object) -> None:
        _previous_wait(work, time.monotonic() + 60)

    def ncclguard(work: object) -> None:
        wait_work(work, time.monotonic() + 60, "nccl", pg)

    def event_sync(work: object) -> None:
        work.wait()  # type: ignore[attr-defined]
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        ev.synchronize()

    early = {"n": 0}

    def get_future(work: object) -> None:
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())  # type: ignore[attr-defined]
        done.wait(60)
        if not work.is_completed():  # type: ignore[attr-defined]
            early["n"] += 1  # warm-up trials included: the count is over trials + 5
        work.wait()  # type: ignore[attr-defined]

    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def fixed_poll(period_s: float, slack_ns: int | None) -> Callable[[object], None]:
        """is_completed() every period_s; slack_ns: the thread's timer slack meanwhile (Linux
        PR_SET_TIMERSLACK; the default 50 µs stretches every short sleep by up to that)."""

        def wait(work: object) -> None:
            old = libc.prctl(30, 0, 0, 0, 0) if slack_ns is not None else None  # PR_GET_TIMERSLACK
            if slack_ns is not None:
                libc.prctl(29, slack_ns, 0, 0, 0)  # PR_SET_TIMERSLACK
            try:
                while not work.is_completed():  # type: ignore[attr-defined]
                    time.sleep(period_s)
            finally:
                if old is not None:
                    libc.prctl(29, old, 0, 0, 0)
            work.wait()  # type: ignore[attr-defined]

        return wait

    def ncclguard_event(work: object) -> None:
        wait_gpu_work(work, time.monotonic() + 60, pg, "event")

    ways = {
        "spin": spin,
        "previous": previous,
        "ncclguard": ncclguard,
        "ncclguard-event": ncclguard_event,
        "event-sync": event_sync,
        "get_future": get_future,
        "poll-20us-default-slack": fixed_poll(20e-6, None),
        "poll-50us-slack1us": fixed_poll(50e-6, 1000),
    }
    names = list(ways)
    results = []
    for ms in ns.ms:
        cycles = int(cycles_per_ms * ms)
        seen: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, float] = {n: 0.0 for n in names}
        wall: dict[str, float] = {n: 0.0 for n in names}
        early["n"] = 0
        for trial in range(ns.trials + 5):
            for k in range(len(names)):
                name = names[(trial + k) % len(names)]
                torch.cuda.synchronize()
                c0, t0 = time.process_time(), time.perf_counter()
                torch.cuda._sleep(cycles)
                work = dist.all_reduce(t, async_op=True)
                ways[name](work)
                t1, c1 = time.perf_counter(), time.process_time()
                if trial >= 5:
                    seen[name].append((t1 - t0) * 1e6)
                    cpu[name] += c1 - c0
                    wall[name] += t1 - t0
        ref_med = statistics.median(seen["spin"])
        ref_p99 = statistics.quantiles(seen["spin"], n=100)[98]
        for name in names:
            xs = seen[name]
            med, p99 = statistics.median(xs), statistics.quantiles(xs, n=100)[98]
            row = {
                "sleep_ms": ms,
                "way": name,
                "trials": len(xs),
                "seen_median_us": round(med, 1),
                "seen_p99_us": round(p99, 1),
                "later_than_spin_median_us": round(med - ref_med, 1),
                "later_than_spin_p99_us": round(p99 - ref_p99, 1),
                "cpu_per_wall": round(cpu[name] / wall[name], 3),
            }
            if name == "get_future":
                row["fired_before_gpu_finished"] = early["n"]
                row["fired_before_gpu_finished_of"] = ns.trials + 5
            results.append(row)
            print(json.dumps(row), flush=True)

    # The deadline: a 300 ms kernel waited on with a 50 ms deadline must give up at ~50 ms.
    from ncclguard.collectives.completion import DeadlinePassed

    torch.cuda.synchronize()
    torch.cuda._sleep(int(cycles_per_ms * 300))
    work = dist.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    try:
        wait_work(work, t0 + 0.05, "nccl", pg)
        deadline = {"raised": False}
    except DeadlinePassed:
        deadline = {"raised": True}
    deadline["gave_up_after_ms"] = round((time.monotonic() - t0) * 1e3, 2)
    deadline["gpu_still_busy_then"] = not work.is_completed()
    torch.cuda.synchronize()
    print(json.dumps({"deadline_50ms_on_300ms_kernel": deadline}), flush=True)

    doc = {
        "deadline_50ms_on_300ms_kernel": deadline,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "cycles_per_ms": round(cycles_per_ms),
        "trials": ns.trials,
        "results": results,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
