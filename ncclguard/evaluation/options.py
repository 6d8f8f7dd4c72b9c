"""The guarded evaluation's options: the keywords every evaluation entry point takes, declared once,
checked once.

The keywords are declared in :class:`EvalKeywords`. ``guarded_evaluate``, Accelerate's
``guarded_evaluate`` and DeepSpeed's ``patch_trainer`` take them as ``**evaluation:
Unpack[EvalKeywords]``; ``guard_trainer`` and Lightning's ``NcclGuardCallback`` take the two that
apply to a framework's own evaluation under the same names (``eval_timeout_s``, and for the
Trainer ``retries``). Each passes them to :func:`eval_options`, which builds :class:`GuardOptions`,
a frozen pydantic model validated where it is made (as the recovery keywords'
``RecoveryOptions`` is). The deadline has one name everywhere: ``eval_timeout_s``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, TypedDict, Unpack

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from ncclguard._log import log
from ncclguard.deadlines import to_seconds
from ncclguard.sigalrm import sigalrm_timeout

__all__ = [
    "EVAL_KEYWORDS",
    "EvalKeywords",
    "GuardOptions",
    "eval_options",
    "python_deadline_guard",
]


def python_deadline_guard(seconds: float) -> AbstractContextManager[None]:
    """The default ``deadline_guard``: SIGALRM in the main thread, nothing elsewhere.

    SIGALRM ends Python-level stalls only (a slow loop, a sleep); a blocked C++ call returns
    first. Collectives on the default group are bounded by the side group's timeout instead.

    Args:
        seconds: the deadline, from entry.

    Returns:
        :func:`ncclguard.sigalrm_timeout` (which raises :class:`~ncclguard.errors.DeadlineExceeded`
        at the deadline) in the main thread; a context manager that does nothing elsewhere.
    """
    if threading.current_thread() is threading.main_thread():
        return sigalrm_timeout(seconds, f"the evaluation ran past its {seconds:.3g} s deadline")
    log.warning("guarded_evaluate outside the main thread: no SIGALRM guard, only collective timeouts bound it")
    return nullcontext()


class EvalKeywords(TypedDict, total=False):
    """The evaluation keywords, as the entry points take them: ``**evaluation: Unpack[EvalKeywords]``.

    Each key is a :class:`GuardOptions` field (its attributes say what each does); a key left out
    takes the field's default, except ``eval_timeout_s``, which a guarded evaluation needs.
    """

    eval_timeout_s: float | timedelta
    monitor: Any
    fallback: Any
    retries: int
    shrink: Callable[[], Any] | None
    grace_s: float | None
    deadline_guard: Callable[[float], AbstractContextManager[Any]]


# The names, in declaration order (for messages, and for the test that checks them against the model).
EVAL_KEYWORDS: tuple[str, ...] = tuple(EvalKeywords.__annotations__)

# Old names a user may still pass, and the name each became.
_RENAMED = {"timeout_s": "eval_timeout_s"}


def _renamed(keywords: Mapping[str, Any], stacklevel: int) -> dict[str, Any]:
    """``keywords`` with each old name given its new one, with a DeprecationWarning that names it.

    Raises:
        TypeError: both the old and the new name were given.
    """
    out = dict(keywords)
    for old, new in _RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{old} and {new} are one option (the evaluation deadline): pass {new} alone")
        warnings.warn(
            f"{old} is deprecated: the evaluation deadline is {new} everywhere", DeprecationWarning, stacklevel
        )
        out[new] = out.pop(old)
    return out


class GuardOptions(BaseModel):
    """Options of a guarded evaluation, validated once (:func:`eval_options` builds them).

    Attributes:
        eval_timeout_s: deadline of one attempt's evaluation, and of its barrier (seconds or timedelta).
        monitor: an object with ``log_metrics(dict, step)``; told about a failed evaluation.
        fallback: returned when every attempt failed.
        retries: further attempts after a failed one.
        shrink: called (no arguments, on every rank) before each retry, e.g. to halve the batch.
        grace_s: how long after the deadline the ranks wait for each other's answer; default
            ``max(2, eval_timeout_s / 20)``.
        deadline_guard: ``seconds -> context manager`` that ends the evaluation at its deadline;
            default :func:`python_deadline_guard`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=True)

    eval_timeout_s: float
    monitor: Any = None
    fallback: Any = (0.0, 0.0)
    retries: StrictInt = Field(0, ge=0, le=100)
    shrink: Callable[[], Any] | None = None
    grace_s: float | None = Field(None, gt=0)
    deadline_guard: Callable[[float], AbstractContextManager[Any]] = python_deadline_guard

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        # GuardOptions(timeout_s=...) made directly: the old name still works, with its warning.
        # stacklevel: warnings.warn, _renamed, this validator, pydantic's call, __init__, the caller.
        return _renamed(data, stacklevel=6) if isinstance(data, dict) else data

    @field_validator("eval_timeout_s", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> float:
        return to_seconds(value, "eval_timeout_s")

    @field_validator("monitor")
    @classmethod
    def _has_log_metrics(cls, value: Any) -> Any:
        if value is not None and not callable(getattr(value, "log_metrics", None)):
            raise ValueError(f"monitor must have a log_metrics(metrics: dict, step) method, got {type(value).__name__}")
        return value

    @property
    def timeout_s(self) -> float:
        """Deprecated: :attr:`eval_timeout_s`."""
        warnings.warn(
            "GuardOptions.timeout_s is deprecated: the evaluation deadline is eval_timeout_s everywhere",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.eval_timeout_s

    @property
    def grace(self) -> float:
        """Seconds past the deadline to wait for the answer."""
        return self.grace_s if self.grace_s is not None else max(2.0, self.eval_timeout_s / 20)


def eval_options(*, stacklevel: int = 2, **keywords: Unpack[EvalKeywords]) -> GuardOptions:
    """Builds a guarded evaluation's options from the evaluation keywords (every entry point passes its own here).

    Args:
        stacklevel: where an old name's DeprecationWarning points (2: the caller of this function;
            an entry point passes 3, its own caller).
        **keywords: the :class:`EvalKeywords`; ``eval_timeout_s`` is needed, the others take their
            defaults. ``timeout_s``, its old name, still works, with a ``DeprecationWarning``.

    Returns:
        The validated, frozen :class:`GuardOptions`.

    Raises:
        TypeError: no ``eval_timeout_s``, or a deadline that is neither a number nor a timedelta.
        pydantic.ValidationError: an unknown keyword or a bad value (a ValueError), before any rank
            waits on another.
    """
    given = _renamed(keywords, stacklevel + 1)
    if "eval_timeout_s" not in given:
        raise TypeError("missing the evaluation deadline: pass eval_timeout_s (seconds or a timedelta)")
    return GuardOptions(**given)
