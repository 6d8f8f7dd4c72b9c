"""safe_barrier: a barrier on the group's store that names the missing ranks on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ncclguard._log import log
from ncclguard.collectives.deadlines import to_seconds
from ncclguard.collectives.groups import group_info
from ncclguard.collectives.rendezvous import StoreUnreachable, exchange, known_hosts, next_round

__all__ = ["BarrierResult", "safe_barrier"]


@dataclass
class BarrierResult:
    """The outcome of :func:`safe_barrier`; truthy when every rank arrived.

    Attributes:
        ok: every rank of the group arrived before the deadline.
        missing_ranks: global ranks that had not arrived (sorted; empty when ``ok``).
        missing_hosts: hostnames of the missing ranks, where earlier rounds taught them.
        late: this rank arrived after the others had given up.
        elapsed_s: seconds spent in the barrier.
        error: why it failed, as text, or None.
    """

    ok: bool
    missing_ranks: list[int] = field(default_factory=list)
    missing_hosts: dict[int, str] = field(default_factory=dict)
    late: bool = False
    elapsed_s: float = 0.0
    error: str | None = None

    def __bool__(self) -> bool:
        return self.ok


def safe_barrier(timeout: float | timedelta = 300.0, group: Any = None, *, tag: str | None = None) -> BarrierResult:
    """Waits until every rank of ``group`` arrives, or until ``timeout``, using the group's store.

    The communicator is never used, so this works on a group whose NCCL communicator is broken.

    Args:
        timeout: seconds (or a timedelta) from entry; must be positive.
        group: the process group (default: the world).
        tag: a name to meet under instead of the per-group call count; ranks that pass the same
            tag meet each other. A tag may be used once per group.

    Returns:
        A :class:`BarrierResult`; falsy, with the missing ranks, when the deadline passed. A rank
        that arrives after the others gave up gets a falsy result at once (``late=True``).

    Raises:
        ValueError: ``timeout`` is not positive, or this rank is not in ``group``.
    """
    seconds = to_seconds(timeout, "timeout")
    info = group_info(group)
    if info is None or info.size == 1:
        return BarrierResult(ok=True)
    start = time.monotonic()
    name = f"barrier/{info.name}/tag/{tag}" if tag is not None else next_round(info, "barrier")
    try:
        rnd = exchange(info, name, {"t": time.time()}, start + seconds)
    except StoreUnreachable as exc:
        log.warning("safe_barrier %s: %s", name, exc)
        return BarrierResult(ok=False, elapsed_s=time.monotonic() - start, error=str(exc))
    if rnd.ok:
        return BarrierResult(ok=True, elapsed_s=rnd.elapsed_s)
    hosts = known_hosts(info)
    missing = [info.global_rank(r) for r in rnd.missing]
    result = BarrierResult(
        ok=False,
        missing_ranks=sorted(missing),
        missing_hosts={info.global_rank(r): hosts[r] for r in rnd.missing if r in hosts},
        late=rnd.late,
        elapsed_s=rnd.elapsed_s,
    )
    if result.late:
        result.error = f"arrived after the other ranks gave up on barrier {name!r}"
    else:
        result.error = f"ranks {result.missing_ranks} did not reach barrier {name!r} within {seconds:g} s"
    log.warning("safe_barrier: %s", result.error)
    return result
