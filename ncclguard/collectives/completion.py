"""Waiting for a collective until a deadline, woken by its completion instead of a growing sleep.

gloo: ``work.wait(timeout)`` blocks in C++ until the op completes or the timeout passes; nothing
to add.

NCCL: nothing torch exposes wakes a CPU thread when the GPU finishes (torch 2.x source,
``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``):

- ``work.get_future()`` is completed by ``ProcessGroupNCCL::collective`` right after the kernel is
  *enqueued* (``work->future_->markCompleted(...)`` under a ``CUDAMultiStreamGuard``): a callback
  on it runs at once, not when the GPU is done;
- the result future (``futureWorkResult_``) is completed by the watchdog thread, which looks every
  ``kWatchdogThreadSleepMillis`` (100 ms);
- ``work.wait()`` only makes the current stream wait for the NCCL stream; with a timeout (or
  ``TORCH_NCCL_BLOCKING_WAIT``) it polls ``isCompleted()`` with 1 ms sleeps.

So this module waits for NCCL in one of two ways (``Config.nccl_wait``), both bounded by the
deadline, neither with a growing sleep:

- ``"poll"`` (default): ask ``work.is_completed()`` (a ``cudaEventQuery``) every
  ``Config.nccl_poll_us`` (20 µs), with the thread's Linux timer slack lowered to 1 µs meanwhile
  (the default slack of 50 µs stretches each short sleep to ~90 µs). Measured on an H100
  (benchmarks/nccl_completion.py): seen 19-23 µs after a spinning thread sees it (median),
  costing about a quarter of a core while waiting.
- ``"event"``: after ``work.wait()`` (current stream ordered after the collective, CPU not
  blocked) record a CUDA event created with ``blocking=True`` (``cudaEventBlockingSync``); a
  per-group watcher thread sleeps in ``event.synchronize()`` (the driver blocks the thread) and
  completes a ``torch.futures.Future``, which the caller waits on with the time left
  (:func:`wait_future`), asking ``work.is_completed()`` every :data:`CHECK_PERIOD_S` so that an
  error is seen even if the kernel never ends. Least CPU (a few % of a core), but on the H100
  measured it was seen 130-360 µs late (median): the driver's wake-up from a blocking event
  alone was 58-157 µs.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "CHECK_PERIOD_S",
    "DeadlinePassed",
    "GpuWatcher",
    "fine_timer",
    "poll_work",
    "wait_future",
    "wait_gpu_work",
    "watcher_for",
]

# While waiting on a future, how often the caller's check runs (a fixed period, not a backoff):
# it bounds how late an error is seen when the completion signal itself never comes.
CHECK_PERIOD_S = 0.05
# A watcher thread with nothing to watch for this long exits (a new one starts on demand).
_IDLE_EXIT_S = 30.0


class DeadlinePassed(TimeoutError):
    """ncclguard's own deadline passed while waiting (as opposed to the backend giving up)."""


def wait_future(fut: torch.futures.Future, deadline: float, check: Callable[[], bool] | None = None) -> None:
    """Blocks until ``fut`` completes or ``deadline`` (``time.monotonic()``) passes.

    The calling thread sleeps on a ``threading.Event`` set by a done-callback of ``fut``: it
    wakes as soon as the thread that completes the future has run the callback, and spends no
    CPU meanwhile.

    Args:
        fut: the future to wait for.
        deadline: ``time.monotonic()`` value at which to give up.
        check: called every :data:`CHECK_PERIOD_S` while waiting; returning True ends the wait
            early (the caller learned by other means that the operation finished or failed).

    Raises:
        DeadlinePassed: the deadline passed first.
        Exception: the error ``fut`` was completed with.
    """
    if not fut.done():
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlinePassed("deadline passed")
            if done.wait(remaining if check is None else min(remaining, CHECK_PERIOD_S)):
                break
            if check is not None and check():
                return
    fut.value()  # raises the future's error, if it was completed with one


