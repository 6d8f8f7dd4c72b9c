"""safe_all_reduce: an all_reduce with a deadline, size-based chunking and a cross-rank check.

Failure model (docs/collectives.md has the long form):
- the call returns, on every rank that entered, by its deadline plus the post-mortem grace;
- a timeout or backend error marks the group failed: torch cannot cancel a collective that is
  in flight (on gloo, ``wait(timeout)`` gives up waiting but the op stays queued and may still
  complete and write later), so later safe_* calls on that group refuse at once;
- with ``atomic=True`` the reduction runs in a private buffer (kept between calls, dropped after a
  failure) and is copied into the tensor only when every chunk completed, so a late write can
  never touch the caller's tensor.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.collectives.chunking import chunk_bounds, logical_views
from ncclguard.collectives.deadlines import adaptive_timeout, to_seconds
from ncclguard.collectives.groups import BACKEND_DEVICES, GroupInfo, failure_of, group_info, mark_failed
from ncclguard.collectives.rendezvous import StoreUnreachable, exchange, next_round
from ncclguard.config import get_config
from ncclguard.diagnosis.flight import recorder
from ncclguard.errors import (
    CollectiveError,
    CollectiveFailed,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupFailed,
    NcclGuardError,
)

__all__ = ["CollectiveResult", "release_atomic_buffers", "safe_all_reduce"]

ReduceOp = dist.ReduceOp
_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.AVG: "AVG",
    ReduceOp.PRODUCT: "PRODUCT",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
}
_NEEDS_DTYPE_CHECK = frozenset({"AVG", "MIN", "MAX", "BAND", "BOR", "BXOR"})


@dataclass
class CollectiveResult:
    """The outcome of a safe collective; truthy when it completed on this rank.

    Attributes:
        ok: the collective completed and the tensor holds the reduced values.
        op: the operation, e.g. ``"all_reduce(SUM)"``.
        numel: elements of the tensor.
        nbytes: bytes of the tensor.
        chunks: chunks the call was cut into.
        reduced_numel: leading elements (row-major) that hold reduced values. After a failure
            without ``atomic`` the elements past it are undefined; with ``atomic`` it is 0 and the
            tensor holds its original values.
        elapsed_s: seconds from entry to return.
        error: why it failed, or None.
    """

    ok: bool
    op: str
    numel: int
    nbytes: int
    chunks: int
    reduced_numel: int
    elapsed_s: float
    error: NcclGuardError | None = None

    def __bool__(self) -> bool:
        return self.ok

    def raise_for_error(self) -> CollectiveResult:
        """Raises :attr:`error` if the call failed; returns self otherwise (for chaining)."""
        if self.error is not None:
            raise self.error
        return self


_info_cache: weakref.WeakKeyDictionary[Any, GroupInfo] = weakref.WeakKeyDictionary()


def _group(group: Any) -> GroupInfo | None:
    key = group if group is not None else dist.group.WORLD
    try:
        cached = _info_cache.get(key)
    except TypeError:  # not weak-referenceable: the non-member sentinel; group_info explains
        cached = None
    if cached is not None:
        return cached
    info = group_info(group)
    if info is not None:
        _info_cache[info.group if key is None else key] = info
    return info


def _validate(tensor: Any, op: Any, chunk_numel: Any, backend: str | None) -> None:
    """Every check that can be made without talking to another rank. Raises TypeError/ValueError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"safe_all_reduce needs a torch.Tensor, got {type(tensor).__name__}; wrap data with torch.as_tensor(...)"
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"safe_all_reduce needs a dense tensor, got layout {tensor.layout}; call tensor.to_dense() first"
        )
    name = _OPS.get(op) if isinstance(op, ReduceOp.RedOpType) else None
    if name is None:
        raise ValueError(f"unsupported op {op!r}; use one of ReduceOp.{', ReduceOp.'.join(_OPS.values())}")
    if name in _NEEDS_DTYPE_CHECK:  # SUM, PRODUCT: every dtype; the others are checked below
        dt = tensor.dtype
        if name == "AVG" and not (dt.is_floating_point or dt.is_complex) and backend != "nccl":
            raise TypeError(
                f"ReduceOp.AVG on {dt} would truncate; reduce with ReduceOp.SUM and divide, or convert to a floating dtype"
            )
        if name in ("BAND", "BOR", "BXOR") and (dt.is_floating_point or dt.is_complex):
            raise TypeError(f"ReduceOp.{name} needs an integer or bool tensor, got {dt}")
        if name in ("MIN", "MAX") and dt.is_complex:
            raise TypeError(f"ReduceOp.{name} is not defined for complex tensors ({dt}); reduce .real/.imag or .abs()")
    if chunk_numel is not None and (
        isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0
    ):
        raise ValueError(f"chunk_numel must be a positive int (elements per chunk), got {chunk_numel!r}")
    if backend is not None:
        devices = BACKEND_DEVICES.get(backend)
        if devices is not None and tensor.device.type not in devices:
            raise ValueError(
                f"the tensor is on {tensor.device.type!r} but the group's backend {backend!r} moves "
                f"only {sorted(devices)} tensors; move it first, e.g. tensor.to('{sorted(devices)[0]}')"
            )


