"""This process's restart number (0 in a rank's first process, n in its n-th restart), and the
restarts its supervisor allows (what turns ``heal`` on by default)."""

from __future__ import annotations

import os

__all__ = [
    "RESTART_COUNT_VAR",
    "STOP_GRACE_VAR",
    "SUPERVISED_RESTARTS_VAR",
    "restart_count",
    "stop_grace_s",
    "supervised",
    "supervised_restarts",
]

# Set by the launcher that restarts one rank alone (python -m ncclguard.supervise, or
# ncclguard.testing.launch.spawn(restarts=...)): 0 (or unset) in a rank's first process, n in its
# n-th restart.
RESTART_COUNT_VAR = "NCCLGUARD_RESTART_COUNT"
# Set by python -m ncclguard.supervise (ncclguard run --ncclguard-restarts N) in every process it
# starts: N. Its supervisor restarts a killed rank and ends a stuck one on its peers' ask, so the
# engine heals by default there (RecoveryOptions.heal). Nothing else sets it.
SUPERVISED_RESTARTS_VAR = "NCCLGUARD_SUPERVISED_RESTARTS"
# Set by python -m ncclguard.supervise in every process it starts: the seconds its rank has to end
# after a stop (--stop-grace) before SIGKILL, so that the preemption checkpoint can say how much of
# it the save took.
STOP_GRACE_VAR = "NCCLGUARD_STOP_GRACE_S"


def restart_count() -> int:
    """This process's restart number: 0 in a rank's first process, n in its n-th restart
    (``NCCLGUARD_RESTART_COUNT``, set by ``python -m ncclguard.supervise``, by
    ``ncclguard.testing.launch.spawn(restarts=...)``, or by a wrapper of your own that restarts one
    rank alone: docs/recovery.md).

    Raises:
        ValueError: the variable is set but is not a non-negative integer.
    """
    raw = os.environ.get(RESTART_COUNT_VAR, "0").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"{RESTART_COUNT_VAR}={raw!r} is not a non-negative integer (the restart number)")
    return int(raw)


def supervised_restarts() -> int:
    """The restarts this process's supervisor allows its rank (``NCCLGUARD_SUPERVISED_RESTARTS``,
    set by ``python -m ncclguard.supervise``); 0 when it runs under none, or the value is no count."""
    raw = os.environ.get(SUPERVISED_RESTARTS_VAR, "").strip()
    return int(raw) if raw.isdigit() else 0


def supervised() -> bool:
    """This process runs under ``python -m ncclguard.supervise`` (``NCCLGUARD_SUPERVISED_RESTARTS``
    set, even to 0): its supervisor answers the waiting ranks' asks about it, whatever its restarts."""
    return os.environ.get(SUPERVISED_RESTARTS_VAR, "").strip().isdigit()


def stop_grace_s() -> float | None:
    """The seconds this process's supervisor gives it to end after a stop (``NCCLGUARD_STOP_GRACE_S``),
    or None under no supervisor (or a value that is no positive number)."""
    try:
        value = float(os.environ.get(STOP_GRACE_VAR, ""))
    except ValueError:
        return None
    return value if value > 0 and value != float("inf") else None
