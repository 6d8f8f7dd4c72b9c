"""safe_all_reduce: an all_reduce with a deadline, size-based chunking and a cross-rank check.

Failure model (docs/collectives.md has the long form):
- the call returns, on every rank that entered, by its deadline plus the post-mortem grace;
- a timeout or backend error marks the group failed: torch cannot cancel a collective that is
  in flight (on gloo, ``wait(timeout)`` gives up waiting but the op stays queued and may still
  complete and write later), so later safe_* calls on that group refuse at once;
- with ``atomic=True`` the reduction runs in a private buffer (kept between calls, dropped after a
  failure) and is copied into the tensor only when every chunk completed, so a late write can
  never touch the caller's tensor;
- with the input check (``check_finite``, off by default: ``Config.check_finite``), a NaN or an
  infinity in any rank's input fails the call on every rank before any data moves, naming the
  ranks (docs/numerics.md).
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
from ncclguard._naming import REDUCE_OP_NAMES
from ncclguard.collectives import groups as _groups
from ncclguard.collectives import plan as _plans
from ncclguard.collectives.calls import Call, begin_call, check_tag
from ncclguard.collectives.chunking import chunk_bounds
from ncclguard.collectives.failures import check_fingerprints, wire_error
from ncclguard.collectives.finite import nonfinite_kind
from ncclguard.collectives.groups import failure_of, no_group_reason
from ncclguard.collectives.plan import CallShape, GroupPlan, check_input, forget_plans, plan_for
from ncclguard.collectives.wire import (
    WireFailure,
    release_atomic_buffers,
    retained_atomic_bytes,
    run_chunks,
    wait_work,
)
from ncclguard.config import get_config
from ncclguard.deadlines import check_below_group_timeout, to_seconds
from ncclguard.errors import CollectiveError, GroupFailed, NcclGuardError, NonFiniteInput
from ncclguard.recording.flight import doors, recorder
from ncclguard.results import Result

__all__ = [
    "CollectiveResult",
    "forget_group_infos",
    "release_atomic_buffers",
    "retained_atomic_bytes",
    "safe_all_reduce",
]

ReduceOp = dist.ReduceOp
# Bound once for the hot path (attribute lookups on torch's modules cost there).
_monotonic = time.monotonic
# torch's _World's attributes: "_default_pg" is the group that None stands for (its property
# default_pg, read without the property's Python call; a torch without the key finds no plan here
# and takes plan_for's way, which reads the property).
_world_attributes = compat.world_attributes()
_TORCH_ALL_REDUCE = dist.all_reduce  # torch's own, bound at import (instrument() replaces dist.all_reduce)
# A call waits with its whole deadline (a cached timedelta) when it spent less than this of it
# before the wait: the wait then overruns the deadline by less than this.
_REUSE_WAIT_S = 1e-3
# The recorder's doors for a call that records itself (recorder.open_fast/close_ok, compiled where
# the hot path was built): open(op, group, numel, dtype) -> record or None; close(record).
_open_record, _close_record = doors(recorder)
# check_finite=None, by Config.check_finite: True checks (the cross-rank check then runs at any size),
# None checks where that check runs anyway, False never.
_FINITE_BY_SETTING: dict[str, bool | None] = {"always": True, "verified": None, "never": False}


@dataclass(slots=True)
class CollectiveResult(Result):
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


def forget_group_infos() -> None:
    """Drops the current world's group plans. Each holds its group, so the plans alone keep a
    group alive; a new world (``ncclguard.rebuild_world``) drops the old world's by itself."""
    forget_plans()