def _wait(work: Any, deadline: float, backend: str) -> None:
    """Waits for ``work`` until ``deadline``; raises TimeoutError or the backend's error."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    if backend == "nccl":
        # NCCL's wait() only orders streams; the CPU must poll to keep its deadline.
        pause = 5e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TimeoutError("deadline passed")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        work.wait()
        return
    work.wait(timeout=timedelta(seconds=remaining))


def safe_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    *,
    timeout: float | timedelta | None = None,
    chunk_numel: int | None = None,
    atomic: bool = False,
    verify: bool | None = None,
) -> CollectiveResult:
    """All-reduces ``tensor`` in place with a deadline; never hangs.

    Args:
        tensor: any dense tensor (any shape, 0-d and empty included; contiguous or not).
        op: a ``torch.distributed.ReduceOp``. AVG works on gloo too (sum, then divide).
        group: the process group (default: the world). Without an initialized process group the
            call is a world of one: ok, tensor unchanged.
        timeout: seconds or timedelta for the whole call, from entry. Default: by size, see
            :func:`ncclguard.env.hierarchy.adaptive_timeout`.
        chunk_numel: elements per chunk; default from the size policy in :class:`ncclguard.Config`.
        atomic: on failure, leave the tensor bit for bit as it was (costs one copy of it, in a
            buffer kept between calls; see :func:`release_atomic_buffers`).
        verify: compare numel, dtype, op, device and chunking across ranks through the store
            before any data moves. None: only at or above the chunking threshold. All ranks
            must pass the same value.

    Returns:
        A :class:`CollectiveResult`; falsy with ``error`` set to a :class:`CollectiveTimeout`,
        :class:`CollectiveFailed`, :class:`CollectiveMismatch` or :class:`GroupFailed`.

    Raises:
        TypeError, ValueError: bad input, raised on the calling rank before any communication.
    """
    start = time.monotonic()
    if timeout is not None:
        timeout_s = to_seconds(timeout, "timeout")
    info = _group(group)
    _validate(tensor, op, chunk_numel, info.backend if info else None)
    numel, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
    opname = f"all_reduce({_OPS[op]})"
    if timeout is None:
        timeout_s = adaptive_timeout(numel, nbytes)
    bounds = chunk_bounds(numel, chunk_numel)

    def result(ok: bool, reduced: int, error: NcclGuardError | None = None) -> CollectiveResult:
        return CollectiveResult(ok, opname, numel, nbytes, len(bounds), reduced, time.monotonic() - start, error)

    if info is None or info.size == 1:
        return result(True, numel)
    failed = failure_of(info.group)
    if failed is not None:
        return result(
            False, 0, GroupFailed(f"group {info.name!r} failed earlier ({failed}); make a new group to go on")
        )

    dtype = str(tensor.dtype).removeprefix("torch.")
    rec = recorder.start(opname, info.name, numel, dtype)
    try:
        reduced, err = _reduce(
            info,
            tensor,
            op,
            bounds,
            start,
            timeout_s,
            atomic,
            verify,
            dict(op=opname, numel=numel, dtype=dtype, group=info.name),
        )
    except BaseException as exc:  # KeyboardInterrupt too: an open record would read as a hang
        recorder.finish(rec, f"interrupted: {exc!r}")
        raise
    recorder.finish(rec, err)
    return result(err is None, reduced, err)


def _reduce(
    info: GroupInfo,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    start: float,
    timeout_s: float,
    atomic: bool,
    verify: bool | None,
    fields: dict[str, Any],
) -> tuple[int, CollectiveError | None]:
    """The checked, chunked reduction. Returns (leading elements reduced, error or None)."""
    deadline = start + timeout_s
    call = next_round(info, "all_reduce")
    if verify or (verify is None and tensor.numel() >= get_config().chunk_direct_below):
        error = _check_fingerprints(info, call, tensor, op, bounds, deadline, start, fields)
        if error is not None:
            log.warning("%s", error)
            return 0, error

    reduced, failure = _run_chunks(info, tensor, op, bounds, deadline, atomic)
    if failure is None:
        return reduced, None

    # The communicator cannot be trusted any more: the abandoned op may still be queued.
    chunk_index, exc, timed_out = failure
    gave_up_s = time.monotonic() - start
    missing = _postmortem(info, call, start + timeout_s + 0.9)
    cls = CollectiveTimeout if timed_out else CollectiveFailed
    what = f"timed out after {gave_up_s:.2f} s (deadline {timeout_s:g} s)" if timed_out else f"failed: {exc}"
    who = f"; ranks {missing} never arrived" if missing else ""
    err = cls(
        f"{fields['op']} of {fields['numel']} x {fields['dtype']} on group {info.name!r} {what} at chunk "
        f"{chunk_index + 1}/{len(bounds)}{who}",
        chunk=(chunk_index, len(bounds)),
        elapsed_s=time.monotonic() - start,
        missing_ranks=missing,
        **fields,
    )
    mark_failed(info.group, err)
    log.error("%s", err)
    return reduced, err


def _check_fingerprints(
    info: GroupInfo,
    call: str,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    deadline: float,
    start: float,
    fields: dict[str, Any],
) -> CollectiveError | None:
    mine = {
        "numel": tensor.numel(),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "op": _OPS[op],
        "device": tensor.device.type,
        "chunks": [len(bounds), bounds[0][1] - bounds[0][0]],
    }
    try:
        rnd = exchange(info, f"{call}/fp", mine, deadline)
    except StoreUnreachable as exc:
        return CollectiveFailed(f"fingerprint check failed: {exc}", elapsed_s=time.monotonic() - start, **fields)
    if not rnd.ok:
        missing = [info.global_rank(r) for r in rnd.missing]
        return CollectiveTimeout(
            f"{fields['op']} on group {info.name!r}: ranks {missing} did not reach the call within "
            f"{deadline - start:g} s"
            if missing
            else f"{fields['op']} on group {info.name!r}: arrived after the other ranks gave up",
            elapsed_s=time.monotonic() - start,
            missing_ranks=missing,
            **fields,
        )
    prints = {info.global_rank(r): p for r, p in sorted(rnd.payloads.items())}
    if any(p != mine for p in prints.values()):
        listing = "; ".join(f"rank {r}: {p}" for r, p in prints.items())
        return CollectiveMismatch(
            f"{fields['op']} on group {info.name!r}: ranks disagree, nothing was sent ({listing})",
            fingerprints=prints,
            elapsed_s=time.monotonic() - start,
            **fields,
        )
    return None


class _PrivateBuffers:
    """One reusable flat buffer per (dtype, device) for ``atomic=True``.

    Allocating and first touching a tensor-sized buffer on every call cost more than the
    all_reduce itself (benchmarks/atomic_cost.py). A buffer is checked out for one call, so
    concurrent calls never share one, and dropped, never reused, after a failed call: the
    abandoned op may still write into it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            buf = self._free.pop((dtype, device), None)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            kept = self._free.get((buf.dtype, buf.device))
            if kept is None or kept.numel() < buf.numel():
                self._free[(buf.dtype, buf.device)] = buf

    def release(self) -> None:
        with self._lock:
            self._free.clear()


