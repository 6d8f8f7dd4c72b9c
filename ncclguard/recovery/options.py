"""The recovery engine's settings: the keywords every adapter takes, declared once, checked once.

The keywords are declared once, in :class:`RecoveryKeywords`. Every adapter takes them the same way,
``**recovery: Unpack[RecoveryKeywords]``: ``RecoveringStep``, ``guard_trainer(recover=True)``,
``NcclGuardCallback(recover=True)``, ``recovering_step`` (``AcceleratorRecoveringStep``,
``AcceleratorDeepSpeedStep``) and ``CommittedEngineStep``. Each passes them to
:func:`recovery_options`, which builds :class:`RecoveryOptions`, a frozen pydantic model validated
where it is made (as ``WatchdogConfig`` and ``Config`` are), before any communication;
docs/recovery.md ("The settings") says what each one bounds.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ncclguard._log import log
from ncclguard.deadlines import to_seconds
from ncclguard.recovery._rebuild.restarts import supervised_restarts
from ncclguard.recovery.heal import DEFAULT_CHUNK_BYTES
from ncclguard.recovery.preempt import check_preempt_dir

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_REPLICA_CHECK_EVERY",
    "RECOVERY_KEYWORDS",
    "LeftOut",
    "OnNonFinite",
    "RecoveryKeywords",
    "RecoveryOptions",
    "check_recovery_keywords",
    "recovery_options",
]

LeftOut = Literal["exit", "raise"]
OnNonFinite = Literal["auto", "redo", "skip", "raise", "off"]

DEFAULT_REPLICA_CHECK_EVERY = 100  # the replica check's period (docs/numerics.md, "Replicas checked")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # well below NCCL's 10 min and HF's 30 min, far above a healthy op


class RecoveryKeywords(TypedDict, total=False):
    """The recovery keywords, as every adapter takes them: ``**recovery: Unpack[RecoveryKeywords]``.

    Each key is the alias of a :class:`RecoveryOptions` field (its attributes say what each
    bounds); a key left out takes the field's default. Durations are seconds or a ``timedelta``.
    """

    collective_timeout: float | timedelta | None
    commit_timeout: float | timedelta | None
    rebuild_timeout: float | timedelta
    allow_shrink: bool
    max_attempts: int
    heal: bool | None
    heal_timeout: float | timedelta
    heal_chunk_bytes: int
    left_out: LeftOut
    snapshot_every: int | None
    snapshot_keep: int
    snapshot_spares: bool
    snapshot_max_bytes: int | None
    preempt_dir: str | os.PathLike[str] | None
    on_nonfinite: OnNonFinite
    nonfinite_suspect_steps: int
    replica_check_every: int | None


# The names, in declaration order (for messages, and for the test that checks every adapter takes each).
RECOVERY_KEYWORDS: tuple[str, ...] = tuple(RecoveryKeywords.__annotations__)


# How a bad count reads, by field (each one's bounds are its Field's ge and le).
_COUNT_SENTENCES = {
    "max_attempts": "max_attempts must be an int of at least 1, got {value!r}",
    "heal_chunk_bytes": "heal_chunk_bytes must be a positive int, got {value!r}",
    "snapshot_every": "snapshot_every must be None (chosen as the job runs) or an int of at least 1, got {value!r}",
    "snapshot_keep": "snapshot_keep must be 1 or 2 (snapshots kept of each), got {value!r}",
    "snapshot_max_bytes": (
        "snapshot_max_bytes must be None (no cap) or an int of bytes, at least 1, got {value!r} "
        "(e.g. 64 * 2**30 for 64 GiB)"
    ),
    "nonfinite_suspect_steps": "nonfinite_suspect_steps must be an int of at least 1, got {value!r}",
}


class RecoveryOptions(BaseModel):
    """The engine's settings, validated where they are made (:func:`recovery_options` builds them
    from the keywords; ``RecoveryOptions(rebuild_timeout=30)`` does the same).

    Each field is made from the keyword of the same name without ``_s`` (its alias): a duration
    keyword takes seconds or a ``timedelta`` and the field holds seconds. A bad value type raises
    TypeError; a bad value raises ``pydantic.ValidationError`` (a ValueError) with the same sentence.

    Attributes:
        collective_timeout_s: how long a collective inside a step waits for its peers before the
            step fails on this rank (the step bound); None leaves the groups' timeouts alone.
        commit_timeout_s: how long a commit waits for every rank; None: ``should_commit``'s
            default (below the group's timeout in force).
        rebuild_timeout_s: how long a rebuild waits for every rank (with ``heal``: a killed rank's
            restart, its imports and its setup).
        allow_shrink: rebuild without the ranks that did not come (the same on every rank).
        max_attempts: times a step runs at most.
        heal: admit restarted ranks and send them a live peer's state (sharded: their buddy's
            snapshot). None (the default) turns it on where a supervisor restarts ranks (``ncclguard
            run --ncclguard-restarts N``, N > 0) and ``allow_shrink`` is not set, so that a killed or
            stuck rank comes back and the job finishes on its full world; elsewhere it is off.
        heal_auto: ``heal`` was left to its default (see ``heal``): an adapter that cannot heal
            its stack turns it off (:meth:`without_auto_heal`) instead of refusing the job.
        heal_timeout_s: seconds for one state transfer.
        heal_chunk_bytes: bytes per broadcast of a live peer's state transfer, at most (sharded
            state is restored from snapshots instead, which it does not bound).
        left_out: ``"exit"`` (status 0) or ``"raise"`` for a rank the others went on without.
        snapshot_every: sharded state with ``heal``: a snapshot every this many steps; None: as
            often as keeps them under 2% of the step time (docs/recovery.md, "Sharded state").
        snapshot_keep: snapshots kept of a rank's own state and of each replica, 1 (its state twice
            in host memory) or 2 (four times; a restore can fall back to the one before).
        snapshot_spares: keep the buffers a committed snapshot frees for the next take: takes copy
            at memory speed, for twice the host memory.
        snapshot_max_bytes: the most host memory a rank's committed snapshots and replicas may
            hold; over it the spare buffers go, then the second snapshot kept, and a state too big
            even then is said and kept all the same. None (the default): no cap.
        preempt_dir: where every rank writes its framework's checkpoint when the job is told to
            stop (SIGTERM; :mod:`ncclguard.recovery.preempt`): the option, else the variable
            ``NCCLGUARD_PREEMPT_DIR``; None: nothing is written.
        on_nonfinite: what a step whose gradient held a NaN or an infinity on some rank before the
            reduction does (docs/numerics.md): ``"redo"`` (its state put back and run again once,
            then skipped), ``"skip"`` (its batch dropped), ``"raise"`` (``NonFiniteGradient`` on
            every rank); ``"off"`` checks nothing; ``"auto"`` (the default) is ``"redo"`` for a model
            on a GPU and ``"off"`` on the CPU, where the scan costs 6-8% of a DDP step. In every
            case a flagged step is not applied.
        nonfinite_suspect_steps: a rank flagged again within this many steps is named once as a
            suspect device (a non-finite gradient or a drifted replica).
        replica_check_every: every this many steps (the steps whose number it divides), each rank
            states a digest of its parameters and its optimizer's state as the step found them, and
            a rank whose replica differs from the majority's is healed from a majority peer in the
            same world before the step is redone (``RecoveringStep``'s own DDP wrapper; docs/numerics.md,
            "Replicas checked"). None or 0: off. Default 100: the digest took 1-3 ms per million parameters with
            Adam's state on a CPU, once per period.
    """

    # Frozen: the engine and its adapters share one instance; extra="forbid": a misspelt setting
    # is an error, not a default silently kept.
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The bounds are stated here once; the validators below word their refusals (_count, _seconds).
    collective_timeout_s: float | None = Field(DEFAULT_COLLECTIVE_TIMEOUT_S, alias="collective_timeout", gt=0)
    commit_timeout_s: float | None = Field(None, alias="commit_timeout", gt=0)
    rebuild_timeout_s: float = Field(60.0, alias="rebuild_timeout", gt=0)
    allow_shrink: bool = False
    max_attempts: int = Field(3, ge=1)
    heal: bool = False  # None (the default keyword) is resolved by _auto_heal
    heal_timeout_s: float = Field(60.0, alias="heal_timeout", gt=0)
    heal_chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=1)
    left_out: LeftOut = "exit"
    snapshot_every: int | None = Field(None, ge=1)
    snapshot_keep: int = Field(1, ge=1, le=2)
    snapshot_spares: bool = False
    snapshot_max_bytes: int | None = Field(None, ge=1)
    # Validated when left out too: the default is read from NCCLGUARD_PREEMPT_DIR, which may name a file.
    preempt_dir: Path | None = Field(None, validate_default=True)
    on_nonfinite: OnNonFinite = "auto"
    nonfinite_suspect_steps: int = Field(100, ge=1)
    replica_check_every: int | None = Field(DEFAULT_REPLICA_CHECK_EVERY, ge=1)

    _heal_auto: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _auto_heal(cls, data: Any, handler: ModelWrapValidatorHandler[RecoveryOptions]) -> RecoveryOptions:
        # heal left out (or None): on under a supervisor that restarts ranks, unless the user asked to
        # go on without a lost rank (allow_shrink=True: no wait for its restart). Read here, once,
        # from this process's environment: every rank of a job runs under the same launcher.
        auto = isinstance(data, dict) and data.get("heal") is None
        if auto:
            shrink = data.get("allow_shrink", False)
            data = {**data, "heal": supervised_restarts() > 0 and shrink is False}
        options = handler(data)
        options._heal_auto = auto
        return options

    @property
    def heal_auto(self) -> bool:
        """``heal`` was left to its default (see the ``heal`` attribute)."""
        return self._heal_auto

    def without_auto_heal(self, why: str) -> RecoveryOptions:
        """These options with ``heal`` off where it was on by default and the adapter cannot heal.

        Args:
            why: what the adapter cannot heal, for the log and the error.

        Returns:
            The options, with ``heal=False`` when it was chosen by default (logged once).

        Raises:
            ValueError: ``heal=True`` was asked for: what cannot be healed, and what to pass instead.
        """
        if not self.heal:
            return self
        if not self.heal_auto:
            raise ValueError(why)
        # A setting the user counted on (heal is on under restarts) is turned off: said where they look.
        log.warning("recovery: heal is off (it is on by default under restarts, but %s)", why)
        return self.model_copy(update={"heal": False})

    @field_validator("collective_timeout_s", "commit_timeout_s", "rebuild_timeout_s", "heal_timeout_s", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> float | None:
        keyword = cls.model_fields[info.field_name or ""].alias or ""
        if value is None and keyword in ("collective_timeout", "commit_timeout"):
            return None
        return to_seconds(value, keyword)  # TypeError, or ValueError: not a positive, finite duration

    @field_validator("allow_shrink", "heal", "snapshot_spares", mode="before")
    @classmethod
    def _flag(cls, value: Any, info: ValidationInfo) -> bool:
        # A TypeError leaves pydantic as it is: the same error type the hand checks raised.
        if not isinstance(value, bool):
            raise TypeError(f"{info.field_name} must be True or False, got {value!r}")
        return value

    @field_validator(*_COUNT_SENTENCES, mode="before")
    @classmethod
    def _count(cls, value: Any, info: ValidationInfo) -> int | None:
        # The bounds are the Field's (ge, le); this check only words the refusal the user reads
        # and refuses a bool or a float, which pydantic's lax mode would take as an int.
        name = info.field_name or ""
        field = cls.model_fields[name]
        if value is None and field.default is None:
            return None
        low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
        high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(_COUNT_SENTENCES[name].format(value=value))
        return int(value)

    @field_validator("left_out", "on_nonfinite", mode="before")
    @classmethod
    def _choice(cls, value: Any, info: ValidationInfo) -> str:
        choices = typing.get_args(LeftOut if info.field_name == "left_out" else OnNonFinite)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{info.field_name} must be {' or '.join(map(repr, choices))}, got {value!r}")
        return value

    @field_validator("replica_check_every", mode="before")
    @classmethod
    def _period(cls, value: Any) -> int | None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
            return None  # off
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"replica_check_every must be None or 0 (off) or an int of steps, at least 1, got {value!r}"
            )
        return value

    @field_validator("preempt_dir", mode="before")
    @classmethod
    def _preempt_dir(cls, value: Any) -> Path | None:
        return check_preempt_dir(value)  # TypeError: not a path; ValueError: empty, or a file


def check_recovery_keywords(keywords: Mapping[str, object]) -> None:
    """Refuses a name that is no recovery keyword, as Python refuses an unknown keyword argument.

    Args:
        keywords: what an adapter received as ``**recovery``.

    Raises:
        TypeError: a name not in :data:`RECOVERY_KEYWORDS`, with the names there are.
    """
    unknown = sorted(set(keywords) - set(RECOVERY_KEYWORDS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the recovery keywords are "
            f"{', '.join(RECOVERY_KEYWORDS)}"
        )


def recovery_options(**keywords: Unpack[RecoveryKeywords]) -> RecoveryOptions:
    """Builds the engine's options from the recovery keywords (every adapter passes its own here).

    Args:
        **keywords: the :class:`RecoveryKeywords`; one left out takes its default.

    Returns:
        The validated, frozen :class:`RecoveryOptions`.

    Raises:
        TypeError: an unknown keyword, or a value of the wrong type (a flag that is not a bool, a
            duration that is neither a number nor a timedelta, a ``preempt_dir`` that is no path).
        pydantic.ValidationError: a bad value (a ValueError), with what to pass instead; before any
            communication.
    """
    check_recovery_keywords(keywords)
    return RecoveryOptions(**keywords)