def safe_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | timedelta | None = None,
    chunk_numel: int | None = None,
    atomic: bool = False,
    verify: bool | None = None,
    tag: str | None = None,
    check_finite: bool | None = None,
) -> CollectiveResult:
    """All-reduces ``tensor`` in place with a deadline; never hangs.

    Args:
        tensor: any dense tensor (any shape, 0-d and empty included; contiguous or not).
        op: a ``torch.distributed.ReduceOp``. AVG works on gloo too (sum, then divide).
        group: the process group (default: the world). Without an initialized process group the
            call is a world of one: ok, tensor unchanged; but after a rebuild whose handshake
            failed (no member has its group), falsy with :class:`GroupFailed`.
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
        check_finite: a NaN or Inf in any rank's input fails every rank, nothing moved (docs/numerics.md).

    Returns:
        A :class:`CollectiveResult`; falsy with ``error`` set to a :class:`CollectiveTimeout` (ncclguard's deadline
        passed), :class:`CollectiveFailed` (the backend failed, or its own timeout ended the op first),
        :class:`CollectiveMismatch`, :class:`NonFiniteInput` (nothing reduced, the ranks named) or :class:`GroupFailed`.

    Raises:
        TypeError, ValueError: bad input (a timeout at or above the group's own timeout
            included), raised on the calling rank before any communication.
    """
    # Every call is admitted the same way: the group's plan (its cache hit inline: one frame less
    # on every call), the call's shape (input checked once per shape), its deadline, the failure
    # mark; then it takes _issue_first (one op that nothing has to precede) or _guarded. What does
    # not change between calls is computed once, in the plan (ncclguard.collectives.plan).
    start = _monotonic()
    try:
        key: Any = _world_attributes.get("_default_pg") if group is None else group
        plan = _plans.hot.by_group.get(key)
    except (TypeError, AttributeError):  # an unhashable group (group_info explains), or no _world yet
        plan = None
    if plan is None:
        plan = plan_for(group)
    if plan is None or not plan.multi:
        return _alone(plan, tensor, op, start, (timeout, chunk_numel, tag), check_finite)
    config = get_config()
    if config is not plan.config:
        plan.use_config(config)
    if tag is not None:
        check_tag(tag)
    try:
        check_finite = _finite_wanted(check_finite, config.check_finite)
        shape = plan.shape(tensor, op, chunk_numel)
        timeout_s = None
        if timeout is not None:
            timeout_s = to_seconds(timeout, "timeout")
            check_below_group_timeout(timeout_s, plan.timeout_s(), plan.name)
    except (TypeError, ValueError):
        _number(plan, tag)  # a refused call takes its number too (see ncclguard.collectives.calls)
        raise
    failed = failure_of(plan.group) if _groups.hot.table.marked else None
    if failed is not None:
        return _refused(plan, shape, tag, failed, start)
    check = verify or tag is not None or (verify is None and shape.verify_default) or check_finite is True
    direct = shape.direct and not atomic and tensor.is_contiguous()
    if direct and not check and dist.all_reduce is _TORCH_ALL_REDUCE:  # not instrumented: see _issue_first
        return _issue_first(plan, tensor, shape, start, timeout_s)
    checks = (bool(check), bool(check) and check_finite is not False)  # the round; the input's scan in it
    return _guarded(plan, tensor, op, shape, start, timeout_s, checks, direct, atomic, tag)


def _issue_first(
    plan: GroupPlan, tensor: torch.Tensor, shape: CallShape, start: float, timeout_s: float | None
) -> CollectiveResult:
    """The hot path: one op on the tensor itself (one chunk, contiguous, not atomic) that nothing
    has to precede: no fingerprint round, no tag, no wrapper of dist.all_reduce (instrument()'s
    would record the op itself unless our record is open). Issued before anything else, so the
    call's number, its record and its default deadline are made while the backend works."""
    failure: WireFailure | None = None
    try:
        # Positional: keywords cost torch's decorator a dict on every call.
        work: Any = _TORCH_ALL_REDUCE(tensor, shape.wire_op, plan.group, True)
    except Exception as exc:  # noqa: BLE001 - a backend error becomes a result
        work, failure = None, WireFailure(0, exc, _monotonic())
    base, counter = plan.count.current  # the call's number; its Call object only for an error
    n = next(counter)
    rec = _open_record(shape.opname, plan.name, shape.numel, shape.dtype)
    try:
        if timeout_s is None:
            timeout_s = plan.default_timeout(shape, start)
        reduced = 0
        if failure is None:  # _one_op's wait, inline: a frame and a tuple less on every call
            try:
                # Under a millisecond spent: wait with the whole deadline (a cached timedelta).
                wait = plan.whole_wait(timeout_s) if _monotonic() - start < _REUSE_WAIT_S else None
                wait_work(work, start + timeout_s, plan.backend, plan.group, wait)
            except Exception as exc:  # noqa: BLE001 - every backend error becomes a result
                failure = WireFailure(0, exc, _monotonic())
            else:
                reduced = shape.numel
                if shape.avg_by_hand:  # the backend has no AVG: it summed
                    with torch.no_grad():
                        tensor.div_(plan.info.size)
        error: CollectiveError | None = None
        if failure is not None:
            call = Call(plan.info, "all_reduce", base=base, n=n)
            error = wire_error(call, failure, shape.chunks, start, timeout_s, plan.timeout_s(), _fields(plan, shape))
    except BaseException as exc:  # KeyboardInterrupt too: an open record would read as a hang
        if rec is not None:
            recorder.finish(rec, f"interrupted: {exc!r}")
        raise
    if error is None:
        _close_record(rec)
        return CollectiveResult(
            True, shape.opname, shape.numel, shape.nbytes, shape.chunks, reduced, _monotonic() - start
        )
    return _failed(plan, shape, rec, reduced, error, start)


