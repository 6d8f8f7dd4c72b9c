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

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import _DTYPE_NAMES, REDUCE_OP_NAMES, dtype_name
from ncclguard.collectives.calls import Call, begin_call, check_tag
from ncclguard.collectives.chunking import chunk_bounds
from ncclguard.collectives.groups import (
    BACKEND_DEVICES,
    GroupInfo,
    GroupState,
    cached_state,
    failure_of,
    group_state,
)
from ncclguard.collectives.rendezvous import call_count, take_number
from ncclguard.collectives.verdicts import check_fingerprints, wire_error
from ncclguard.collectives.wire import (
    CLOCK_SLACK_S,
    DeadlinePassed,
    WireFailure,
    release_atomic_buffers,
    retained_atomic_bytes,
    run_chunks,
    wait_work,
)
from ncclguard.config import Config, get_config
from ncclguard.deadlines import (
    adaptive_timeout,
    check_below_group_timeout,
    default_deadline,
    to_seconds,
)
from ncclguard.errors import (
    CollectiveError,
    GroupFailed,
    NcclGuardError,
)
from ncclguard.recording.flight import recorder

__all__ = [
    "CollectiveResult",
    "forget_group_infos",
    "release_atomic_buffers",
    "retained_atomic_bytes",
    "safe_all_reduce",
]

ReduceOp = dist.ReduceOp
_NEEDS_DTYPE_CHECK = frozenset({"AVG", "MIN", "MAX", "BAND", "BOR", "BXOR"})
# Bound once for the hot path (attribute lookups on torch's modules cost there).
_monotonic = time.monotonic
_Tensor = torch.Tensor
_RedOpType = ReduceOp.RedOpType
_strided = torch.strided
_world = compat.world()  # torch's _World: default_pg is the group that None stands for
_TORCH_ALL_REDUCE = dist.all_reduce  # torch's own, bound at import (instrument() replaces dist.all_reduce)
# The hot path waits with its whole deadline (a cached timedelta) when it spent less than this of
# it before the wait: the wait then overruns the deadline by less than this.
_REUSE_WAIT_S = 1e-3
# Ops the hot path takes: valid for every dtype on every backend, so no dtype check is needed.
_FAST_OPS: dict[Any, str] = {ReduceOp.SUM: "all_reduce(SUM)", ReduceOp.PRODUCT: "all_reduce(PRODUCT)"}


@dataclass(slots=True)
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


def forget_group_infos() -> None:
    """Nothing to do: the group states belong to the world (:data:`~ncclguard.collectives.groups.GROUPS`),
    and a rebuilt world starts without them."""


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
            own timeout. Default: by size (:func:`ncclguard.deadlines.adaptive_timeout`),
            capped below the group's timeout (:func:`ncclguard.deadlines.group_cap_s`).
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
    start = _monotonic()
    # The hot path: a small contiguous tensor, an op valid for every dtype, nothing asked for that
    # needs the chunk machinery or a store round. It makes every check of the general path, in
    # fewer steps, and does what is not needed before the collective (its number, the default
    # deadline) after issuing it, while the backend works. benchmarks/small_call_cost.py times it.
    try:
        state = cached_state(_world.default_pg if group is None else group)
    except (TypeError, AttributeError):  # an unhashable group (group_info explains), or no _world yet
        state = None
    if (
        state is not None
        and chunk_numel is None
        and not atomic
        and not verify
        and tag is None
        and type(tensor) is _Tensor
        and type(op) is _RedOpType
        and (opname := _FAST_OPS.get(op)) is not None
        and tensor.layout is _strided
        and state.multi
        and ((state.cpu_ok and tensor.is_cpu) or (state.cuda_ok and tensor.is_cuda))
        and tensor.is_contiguous()
    ):
        config = get_config()
        numel = tensor.numel()
        if numel < config.chunk_direct_below:
            if (
                timeout is not None
                or state.failed is not None
                or state.nccl
                or dist.all_reduce is not _TORCH_ALL_REDUCE
            ):
                return _fast(state, tensor, op, opname, numel, start, timeout, config)
            # The hottest case, inline: default deadline, gloo, nothing wrapping dist.all_reduce.
            info = state.info
            number = rec = None
            try:
                work = _TORCH_ALL_REDUCE(tensor, op=op, group=info.group, async_op=True)
                # While the backend works: the call's number, its flight record, the deadline.
                base, counter = state.count.current
                number = (base, next(counter))
                dtype = tensor.dtype
                rec = recorder.start(opname, info.name, numel, _DTYPE_NAMES.get(dtype) or dtype_name(dtype))
                nbytes = numel * tensor.element_size()
                timeout_s = state.default_deadline(numel, nbytes, config, start)
                if _monotonic() - start < _REUSE_WAIT_S:
                    work.wait(timeout=state.whole_wait(timeout_s))
                else:
                    wait_work(work, start + timeout_s, info.backend, info.group)
            except BaseException as exc:  # noqa: BLE001 - a backend error becomes a result
                return _fast_failed(state, tensor, opname, numel, start, config, number, rec, exc)
            recorder.finish(rec)
            return CollectiveResult(True, opname, numel, nbytes, 1, numel, _monotonic() - start)
    return _general(tensor, op, group, start, timeout, chunk_numel, atomic, verify, tag)


