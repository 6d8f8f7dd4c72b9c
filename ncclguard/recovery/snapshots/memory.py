"""What a rank's snapshots hold in host memory, and what gives way under a cap (``snapshot_max_bytes``).

In steady state a rank holds ``keep`` committed snapshots of its own state and ``keep`` of each
replica it keeps: ``keep x (own + replicas)``; a take adds one more (the pending snapshot and
replicas) until it commits. With spare buffers the pair a commit frees waits for the next take:
``(keep + 1) x (own + replicas)`` always (docs/recovery.md, "Memory, per rank and per host"). Under a cap the spare buffers go first, then
the second snapshot kept of each (keep 2 -> 1). A state whose single snapshot and replicas are over
the cap even then is kept all the same, and said: no other place holds what restores this rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Fit", "MemoryCap", "steady_bytes"]


def steady_bytes(held: int, keep: int, spares: bool) -> int:
    """Host memory in steady state for ``held`` bytes of own state and replicas.

    Args:
        held: one snapshot of this rank's own state plus one of each replica it keeps.
        keep: snapshots kept of each.
        spares: whether the buffers a commit frees are kept for the next take.

    Returns:
        The bytes held between takes.
    """
    return (keep + (1 if spares else 0)) * held


@dataclass(frozen=True)
class Fit:
    """What a keeper keeps under its cap.

    Attributes:
        keep: snapshots kept of each (perhaps lowered).
        spares: whether the spare buffers stay.
        dropped: what gave way, in words (empty: nothing).
        needed: the steady-state bytes with what is kept.
        over: the cap cannot be met even with one snapshot and no spares.
    """

    keep: int
    spares: bool
    dropped: tuple[str, ...] = ()
    needed: int = 0
    over: bool = False


# A snapshot this much larger than the one the memory line and the cap were made for makes them anew.
GROWN = 1.1


@dataclass
class MemoryCap:
    """The most host memory one rank's committed snapshots may hold (None: no cap).

    Args:
        max_bytes: the cap, bytes; None for none.
    """

    max_bytes: int | None = None
    decided: list[Fit] = field(default_factory=list)  # the fits made, the newest last
    decided_for: int = 0  # the largest ``held`` a fit was made for

    def fit(self, held: int, keep: int, spares: bool) -> Fit:
        """What to keep for ``held`` bytes of own state and replicas: decided at the first take, and
        again for a state more than :data:`GROWN` times larger (a take before the optimizer's first
        step holds no moments yet); a new fit is appended to :attr:`decided`.

        Args:
            held: one snapshot of this rank's own state plus one of each replica it keeps.
            keep: snapshots kept of each, as asked.
            spares: spare buffers, as asked.

        Returns:
            The :class:`Fit`; the one made before where the state has not grown past it.
        """
        if self.decided and held <= GROWN * self.decided_for:
            return self.decided[-1]
        dropped: list[str] = []
        if self.max_bytes is not None and spares and steady_bytes(held, keep, spares) > self.max_bytes:
            spares = False
            dropped.append("the spare buffers")
        if self.max_bytes is not None and keep > 1 and steady_bytes(held, keep, spares) > self.max_bytes:
            keep = 1
            dropped.append("the second snapshot kept of each")
        needed = steady_bytes(held, keep, spares)
        over = self.max_bytes is not None and needed > self.max_bytes
        self.decided.append(Fit(keep, spares, tuple(dropped), needed, over))
        self.decided_for = held
        return self.decided[-1]