class GpuWatcher:
    """A daemon thread that sleeps in ``event.synchronize()`` on blocking CUDA events, one at a
    time in submission order, and completes each event's future when the GPU reached it.

    One watcher per group: ops of one group complete in order on its NCCL stream, and a hung op
    then holds up only its own group's watcher. Use :func:`watcher_for`.
    """

    def __init__(self, key: Any) -> None:
        self._key = key
        self._jobs: queue.SimpleQueue[tuple[Any, torch.futures.Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ncclguard-gpu-watcher", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> torch.futures.Future:
        """Returns a future completed (None) when ``event`` completes, or with the error of its
        ``synchronize()``. ``event`` needs only a blocking ``synchronize()`` method."""
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((event, fut))
        return fut

    def _run(self) -> None:
        while True:
            try:
                event, fut = self._jobs.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with _watchers_lock:  # watcher_for() hands out watchers under the same lock
                    if self._jobs.empty():
                        if _watchers.get(self._key) is self:
                            del _watchers[self._key]
                        return
                continue
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)
            else:
                fut.set_result(None)


_watchers_lock = threading.Lock()
_watchers: dict[Any, GpuWatcher] = {}


def watcher_for(key: Any, event: Any) -> torch.futures.Future:
    """Hands ``event`` to the watcher of ``key`` (started on demand) and returns its future."""
    with _watchers_lock:
        watcher = _watchers.get(key)
        if watcher is None:
            watcher = _watchers[key] = GpuWatcher(key)
        return watcher.watch(event)


def _blocking_wait() -> bool:
    """torch's blocking-wait mode for NCCL (``TORCH_NCCL_BLOCKING_WAIT``, or its deprecated alias)."""
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    return False


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_prctl_fn = _prctl() if sys.platform.startswith("linux") else None


@contextmanager
def fine_timer(slack_ns: int = 1000) -> Iterator[None]:
    """Lowers the calling thread's timer slack (Linux ``PR_SET_TIMERSLACK``) inside the block, so
    that a short ``time.sleep`` lasts what it asks for; restores it after. Elsewhere a no-op."""
    if _prctl_fn is None:
        yield
        return
    old = _prctl_fn(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _prctl_fn(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0)
    try:
        yield
    finally:
        if old > 0:
            _prctl_fn(_PR_SET_TIMERSLACK, old, 0, 0, 0)


def poll_work(work: Any, deadline: float, period_s: float) -> None:
    """Asks ``work.is_completed()`` every ``period_s`` (a fixed period) until it is, or the deadline.

    Raises:
        DeadlinePassed: the deadline passed first.
    """
    with fine_timer():
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise DeadlinePassed("deadline passed")
            time.sleep(period_s)


def wait_gpu_work(work: Any, deadline: float, key: Any, mode: str = "poll", period_s: float = 20e-6) -> None:
    """Waits for an NCCL ``work`` until ``deadline``; the current stream ends up ordered after it.

    Args:
        work: the collective's ``Work``.
        deadline: ``time.monotonic()`` value at which to give up.
        key: the watcher to use in ``"event"`` mode (the process group).
        mode: ``"poll"`` or ``"event"`` (see the module's doc).
        period_s: the polling period of ``"poll"`` mode.

    Raises:
        DeadlinePassed: the deadline passed first.
        Exception: the backend's error.
    """
    # With TORCH_NCCL_BLOCKING_WAIT, work.wait() itself blocks the CPU (polling at 1 ms): poll
    # first, and call wait() only once the work completed.
    if mode == "poll" or _blocking_wait():
        poll_work(work, deadline, period_s)
        work.wait()
        return
    work.wait()  # the current stream waits for the NCCL stream; the CPU does not wait
    event = torch.cuda.Event(blocking=True)
    event.record()
    wait_future(watcher_for(key, event), deadline, check=work.is_completed)