def _fast(
    state: GroupState,
    tensor: torch.Tensor,
    op: Any,
    opname: str,
    numel: int,
    start: float,
    timeout: Any,
    config: Config,
) -> CollectiveResult:
    """safe_all_reduce's direct path (see there) with an explicit timeout, on a failed group, on
    NCCL, or under a wrapper of ``dist.all_reduce``: one collective on the tensor itself."""
    info = state.info
    timeout_s = None
    if timeout is not None:
        try:
            timeout_s = to_seconds(timeout, "timeout")
            check_below_group_timeout(timeout_s, state.timeout_s(), info.name)
        except (TypeError, ValueError):
            take_number(state.count)  # a refused call takes its number too (see calls.py)
            raise
    if state.failed is not None:
        take_number(state.count)
        return _refused(info, state.failed, opname, numel, numel * tensor.element_size(), start)
    number: tuple[str, int] | None = None
    rec = None
    try:
        # The flight record is opened right after the issue, while the backend works. A wrapper
        # (instrument()'s) would record the op itself unless a record is open, so when
        # dist.all_reduce is not torch's own function, it is opened first, as in the general path.
        issue = dist.all_reduce
        if issue is not _TORCH_ALL_REDUCE:
            rec = recorder.start(opname, info.name, numel, dtype_name(tensor.dtype))
        work = issue(tensor, op=op, group=info.group, async_op=True)
        number = take_number(state.count)
        if rec is None:
            rec = recorder.start(opname, info.name, numel, dtype_name(tensor.dtype))
        if timeout_s is None:
            timeout_s = state.default_deadline(numel, numel * tensor.element_size(), config, _monotonic())
        wait_work(work, start + timeout_s, info.backend, info.group)
    except BaseException as exc:  # noqa: BLE001 - a backend error becomes a result
        return _fast_failed(state, tensor, opname, numel, start, config, number, rec, exc, timeout_s)
    recorder.finish(rec)
    return CollectiveResult(True, opname, numel, numel * tensor.element_size(), 1, numel, _monotonic() - start)


def _fast_failed(
    state: GroupState,
    tensor: torch.Tensor,
    opname: str,
    numel: int,
    start: float,
    config: Config,
    number: tuple[str, int] | None,
    rec: Any,
    exc: BaseException,
    timeout_s: float | None = None,
) -> CollectiveResult:
    """The direct paths' failure: the result of a backend error or a passed deadline (the group is
    marked failed); anything else (KeyboardInterrupt) closes the record and is raised again."""
    info = state.info
    at = _monotonic()
    if number is None:
        number = take_number(state.count)
    dtype = dtype_name(tensor.dtype)
    if not isinstance(exc, Exception):  # an open record would read as a hang
        if rec is not None:
            recorder.finish(rec, f"interrupted: {exc!r}")
        raise exc
    if rec is None:
        rec = recorder.start(opname, info.name, numel, dtype)
    nbytes = numel * tensor.element_size()
    if timeout_s is None:
        timeout_s = state.default_deadline(numel, nbytes, config, _monotonic())
    if not isinstance(exc, DeadlinePassed) and at >= start + timeout_s - CLOCK_SLACK_S:
        # gloo reports the end of our wait and its own timeout alike: a wait that ended at our
        # deadline is ours (as wire.wait_work decides).
        exc = DeadlinePassed(f"deadline passed ({exc})")
    call = Call(info, "all_reduce", base=number[0], n=number[1])
    fields = dict(op=opname, numel=numel, dtype=dtype, group=info.name)
    err = wire_error(call, WireFailure(0, exc, at), 1, start, timeout_s, state.timeout_s(), fields)
    recorder.finish(rec, err)
    return CollectiveResult(False, opname, numel, nbytes, 1, 0, _monotonic() - start, err)


def _refused(
    info: GroupInfo, failed: Exception, opname: str, numel: int, nbytes: int, start: float
) -> CollectiveResult:
    """The result of a call on a group that failed earlier (nothing was sent)."""
    error = GroupFailed(f"group {info.name!r} failed earlier ({failed}); make a new group to go on")
    return CollectiveResult(False, opname, numel, nbytes, 1, 0, _monotonic() - start, error)


def _general(
    tensor: Any,
    op: Any,
    group: Any,
    start: float,
    timeout: float | timedelta | None,
    chunk_numel: Any,
    atomic: bool,
    verify: bool | None,
    tag: str | None,
) -> CollectiveResult:
    """Every case: chunks, atomic, verify, tags, any op, any layout, a world of one."""
    state = group_state(group, call_count)
    info = state.info if state is not None else None
    check_tag(tag)
    # The call takes its number before the input is checked: a call refused on one rank only
    # keeps the ranks' counts equal (see ncclguard.collectives.calls).
    call = begin_call(info, "all_reduce", tag) if info is not None and info.size > 1 else None
    _validate(tensor, op, chunk_numel, info.backend if info else None)
    group_timeout = state.timeout_s() if call is not None and state is not None else None
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
        return CollectiveResult(ok, opname, numel, nbytes, len(bounds), reduced, _monotonic() - start, error)

    if call is None:
        return result(True, numel)
    info = call.info
    failed = failure_of(info.group)
    if failed is not None:
        return _refused(info, failed, opname, numel, nbytes, start)

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
    deadline = start + timeout_s
    if verify:
        error = check_fingerprints(call, tensor, op, bounds, deadline, start, fields)
        if error is not None:
            log.warning("%s", error)
            return 0, error

    reduced, failure = run_chunks(call.info, tensor, op, bounds, deadline, atomic)
    if failure is None:
        return reduced, None
    return reduced, wire_error(call, failure, len(bounds), start, timeout_s, group_timeout, fields)