def _guarded(
    plan: GroupPlan,
    tensor: torch.Tensor,
    op: Any,
    shape: CallShape,
    start: float,
    timeout_s: float | None,
    checks: tuple[bool, bool],
    direct: bool,
    atomic: bool,
    tag: str | None,
) -> CollectiveResult:
    """Every other call: numbered (by its tag, when it has one) and recorded before anything moves;
    the fingerprint check when asked (``checks``: the round, and the input's scan for NaN and Inf
    carried in it); then the wire: one op on the tensor itself (through dist.all_reduce, whose
    instrument() wrapper then sees our open record) or run_chunks (several chunks, ``atomic``, or
    a non-contiguous tensor)."""
    check, finite = checks
    # The call's number: the Call object (its round name) is made only when a round needs it.
    call: Call | None = None
    base, n = "", 0
    if tag is None:
        base, counter = plan.count.current
        n = next(counter)
    else:
        call = begin_call(plan.info, "all_reduce", tag)
    rec = _open_record(shape.opname, plan.name, shape.numel, shape.dtype)
    try:
        if timeout_s is None:
            timeout_s = plan.default_timeout(shape, start)
        error: CollectiveError | None = None
        reduced = 0
        failure: WireFailure | None = None
        if check:
            call = call or Call(plan.info, "all_reduce", base=base, n=n)
            error = check_fingerprints(
                call, tensor, op, list(shape.bounds), start + timeout_s, start, _fields(plan, shape), finite
            )
            if error is not None:
                log.warning("%s", error)
        if error is None:
            if direct:  # one op, the tensor itself on the wire, none of the chunk machinery
                reduced, failure = _one_op(plan, tensor, shape, start, timeout_s)
            else:
                reduced, failure = run_chunks(plan.info, tensor, shape, start + timeout_s, atomic)
        if failure is not None:
            call = call or Call(plan.info, "all_reduce", base=base, n=n)
            error = wire_error(call, failure, shape.chunks, start, timeout_s, plan.timeout_s(), _fields(plan, shape))
    except BaseException as exc:  # KeyboardInterrupt too: an open record would read as a hang
        if rec is not None:
            recorder.finish(rec, f"interrupted: {exc!r}")
        raise
    if error is None:
        _close_record(rec)
        return CollectiveResult(
            True, shape.opname, shape.numel, shape.nbytes, shape.chunks, reduced, _monotonic() - start
        )
    return _failed(plan, shape, rec, reduced, error, start)