_private = _PrivateBuffers()


def release_atomic_buffers() -> None:
    """Frees the buffers kept between ``atomic=True`` calls (one per dtype and device, as large as
    the largest tensor reduced atomically)."""
    _private.release()


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


def _run_chunks(
    info: GroupInfo,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    deadline: float,
    atomic: bool,
) -> tuple[int, tuple[int, BaseException, bool] | None]:
    """Issues the chunks with a bounded number in flight.

    Returns:
        (leading elements reduced in ``tensor``, None) on success, or
        (leading elements reduced, (chunk index, exception, timed out)) on failure.
    """
    avg_by_hand = op == ReduceOp.AVG and info.backend != "nccl"
    wire_op = ReduceOp.SUM if avg_by_hand else op
    numel = tensor.numel()
    if len(bounds) == 1 and not atomic and tensor.is_contiguous():
        # The common small call: the tensor itself on the wire, none of the chunk machinery.
        try:
            _wait(dist.all_reduce(tensor, op=wire_op, group=info.group, async_op=True), deadline, info.backend)
        except Exception as exc:  # noqa: BLE001 - every backend error becomes a result
            return 0, (0, exc, _is_timeout(exc, deadline))
        if avg_by_hand:
            with torch.no_grad():
                tensor.div_(info.size)
        return numel, None

    # Where each chunk travels: a view of the tensor itself (contiguous, not atomic), a slice of a
    # private copy published only at the end (atomic), or a small staging ring (non-contiguous).
    max_inflight = get_config().max_inflight
    chunk = bounds[0][1] - bounds[0][0]
    in_place = tensor.view(-1) if tensor.is_contiguous() and not atomic else None
    private = _private.take(numel, tensor.dtype, tensor.device) if atomic else None
    staging = [] if in_place is None and private is None else None
    inflight: deque[tuple[int, Any, torch.Tensor]] = deque()
    reduced = 0

    def issue(i: int) -> None:
        a, b = bounds[i]
        if in_place is not None:
            buf = in_place[a:b]
        else:
            if private is not None:
                buf = private[a:b]
            else:
                if len(staging) < max_inflight:
                    staging.append(torch.empty(chunk, dtype=tensor.dtype, device=tensor.device))
                buf = staging[i % max_inflight][: b - a]
            _copy_range(buf, tensor, a, b, into_flat=True)
        inflight.append((i, dist.all_reduce(buf, op=wire_op, group=info.group, async_op=True), buf))

    def complete() -> None:
        nonlocal reduced
        i, work, buf = inflight[0]
        _wait(work, deadline, info.backend)
        inflight.popleft()
        if avg_by_hand:
            buf.div_(info.size)
        if staging is not None:
            _copy_range(buf, tensor, *bounds[i], into_flat=False)
        reduced = bounds[i][1]

    i = 0
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # staging copies and AVG's division are not autograd's business
    try:
        for i in range(len(bounds)):
            if len(inflight) >= max_inflight:
                complete()
            issue(i)
        while inflight:
            i = inflight[0][0]
            complete()
        if private is not None:
            tensor.copy_(private[:numel].view(tensor.shape))
            _private.give_back(private)
    except Exception as exc:  # noqa: BLE001 - every backend error becomes a result
        # The private buffer is not given back: an abandoned op may still write into it.
        return (0 if atomic else reduced), (inflight[0][0] if inflight else i, exc, _is_timeout(exc, deadline))
    finally:
        torch.set_grad_enabled(grad_mode)
    return reduced, None


def _is_timeout(exc: BaseException, deadline: float) -> bool:
    return isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or time.monotonic() >= deadline


def _postmortem(info: GroupInfo, call: str, give_up_at: float) -> list[int] | None:
    """After a failure, learns through the store which ranks never reached this call.

    Every rank that gives up publishes itself; a rank still absent after a short grace never
    arrived. Returns global ranks (sorted), or None when the store did not answer.
    """
    grace = min(get_config().postmortem_grace_s, give_up_at - time.monotonic())
    try:
        rnd = exchange(info, f"{call}/pm", {}, time.monotonic() + max(grace, 0.0))
    except StoreUnreachable:
        return None
    return sorted(info.global_rank(r) for r in rnd.missing)
