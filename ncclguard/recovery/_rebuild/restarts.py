"""This process's restart number: 0 in a rank's first process, n in its n-th restart."""

from __future__ import annotations

import os

__all__ = ["RESTART_COUNT_VAR", "restart_count"]

# Set by the launcher that restarts one rank alone (python -m ncclguard.supervise, or
# ncclguard.testing.launch.spawn(restarts=...)): 0 (or unset) in a rank's first process, n in its
# n-th restart.
RESTART_COUNT_VAR = "NCCLGUARD_RESTART_COUNT"


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