def _one_op(
    plan: GroupPlan, tensor: torch.Tensor, shape: CallShape, start: float, timeout_s: float
) -> tuple[int, WireFailure | None]:
    """Issues one op on the tensor itself through ``dist.all_reduce`` (an instrument() wrapper then
    sees our open record) and waits for it. _issue_first has the same wait inline: keep the two in step.

    Returns:
        (elements reduced, None), or (0, the failure): every backend error becomes a result.
    """
    try:
        work = dist.all_reduce(tensor, op=shape.wire_op, group=plan.group, async_op=True)
        # Under a millisecond spent: wait with the whole deadline (a cached timedelta).
        wait = plan.whole_wait(timeout_s) if _monotonic() - start < _REUSE_WAIT_S else None
        wait_work(work, start + timeout_s, plan.backend, plan.group, wait)
    except Exception as exc:  # noqa: BLE001 - every backend error becomes a result
        return 0, WireFailure(0, exc, _monotonic())
    if shape.avg_by_hand:  # the backend has no AVG: it summed
        with torch.no_grad():
            tensor.div_(plan.info.size)
    return shape.numel, None


def _refused(plan: GroupPlan, shape: CallShape, tag: str | None, failed: Exception, start: float) -> CollectiveResult:
    """A call on a group marked failed: it takes its number, and nothing moves."""
    _number(plan, tag)
    refused = GroupFailed(f"group {plan.name!r} failed earlier ({failed}); make a new group to go on")
    return CollectiveResult(False, shape.opname, shape.numel, shape.nbytes, 1, 0, _monotonic() - start, refused)


def _failed(
    plan: GroupPlan, shape: CallShape, rec: list[Any] | None, reduced: int, error: CollectiveError, start: float
) -> CollectiveResult:
    """A failed call's record finished with its error, and its result."""
    if rec is not None:
        recorder.finish(rec, error)
    return CollectiveResult(
        False, shape.opname, shape.numel, shape.nbytes, shape.chunks, reduced, _monotonic() - start, error
    )


def _finite_wanted(check_finite: Any, setting: str) -> bool | None:
    """``check_finite`` checked (TypeError before any communication), None read from the setting."""
    if check_finite is None:
        return _FINITE_BY_SETTING[setting]
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be True, False or None, got {check_finite!r}")
    return check_finite


def _number(plan: GroupPlan, tag: str | None) -> None:
    """Takes the call's number (or its tag's use) for a call refused before any communication."""
    begin_call(plan.info, "all_reduce", tag)


def _fields(plan: GroupPlan, shape: CallShape) -> dict[str, Any]:
    """What an error of this call names: op, numel, dtype, group."""
    return dict(op=shape.opname, numel=shape.numel, dtype=shape.dtype, group=plan.name)


def _alone(
    plan: GroupPlan | None,
    tensor: Any,
    op: Any,
    start: float,
    given: tuple[float | timedelta | None, Any, str | None],
    check_finite: bool | None,
) -> CollectiveResult:
    """A world of one (no process group, or a group of one rank): the input is checked as on any
    group, nothing moves, the tensor is the result. No group in a world that a failed handshake
    left is no world of one: falsy, the tensor unchanged (nothing reduced). ``given``: the call's
    timeout, chunk_numel and tag. With ``check_finite=True`` a NaN or an infinity fails it, as on a
    group (no cross-rank check runs here otherwise)."""
    timeout, chunk_numel, tag = given
    check_tag(tag)
    _finite_wanted(check_finite, "never")
    check_input(tensor, op, chunk_numel, plan.backend if plan is not None else None)
    if timeout is not None:
        to_seconds(timeout, "timeout")
    numel = tensor.numel()
    chunks = len(chunk_bounds(numel, chunk_numel))
    opname = f"all_reduce({REDUCE_OP_NAMES[op]})"
    nbytes = numel * tensor.element_size()
    why = no_group_reason() if plan is None else None
    if why is not None:
        return CollectiveResult(False, opname, numel, nbytes, chunks, 0, _monotonic() - start, GroupFailed(why))
    kind = nonfinite_kind(tensor) if check_finite else None
    if kind is not None:
        bad = NonFiniteInput(
            f"{opname} in a world of one: non-finite input (rank 0: {kind}); nothing was reduced",
            ranks=[0],
            kinds={0: kind},
            op=opname,
            numel=numel,
            dtype=str(tensor.dtype).removeprefix("torch."),
            elapsed_s=_monotonic() - start,
        )
        return CollectiveResult(False, opname, numel, nbytes, chunks, 0, _monotonic() - start, bad)
    return CollectiveResult(True, opname, numel, nbytes, chunks, numel, _monotonic() - start)
