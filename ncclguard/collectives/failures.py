"""What a guarded all_reduce tells when it cannot go on: the cross-rank check before any data
moves (:func:`check_fingerprints`, which also carries each rank's check of its input for NaN and
Inf) and the error after a failed wire (:func:`wire_error`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ncclguard._log import log
from ncclguard._naming import REDUCE_OP_NAMES, dtype_name, rank_ranges
from ncclguard.collectives.calls import NONFINITE_FIELD, Call, meet_prints, postmortem
from ncclguard.collectives.completion import DeadlinePassed
from ncclguard.collectives.finite import nonfinite_kind
from ncclguard.collectives.groups import GroupInfo, mark_failed
from ncclguard.collectives.wire import WireFailure
from ncclguard.config import get_config
from ncclguard.errors import (
    CollectiveError,
    CollectiveFailed,
    CollectiveMismatch,
    CollectiveTimeout,
    NonFiniteInput,
    StoreUnreachable,
)

__all__ = ["backend_failure", "check_fingerprints", "nonfinite_ranks", "wire_error"]


def wire_error(
    call: Call,
    failure: WireFailure,
    chunks: int,
    start: float,
    timeout_s: float,
    group_timeout: float | None,
    fields: dict[str, Any],
) -> CollectiveError:
    """The error of a failed reduction, after its post-mortem; marks the group failed: the
    communicator cannot be trusted any more (the abandoned op may still be queued)."""
    info = call.info
    gave_up_s = failure.at - start
    # Its own bound: the call's deadline plus 0.9 s, and never under half a second from now. A loaded
    # machine that noticed the failure late gave the post-mortem a bound already past: it asked nobody
    # and named no missing rank (seen once in CI: a CollectiveTimeout with missing_ranks None).
    pm = postmortem(call, max(start + timeout_s + 0.9, time.monotonic() + 0.5))
    if isinstance(failure.exc, DeadlinePassed):
        cls: type[CollectiveError] = CollectiveTimeout
        what = f"timed out after {gave_up_s:.2f} s (deadline {timeout_s:g} s)"
    else:
        cls = CollectiveFailed
        what = f"failed after {gave_up_s:.2f} s: {backend_failure(failure.exc, info, group_timeout, timeout_s)}"
    who = f"; ranks {pm.missing} never arrived" if pm.missing else ""
    why = "" if cls is CollectiveTimeout else _backend_timeout_hint(failure.exc)
    err = cls(
        f"{fields['op']} of {fields['numel']} x {fields['dtype']} on group {info.name!r} {what} at chunk "
        f"{failure.chunk + 1}/{chunks}{who}{pm.describe()}{why}",
        chunk=(failure.chunk, chunks),
        elapsed_s=time.monotonic() - start,
        missing_ranks=pm.missing,
        **fields,
    )
    err.__cause__ = failure.exc
    mark_failed(info.group, err)
    log.error("%s", err)
    return err


def _is_backend_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def backend_failure(exc: BaseException, info: GroupInfo, group_timeout: float | None, timeout_s: float) -> str:
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


def check_fingerprints(
    call: Call,
    tensor: torch.Tensor,
    op: Any,
    bounds: list[tuple[int, int]],
    deadline: float,
    start: float,
    fields: dict[str, Any],
    finite: bool = False,
) -> CollectiveError | None:
    """The call's round: every rank in the same call with the same tensor and op, and, with
    ``finite``, every rank's input free of NaN and Inf; before any data moves.

    Returns:
        None when the reduction may go on, else the error every rank that arrived gets alike
        (:class:`CollectiveMismatch`, :class:`NonFiniteInput`, a timeout, a failed store).
    """
    info = call.info
    said = {NONFINITE_FIELD: nonfinite_kind(tensor)} if finite else {}  # scanned before the round: a sync
    mine = call.print(
        numel=tensor.numel(),
        dtype=dtype_name(tensor.dtype),
        op=REDUCE_OP_NAMES[op],
        device=tensor.device.type,
        chunks=[len(bounds), bounds[0][1] - bounds[0][0]],
        **said,
    )
    try:
        met = meet_prints(call, mine, deadline)
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
    kinds = nonfinite_ranks(met.prints)
    if kinds:
        finite_ranks = sorted(r for r in met.prints if r not in kinds)
        listing = ", ".join(f"rank {r}: {k}" for r, k in sorted(kinds.items()))
        others = f"; ranks {rank_ranges(finite_ranks)} were finite" if finite_ranks else ""
        return NonFiniteInput(
            f"{where}: non-finite input ({listing}){others}; nothing was reduced, each rank's tensor holds its "
            "own values",
            ranks=sorted(kinds),
            kinds=kinds,
            elapsed_s=time.monotonic() - start,
            **fields,
        )
    return None


def nonfinite_ranks(prints: dict[int, dict[str, Any]]) -> dict[int, str]:
    """The ranks whose fingerprint says their input held a NaN or an infinity (pure).

    Args:
        prints: each rank's fingerprint as sent.

    Returns:
        ``{rank: "NaN" or "Inf"}``; empty when none did or none said.
    """
    return {r: str(p[NONFINITE_FIELD]) for r, p in prints.items() if p.get(NONFINITE_FIELD) in ("NaN", "Inf")}
