"""safe_barrier: a barrier on the group's store that names the missing ranks on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ncclguard._log import log
from ncclguard.collectives.calls import begin_call, check_tag, meet_prints, postmortem
from ncclguard.collectives.groups import group_info, group_timeout_s, no_group_reason
from ncclguard.config import get_config
from ncclguard.deadlines import default_deadline, to_seconds
from ncclguard.errors import BarrierFailed, BarrierTimeout, CollectiveError, CollectiveMismatch, StoreUnreachable
from ncclguard.results import Result

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["BarrierResult", "safe_barrier"]


@dataclass
class BarrierResult(Result):
    """The outcome of :func:`safe_barrier`; truthy when every rank arrived.

    Attributes:
        ok: every rank of the group arrived before the deadline.
        missing_ranks: global ranks that had not arrived (sorted; empty when ``ok``).
        missing_hosts: hostnames of the missing ranks, where earlier rounds taught them.
        late: this rank arrived after the others had given up.
        elapsed_s: seconds spent in the barrier.
        error: why it failed (a :class:`~ncclguard.errors.BarrierTimeout` or
            :class:`~ncclguard.errors.BarrierFailed`), or None.
    """

    ok: bool
    missing_ranks: list[int] = field(default_factory=list)
    missing_hosts: dict[int, str] = field(default_factory=dict)
    late: bool = False
    elapsed_s: float = 0.0
    error: CollectiveError | None = None


def safe_barrier(
    timeout: float | timedelta | None = None, group: ProcessGroup | None = None, *, tag: str | None = None
) -> BarrierResult:
    """Waits until every rank of ``group`` arrives, or until ``timeout``, using the group's store.

    The communicator is never used, so this works on a group whose NCCL communicator is broken.

    Args:
        timeout: seconds (or a timedelta) from entry; must be positive. Default:
            ``Config.barrier_timeout_s`` capped below the group's own timeout
            (:func:`~ncclguard.deadlines.group_cap_s`). An explicit timeout is taken
            as given, even past the group's timeout: the barrier never touches the communicator,
            so the backend's timeout cannot cut it short.
        group: the process group (default: the world).
        tag: a name to meet under instead of the per-group call count; ranks that pass the same
            tag meet each other, and once every rank passed, the call count restarts there (see
            :mod:`ncclguard.collectives.calls`).

    Returns:
        A :class:`BarrierResult`; falsy, with the missing ranks, when the deadline passed; falsy
        with a :class:`~ncclguard.errors.CollectiveMismatch` when a rank is in another kind of
        safe call in this round. A rank that arrives after the others gave up gets a falsy result
        at once (``late=True``). No group: ok, but falsy after a rebuild's failed handshake.

    Raises:
        ValueError: ``timeout`` is not positive, ``tag`` is not a short name, or this rank is
            not in ``group``.
    """
    info = group_info(group)
    check_tag(tag)
    call = begin_call(info, "barrier", tag) if info is not None and info.size > 1 else None
    if timeout is not None:
        seconds = to_seconds(timeout, "timeout")
    else:
        seconds = default_deadline(get_config().barrier_timeout_s, group_timeout_s(call.info.group) if call else None)
    if info is None and (why := no_group_reason()) is not None:  # a failed handshake: no world of one
        return BarrierResult(ok=False, error=BarrierFailed(why, op="barrier"))
    if call is None:
        return BarrierResult(ok=True)
    info = call.info
    start = time.monotonic()
    fields: dict[str, Any] = {"op": "barrier", "group": info.name}
    try:
        met = meet_prints(call, call.print(), start + seconds)
    except StoreUnreachable as exc:
        log.warning("safe_barrier %s: %s", call.round, exc)
        err = BarrierFailed(str(exc), elapsed_s=time.monotonic() - start, **fields)
        err.__cause__ = exc
        return BarrierResult(ok=False, elapsed_s=err.elapsed_s, error=err)
    if met.ok:
        return BarrierResult(ok=True, elapsed_s=time.monotonic() - start)
    where = f"barrier {call.round!r} at {call.site}"
    if met.mismatch is not None and not met.missing:
        error: CollectiveError = CollectiveMismatch(
            f"{where} on group {info.name!r}: {met.mismatch}",
            fingerprints=met.prints,
            elapsed_s=time.monotonic() - start,
            **fields,
        )
        log.warning("safe_barrier: %s", error)
        return BarrierResult(ok=False, elapsed_s=error.elapsed_s, error=error)
    if met.late:
        message = f"arrived after the other ranks gave up on {where}"
    else:
        # Ranks that gave up in this round from another call say so here, within the grace.
        pm = postmortem(call, start + seconds + get_config().postmortem_grace_s)
        message = f"ranks {met.missing} did not reach {where} within {seconds:g} s{pm.describe()}"
    if met.mismatch is not None:
        message += f"; of those that came, {met.mismatch}"
    elapsed = time.monotonic() - start
    result = BarrierResult(
        ok=False,
        missing_ranks=met.missing,
        missing_hosts=met.missing_hosts,
        late=met.late,
        elapsed_s=elapsed,
        error=BarrierTimeout(message, elapsed_s=elapsed, missing_ranks=met.missing, **fields),
    )
    log.warning("safe_barrier: %s", message)
    return result
