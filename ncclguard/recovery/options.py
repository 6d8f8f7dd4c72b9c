"""The recovery engine's settings: one set of keywords that every adapter takes, checked once.

``RecoveringStep``, ``guard_trainer(recover=True)``, ``NcclGuardCallback(recover=True)``,
``recovering_step`` and ``CommittedEngineStep`` pass their keywords to :func:`recovery_options`,
which refuses a bad value before any communication; docs/recovery.md ("The settings") says what
each one bounds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from ncclguard.deadlines import to_seconds
from ncclguard.recovery.heal import DEFAULT_CHUNK_BYTES
from ncclguard.recovery.preempt import check_preempt_dir

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "LeftOut", "RecoveryOptions", "recovery_options"]

LeftOut = Literal["exit", "raise"]

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # well below NCCL's 10 min and HF's 30 min, far above a healthy op


@dataclass(frozen=True)
class RecoveryOptions:
    """The engine's settings, checked once (:func:`recovery_options`).

    Attributes:
        collective_timeout_s: how long a collective inside a step waits for its peers before the
            step fails on this rank (the step bound); None leaves the groups' timeouts alone.
        commit_timeout_s: how long a commit waits for every rank; None: ``should_commit``'s
            default (below the group's timeout in force).
        rebuild_timeout_s: how long a rebuild waits for every rank (with ``heal``: a killed rank's
            restart, its imports and its setup).
        allow_shrink: rebuild without the ranks that did not come (the same on every rank).
        max_attempts: times a step runs at most.
        heal: admit restarted ranks and send them a live peer's state.
        heal_timeout_s: seconds for one state transfer.
        heal_chunk_bytes: bytes per broadcast of a state transfer, at most.
        left_out: ``"exit"`` (status 0) or ``"raise"`` for a rank the others went on without.
        snapshot_every: sharded state with ``heal``: a snapshot every this many steps; None: as
            often as keeps them under 2% of the step time (docs/recovery.md, "Sharded state").
        preempt_dir: where every rank writes its framework's checkpoint when the job is told to
            stop (SIGTERM; :mod:`ncclguard.recovery.preempt`): the option, else the variable
            ``NCCLGUARD_PREEMPT_DIR``; None: nothing is written.
    """

    collective_timeout_s: float | None = DEFAULT_COLLECTIVE_TIMEOUT_S
    commit_timeout_s: float | None = None
    rebuild_timeout_s: float = 60.0
    allow_shrink: bool = False
    max_attempts: int = 3
    heal: bool = False
    heal_timeout_s: float = 60.0
    heal_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    left_out: LeftOut = "exit"
    snapshot_every: int | None = None
    preempt_dir: Path | None = None


def recovery_options(
    *,
    collective_timeout: float | timedelta | None = DEFAULT_COLLECTIVE_TIMEOUT_S,
    commit_timeout: float | timedelta | None = None,
    rebuild_timeout: float | timedelta = 60.0,
    allow_shrink: bool = False,
    max_attempts: int = 3,
    heal: bool = False,
    heal_timeout: float | timedelta = 60.0,
    heal_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    left_out: LeftOut = "exit",
    snapshot_every: int | None = None,
    preempt_dir: str | os.PathLike[str] | None = None,
) -> RecoveryOptions:
    """Checks the engine's arguments (every adapter takes these names) and returns the options.

    Raises:
        TypeError, ValueError: a bad value, with what to pass instead; before any communication.
    """
    for name, flag in (("allow_shrink", allow_shrink), ("heal", heal)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an int of at least 1, got {max_attempts!r}")
    if isinstance(heal_chunk_bytes, bool) or not isinstance(heal_chunk_bytes, int) or heal_chunk_bytes < 1:
        raise ValueError(f"heal_chunk_bytes must be a positive int, got {heal_chunk_bytes!r}")
    if snapshot_every is not None and (
        isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1
    ):
        raise ValueError(
            f"snapshot_every must be None (chosen as the job runs) or an int of at least 1, got {snapshot_every!r}"
        )
    if left_out not in ("exit", "raise"):
        raise ValueError(f"left_out must be 'exit' or 'raise', got {left_out!r}")
    bound = None if collective_timeout is None else to_seconds(collective_timeout, "collective_timeout")
    commit = None if commit_timeout is None else to_seconds(commit_timeout, "commit_timeout")
    return RecoveryOptions(
        collective_timeout_s=bound,
        commit_timeout_s=commit,
        rebuild_timeout_s=to_seconds(rebuild_timeout, "rebuild_timeout"),
        allow_shrink=allow_shrink,
        max_attempts=max_attempts,
        heal=heal,
        heal_timeout_s=to_seconds(heal_timeout, "heal_timeout"),
        heal_chunk_bytes=heal_chunk_bytes,
        left_out=left_out,
        snapshot_every=snapshot_every,
        preempt_dir=check_preempt_dir(preempt_dir),
    )
