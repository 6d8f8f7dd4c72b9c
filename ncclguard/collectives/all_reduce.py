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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.collectives.calls import Call, begin_call, check_tag, meet, postmortem
from ncclguard.collectives.chunking import chunk_bounds
from ncclguard.collectives.deadlines import (
    adaptive_timeout,
    check_below_group_timeout,
    default_deadline,
    to_seconds,
)
from ncclguard.collectives.groups import (
    BACKEND_DEVICES,
    GroupInfo,
    failure_of,
    group_info,
    group_timeout_s,
    mark_failed,
)
from ncclguard.collectives.wire import DeadlinePassed, release_atomic_buffers, run_chunks
from ncclguard.config import get_config
from ncclguard.diagnosis.flight import recorder
from ncclguard.errors import (
    CollectiveError,
    CollectiveFailed,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupFailed,
    NcclGuardError,
    StoreUnreachable,
)

__all__ = ["CollectiveResult", "forget_group_infos", "release_atomic_buffers", "safe_all_reduce"]

ReduceOp = dist.ReduceOp
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


_info_lock = threading.Lock()  # two threads may describe groups at once (safe_* on two groups)
_info_cache: weakref.WeakKeyDictionary[Any, GroupInfo] = weakref.WeakKeyDictionary()


def forget_group_infos() -> None:
    """Empties the cache of group descriptions. Each entry holds its group, so the cache alone
    keeps a group alive; ``ncclguard.rebuild_world`` calls this so abandoned groups can be freed."""
    with _info_lock:
        _info_cache.clear()


def _group(group: Any) -> GroupInfo | None:
    """group_info, cached per group object (the key is the group that ``info.group`` resolves to)."""
    try:
        cached = _info_cache.get(group if group is not None else dist.group.WORLD)
    except TypeError:  # None (no group yet) or the non-member sentinel: group_info explains
        cached = None
    if cached is not None:
        return cached
    info = group_info(group)
    if info is not None:
        with _info_lock:
            _info_cache[info.group] = info
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
    name = REDUCE_OP_NAMES.get(op) if isinstance(op, ReduceOp.RedOpType) else None
    if name is None:
        raise ValueError(f"unsupported op {op!r}; use one of ReduceOp.{', ReduceOp.'.join(REDUCE_OP_NAMES.values())}")
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


def safe_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    *,
    timeout: float | timedelta | None = None,
    chunk_numel: int | None = None,
    atomic: bool = False,
    verify: bool | None = None,
    tag: str | None = None,
) -> CollectiveResult:
    """All-reduces ``tensor`` in place with a deadline; never hangs.

    Args:
        tensor: any dense tensor (any shape, 0-d and empty included; contiguous or not).
        op: a ``torch.distributed.ReduceOp``. AVG works on gloo too (sum, then divide).
        group: the process group (default: the world). Without an initialized process group the
            call is a world of one: ok, tensor unchanged.
        timeout: seconds or timedelta for the whole call, from entry; must be below the group's
            own timeout. Default: by size (:func:`ncclguard.collectives.deadlines.adaptive_timeout`),
            capped below the group's timeout (:func:`ncclguard.collectives.deadlines.group_cap_s`).
        chunk_numel: elements per chunk; default from the size policy in :class:`ncclguard.Config`.
        atomic: on failure, leave the tensor bit for bit as it was (costs one copy of it, in a
            buffer kept between calls; see :func:`release_atomic_buffers`).
        verify: compare the kind of call, numel, dtype, op, device and chunking across ranks
            through the store before any data moves. None: only at or above the chunking
            threshold, or with a ``tag``. All ranks must pass the same value.
        tag: meet the ranks that pass the same tag, whatever their call counts (implies
            ``verify``); see :mod:`ncclguard.collectives.calls`.

    Returns:
        A :class:`CollectiveResult`; falsy with ``error`` set to a :class:`CollectiveTimeout`
        (ncclguard's deadline passed), :class:`CollectiveFailed` (the backend failed, or its own
        timeout ended the op first), :class:`CollectiveMismatch` or :class:`GroupFailed`.

    Raises:
        TypeError, ValueError: bad input (a timeout at or above the group's own timeout
            included), raised on the calling rank before any communication.
    """
    start = time.monotonic()
    info = _group(group)
    check_tag(tag)
    # The call takes its number before the input is checked: a call refused on one rank only
    # keeps the ranks' counts equal (see ncclguard.collectives.calls).
    call = begin_call(info, "all_reduce", tag) if info is not None and info.size > 1 else None
    _validate(tensor, op, chunk_numel, info.backend if info else None)
    group_timeout = group_timeout_s(info.group) if call is not None and info is not None else None
    numel, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
    if timeout is not None:
        timeout_s = to_seconds(timeout, "timeout")
        if info is not None:
            check_below_group_timeout(timeout_s, group_timeout, info.name)
    else:
        timeout_s = default_deadline(adaptive_timeout(numel, nbytes), group_timeout)
    opname = f"all_reduce({REDUCE_OP_NAMES[op]})"
    bounds = chunk_bounds(numel, chunk_numel)

    def result(ok: bool, reduced: int, error: NcclGuardError | None = None) -> CollectiveResult:
        return CollectiveResult(ok, opname, numel, nbytes, len(bounds), reduced, time.monotonic() - start, error)

    if call is None:
        return result(True, numel)
    info = call.info
    failed = failure_of(info.group)
    if failed is not None:
        return result(
            False, 0, GroupFailed(f"group {info.name!r} failed earlier ({failed}); make a new group to go on")
        )

    dtype = dtype_name(tensor.dtype)
    rec = recorder.start(opname, info.name, numel, dtype)
    try:
        reduced, err = _reduce(
            call,
            tensor,
            op,
            bounds,
            start,
            timeout_s,
            group_timeout,
            atomic,
            verify or tag is not None or (verify is None and numel >= get_config().chunk_direct_below),
            dict(op=opname, numel=numel, dtype=dtype, group=info.name),
        )
    except BaseException as exc:  # KeyboardInterrupt too: an open record would read as a hang
        recorder.finish(rec, f"interrupted: {exc!r}")
        raise
    recorder.finish(rec, err)
    return result(err is None, reduced, err)


