"""The input pipeline: the main thread's time waiting for its next batch.

A rank whose data loader is slow reaches each collective late, exactly as a rank whose model computes
longer does: its peers wait for it, and its time outside collectives grows. What tells the two apart is
where the extra time went. torch's DataLoader hands out every batch through its iterator's ``__next__``
(the base iterator class that the single- and multi-process iterators inherit; reached through
``_torch_compat.dataloader_iter_class``), and every framework on top of it calls that (the HF Trainer, Accelerate's ``DataLoaderShard``,
Lightning's fetchers). :func:`time_dataloaders` wraps it once per process so that the main thread's
time inside it adds up in :data:`inputs`: the batch's production with ``num_workers=0``, the wait for a
worker's batch otherwise. A pipeline that is not a torch DataLoader says where its waits are with
``with input_wait(): batch = next(it)``. Nested timings count once (the outermost).

The cost on the training thread is two ``perf_counter`` calls and a thread check per batch.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import TorchCompatError

__all__ = ["InputClock", "input_wait", "inputs", "time_dataloaders", "untime_dataloaders"]


class InputClock:
    """The main thread's seconds in the input pipeline so far (read by the watchdog thread).

    Attributes:
        seconds: the total, growing.
        depth: timings open on the main thread (only the outermost counts).
        main: the ident of the thread whose waits count (the main thread; another thread's batches
            are its own business, as its collectives are).
    """

    __slots__ = ("depth", "main", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0
        self.main = threading.main_thread().ident

    def timed(self, fetch: Callable[[], Any]) -> Any:
        """``fetch()``, its time added to :attr:`seconds` when called from the main thread."""
        if threading.get_ident() != self.main or self.depth:
            return fetch()
        self.depth += 1
        t0 = time.perf_counter()
        try:
            return fetch()
        finally:
            self.seconds += time.perf_counter() - t0
            self.depth -= 1


inputs = InputClock()
_patch: dict[str, Any] = {}  # the iterator class and its own __next__, while wrapped
_lock = threading.Lock()


@contextmanager
def input_wait() -> Iterator[None]:
    """Counts the enclosed time as the input pipeline's (for a pipeline that is not a torch DataLoader)."""
    if threading.get_ident() != inputs.main or inputs.depth:
        yield
        return
    inputs.depth += 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        inputs.seconds += time.perf_counter() - t0
        inputs.depth -= 1


def time_dataloaders() -> bool:
    """Wraps torch's DataLoader iterator so that the main thread's waits for batches add up in
    :data:`inputs` (once per process; later calls do nothing).

    Returns:
        True when the iterator is wrapped; False where this torch has no such class (then no window
        carries an input time, and the input cause is never named).
    """
    with _lock:
        if _patch:
            return True
        try:
            cls = compat.dataloader_iter_class()
            original = cls.__dict__["__next__"]
        except TorchCompatError as exc:
            log.info("watchdog: straggler: the input pipeline is not timed (%s)", exc)
            return False

        @functools.wraps(original)
        def __next__(self: Any) -> Any:
            return inputs.timed(lambda: original(self))

        setattr(cls, "__next__", __next__)  # noqa: B010 - the class attribute, as torch defines it
        _patch.update(cls=cls, original=original)
        return True


def untime_dataloaders() -> None:
    """Puts torch's own ``__next__`` back (tests)."""
    with _lock:
        if _patch:
            setattr(_patch["cls"], "__next__", _patch["original"])  # noqa: B010
            _patch.clear()
