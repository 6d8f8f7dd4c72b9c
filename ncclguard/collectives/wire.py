"""What safe_all_reduce puts on the wire: chunks issued with a bounded number in flight, each
waited on against the call's deadline, through the tensor itself, a private buffer or a staging ring.

Torch cannot cancel a collective in flight: on gloo ``wait(timeout)`` gives up waiting but the op
stays queued and may still complete and write later. Hence the private buffer of ``atomic=True``
(dropped, never reused, after a failure) and the caller's duty to mark the group failed. The
buffers kept between calls are per world: a new world starts without, and the old world's are
released when the world changes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.collectives.chunking import logical_views
from ncclguard.collectives.completion import DeadlinePassed, wait_gpu_work
from ncclguard.collectives.groups import GroupInfo
from ncclguard.collectives.plan import CallShape
from ncclguard.config import get_config
from ncclguard.recording.flight import recorder
from ncclguard.world import Slot, World, WorldChange, current_world, subscribe

__all__ = [
    "CLOCK_SLACK_S",
    "DeadlinePassed",
    "WireFailure",
    "release_atomic_buffers",
    "retained_atomic_bytes",
    "run_chunks",
    "wait_work",
]


# How early a timed wait may return and still count as ours (timer granularity).
CLOCK_SLACK_S = 2e-3
# Bound once: wait_work is on safe_all_reduce's hot path, where the module attribute lookup costs.
_monotonic = time.monotonic


@dataclass(frozen=True)
class WireFailure:
    """How a chunked reduction failed.

    Attributes:
        chunk: index of the chunk being waited on (or issued) when it failed.
        exc: the exception: :class:`DeadlinePassed`, or the backend's error.
        at: ``time.monotonic()`` when it failed.
    """

    chunk: int
    exc: BaseException
    at: float


def wait_work(
    work: Any,
    deadline: float,
    backend: str,
    group: dist.ProcessGroup | None = None,
    wait_timeout: timedelta | None = None,
) -> None:
    """Waits for ``work`` until ``deadline``.

    Args:
        work: the collective's ``Work``.
        deadline: ``time.monotonic()`` value at which to give up.
        backend: the group's backend name.
        group: the process group (NCCL: whose watcher thread waits for the GPU).
        wait_timeout: gloo: the timeout to wait with instead of the time left (the hot path passes
            a cached timedelta of its whole deadline when it spent under a millisecond of it:
            building a timedelta costs more than that overrun matters).

    Raises:
        DeadlinePassed: the deadline passed first.
        Exception: the backend's error (a peer closed the connection, the backend's own timeout).
    """
    remaining = deadline - _monotonic()
    if remaining <= 0:
        raise DeadlinePassed("deadline passed")
    if backend == "nccl":
        # NCCL's wait() only orders streams; the CPU waits as ncclguard.collectives.completion says.
        config = get_config()
        wait_gpu_work(work, deadline, group, config.nccl_wait, config.nccl_poll_us * 1e-6)
        return
    try:
        work.wait(timeout=wait_timeout or timedelta(seconds=remaining))
    except Exception as exc:
        # gloo reports the end of our wait and its own timeout alike ("Timed out"): the clock
        # tells them apart. A wait that ended at our deadline is ours.
        if _monotonic() >= deadline - CLOCK_SLACK_S:
            raise DeadlinePassed(f"deadline passed ({exc})") from exc
        raise


class _PrivateBuffers:
    """One reusable flat buffer per (dtype, device) for ``atomic=True``.

    Allocating and first touching a tensor-sized buffer on every call cost more than the
    all_reduce itself (benchmarks/atomic_cost.py). A buffer is checked out for one call, so
    concurrent calls never share one, and dropped, never reused, after a failed call: the
    abandoned op may still write into it.
    """

    def __init__(self, world: World | None = None) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Checks out a flat buffer of at least ``numel`` elements: the kept one, or a new one."""
        with self._lock:
            buf = self._free.pop((dtype, device), None)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        """Keeps ``buf`` for the next call (a call that succeeded), unless a larger one is kept."""
        with self._lock:
            kept = self._free.get((buf.dtype, buf.device))
            if kept is None or kept.numel() < buf.numel():
                self._free[(buf.dtype, buf.device)] = buf

    def release(self) -> None:
        """Drops the kept buffers."""
        with self._lock:
            self._free.clear()

    def retained_bytes(self) -> int:
        """Bytes held between calls (the free buffers; a buffer checked out by a call in flight
        is not counted)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._free.values())


_BUFFERS: Slot[_PrivateBuffers] = Slot("atomic buffers", _PrivateBuffers)


def release_atomic_buffers() -> None:
    """Frees the buffers kept between ``atomic=True`` calls (one per dtype and device, as large as
    the largest tensor reduced atomically)."""
    current_world().get(_BUFFERS).release()


def retained_atomic_bytes() -> int:
    """Bytes that ``atomic=True`` keeps allocated between calls (what :func:`release_atomic_buffers` frees).

    Returns:
        The bytes held by the current world's buffers.
    """
    return current_world().get(_BUFFERS).retained_bytes()


def _release_old_buffers(change: WorldChange) -> None:
    """The old world's buffers serve no call any more (an op it abandoned may still write into a
    buffer it checked out, which was never given back)."""
    if change.old is not change.new:
        change.old.get(_BUFFERS).release()


subscribe(_release_old_buffers)


def _copy_range(dst: torch.Tensor, src: torch.Tensor, a: int, b: int, *, into_flat: bool) -> None:
    """Copies elements [a, b) of ``src`` (any layout) into flat ``dst``, or back when not ``into_flat``."""
    off = 0
    for v in logical_views(src, a, b):
        part = dst[off : off + v.numel()].view(v.shape)
        if into_flat:
            part.copy_(v)
        else:
            v.copy_(part)
        off += v.numel()


class _ChunkRun:
    """One run_chunks call's chunks: where they travel (a view of the tensor itself, a private copy
    or a staging ring; see run_chunks), issuing one, completing the oldest, publishing a private copy.
    """

    def __init__(self, info: GroupInfo, tensor: torch.Tensor, shape: CallShape, deadline: float, atomic: bool) -> None:
        self.info, self.tensor, self.shape, self.deadline = info, tensor, shape, deadline
        self.bounds = bounds = shape.bounds
        self.max_inflight = get_config().max_inflight
        self.chunk = bounds[0][1] - bounds[0][0]
        self.in_place = tensor.view(-1) if tensor.is_contiguous() and not atomic else None
        self.buffers = buffers = current_world().get(_BUFFERS) if atomic else None
        self.private = buffers.take(shape.numel, tensor.dtype, tensor.device) if buffers is not None else None
        self.staging: list[torch.Tensor] | None = [] if self.in_place is None and self.private is None else None
        self.inflight: deque[tuple[int, Any, torch.Tensor]] = deque()
        self.reduced = 0  # leading elements reduced in the tensor

    def issue(self, i: int) -> None:
        """Issues chunk ``i``: copied into its buffer first unless it travels in place."""
        a, b = self.bounds[i]
        tensor = self.tensor
        if self.in_place is not None:
            buf = self.in_place[a:b]
        else:
            if self.private is not None:
                buf = self.private[a:b]
            else:
                staging, max_inflight = self.staging, self.max_inflight
                assert staging is not None
                if len(staging) < max_inflight:
                    staging.append(torch.empty(self.chunk, dtype=tensor.dtype, device=tensor.device))
                buf = staging[i % max_inflight][: b - a]
            _copy_range(buf, tensor, a, b, into_flat=True)
        work = dist.all_reduce(buf, op=self.shape.wire_op, group=self.info.group, async_op=True)
        self.inflight.append((i, work, buf))

    def complete(self) -> None:
        """Waits for the oldest chunk in flight by the deadline, then finishes it (AVG's division,
        the copy back from the staging ring) and beats the record's heartbeat.

        Raises:
            DeadlinePassed: the deadline passed first.
            Exception: the backend's error.
        """
        info, tensor, bounds = self.info, self.tensor, self.bounds
        i, work, buf = self.inflight[0]
        wait_work(work, self.deadline, info.backend, info.group)
        self.inflight.popleft()
        if self.shape.avg_by_hand:
            buf.div_(info.size)
        if self.staging is not None:
            _copy_range(buf, tensor, *bounds[i], into_flat=False)
        self.reduced = bounds[i][1]
        recorder.progress_here(i + 1, len(bounds), self.reduced * tensor.element_size())  # heartbeat: chunk i of n

    def publish(self) -> None:
        """Atomic: copies the private copy into the tensor, every chunk completed, and gives the
        buffer back for the next call."""
        if self.private is not None and self.buffers is not None:
            self.tensor.copy_(self.private[: self.shape.numel].view(self.tensor.shape))
            self.buffers.give_back(self.private)


def run_chunks(
    info: GroupInfo,
    tensor: torch.Tensor,
    shape: CallShape,
    deadline: float,
    atomic: bool,
) -> tuple[int, WireFailure | None]:
    """Reduces ``tensor`` in the chunks of ``shape``, at most ``Config.max_inflight`` in flight,
    each waited on by ``deadline``, through the tensor itself (contiguous, not atomic), a private
    copy published only at the end (atomic) or a small staging ring (non-contiguous). (One chunk
    of a contiguous tensor, not atomic, is one op on the tensor: safe_all_reduce issues it itself.)

    Args:
        info: the group.
        tensor: the caller's tensor.
        shape: the call's shape (chunk bounds, the op on the wire, AVG by hand).
        deadline: ``time.monotonic()`` value at which to give up.
        atomic: reduce in a private buffer, copied into ``tensor`` only when every chunk completed.

    Returns:
        (leading elements reduced in ``tensor``, None) on success, or
        (leading elements reduced, the failure) on failure; with ``atomic`` the count is 0 and
        ``tensor`` is untouched.
    """
    run = _ChunkRun(info, tensor, shape, deadline, atomic)
    inflight, bounds = run.inflight, shape.bounds
    i = 0
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # staging copies and AVG's division are not autograd's business
    try:
        for i in range(len(bounds)):
            if len(inflight) >= run.max_inflight:
                run.complete()
            run.issue(i)
        while inflight:
            i = inflight[0][0]
            run.complete()
        run.publish()
    except Exception as exc:  # noqa: BLE001 - every backend error becomes a result
        # The private buffer is not given back: an abandoned op may still write into it.
        return (0 if atomic else run.reduced), WireFailure(inflight[0][0] if inflight else i, exc, time.monotonic())
    finally:
        torch.set_grad_enabled(grad_mode)
    return run.reduced, None