def _reduce(
    call: Call,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    start: float,
    timeout_s: float,
    group_timeout: float | None,
    atomic: bool,
    verify: bool,
    fields: dict[str, Any],
) -> tuple[int, CollectiveError | None]:
    """The checked, chunked reduction. Returns (leading elements reduced, error or None)."""
    info = call.info
    deadline = start + timeout_s
    if verify:
        error = _check_fingerprints(call, tensor, op, bounds, deadline, start, fields)
        if error is not None:
            log.warning("%s", error)
            return 0, error

    reduced, failure = run_chunks(info, tensor, op, bounds, deadline, atomic)
    if failure is None:
        return reduced, None

    # The communicator cannot be trusted any more: the abandoned op may still be queued.
    gave_up_s = failure.at - start
    pm = postmortem(call, start + timeout_s + 0.9)
    if isinstance(failure.exc, DeadlinePassed):
        cls: type[CollectiveError] = CollectiveTimeout
        what = f"timed out after {gave_up_s:.2f} s (deadline {timeout_s:g} s)"
    else:
        cls = CollectiveFailed
        what = f"failed after {gave_up_s:.2f} s: {_backend_failure(failure.exc, info, group_timeout, timeout_s)}"
    who = f"; ranks {pm.missing} never arrived" if pm.missing else ""
    why = "" if cls is CollectiveTimeout else _backend_timeout_hint(failure.exc)
    err = cls(
        f"{fields['op']} of {fields['numel']} x {fields['dtype']} on group {info.name!r} {what} at chunk "
        f"{failure.chunk + 1}/{len(bounds)}{who}{pm.describe()}{why}",
        chunk=(failure.chunk, len(bounds)),
        elapsed_s=time.monotonic() - start,
        missing_ranks=pm.missing,
        **fields,
    )
    err.__cause__ = failure.exc
    mark_failed(info.group, err)
    log.error("%s", err)
    return reduced, err


def _is_backend_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def _backend_failure(exc: BaseException, info: GroupInfo, group_timeout: float | None, timeout_s: float) -> str:
    """The backend's error in words; says so when it was the backend's own timeout that ended the op."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _is_backend_timeout(exc):
        limit = f"{group_timeout:g} s" if group_timeout is not None else "unknown"
        return (
            f"the {info.backend} backend's own timeout (group timeout {limit}) ended it before ncclguard's "
            f"deadline ({timeout_s:g} s) ({text})"
        )
    return text


def _backend_timeout_hint(exc: BaseException) -> str:
    if not _is_backend_timeout(exc):
        return ""
    return (
        ". An op queued on the group before this call (by other code) runs against the backend's timeout "
        "from its own start"
    )


def _check_fingerprints(
    call: Call,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    deadline: float,
    start: float,
    fields: dict[str, Any],
) -> CollectiveError | None:
    info = call.info
    mine = call.print(
        numel=tensor.numel(),
        dtype=dtype_name(tensor.dtype),
        op=REDUCE_OP_NAMES[op],
        device=tensor.device.type,
        chunks=[len(bounds), bounds[0][1] - bounds[0][0]],
    )
    try:
        met = meet(call, mine, deadline)
    except StoreUnreachable as exc:
        return CollectiveFailed(f"fingerprint check failed: {exc}", elapsed_s=time.monotonic() - start, **fields)
    where = f"{fields['op']} at {call.site} on group {info.name!r}"
    if met.mismatch is not None and not met.missing:
        return CollectiveMismatch(
            f"{where}: {met.mismatch}",
            fingerprints=met.prints,
            elapsed_s=time.monotonic() - start,
            **fields,
        )
    if not met.ok:
        if met.late:
            message = f"{where}: arrived after the other ranks gave up"
        else:
            pm = postmortem(call, deadline + get_config().postmortem_grace_s)
            message = (
                f"{where}: ranks {met.missing} did not reach the call within {deadline - start:g} s{pm.describe()}"
            )
        if met.mismatch is not None:
            message += f"; of those that came, {met.mismatch}"
        return CollectiveTimeout(message, elapsed_s=time.monotonic() - start, missing_ranks=met.missing, **fields)
    return None
