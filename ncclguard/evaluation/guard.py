"""guarded_evaluate: an evaluation that can fail without taking the training job down.

The seeds' job died at its first evaluation: one rank was still evaluating while the others
waited for it in a collective, until NCCL's 10-minute watchdog killed the job. Here an
evaluation either completes on every rank or is skipped on every rank, by a deadline, and the
training process group is left as it was. Per attempt, on every rank:

1. ``safe_barrier`` on the world group (store based): a rank that is not there makes every
   rank skip this attempt.
2. ``eval_fn`` runs in eval mode (engine and wrapped model, restored afterwards) under the
   deadline ``eval_timeout_s``: the SIGALRM guard ends Python-level stalls (the default
   ``deadline_guard``; another per-call deadline mechanism plugs in through that option),
   and collectives that name no group go to a side gloo group whose timeout follows the deadline
   (:mod:`ncclguard.evaluation.side_group`), so a blocked ``dist.all_reduce`` gives up by the
   deadline and kills only that side group.
3. An :class:`EvalSums` result is all-reduced by the guard with ``safe_all_reduce`` on the side group.
4. The ranks agree through the store (``ncclguard.collectives.rendezvous.exchange``) on the outcome: all use
   their result or all skip it. A rank that comes late learns the answer at once.
5. On an agreed failure the side group is discarded (the next attempt builds a new one), and
   after ``retries`` further attempts, each after ``shrink()``, ``monitor.log_metrics`` gets
   ``eval/evaluation_failed`` and the fallback is returned.

Nothing here imports a framework: the engine is used as the ``torch.nn.Module`` it is, so a plain
model, a DDP wrapper or a DeepSpeed engine works the same. The integrations
(:mod:`ncclguard.integrations.deepspeed`, ``hf``, ``accelerate``, ``lightning``) wrap this one
guard. docs/reference/integrations-evaluation.md lists the limits (NCCL, ZeRO-3).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Unpack

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.collectives.all_reduce import safe_all_reduce
from ncclguard.collectives.barrier import safe_barrier
from ncclguard.collectives.groups import GroupInfo, group_info
from ncclguard.collectives.numbering import next_round
from ncclguard.collectives.rendezvous import exchange
from ncclguard.deadlines import Deadline
from ncclguard.errors import EvaluationFailed, StoreUnreachable
from ncclguard.evaluation.modes import eval_mode
from ncclguard.evaluation.options import EvalKeywords, GuardOptions, eval_options, python_deadline_guard
from ncclguard.evaluation.side_group import EvalGroup, deadline_timeout, routed_default_group
from ncclguard.results import Result

__all__ = [
    "FAILED_METRIC",
    "EvalSums",
    "EvalKeywords",
    "EvalReport",
    "GuardOptions",
    "eval_options",
    "guarded_evaluate",
    "last_report",
    "python_deadline_guard",
    "run_guarded",
]

FAILED_METRIC = "eval/evaluation_failed"


@dataclass(frozen=True)
class EvalSums:
    """Per-rank sums an ``eval_fn`` may return instead of final metrics; the guard reduces them.

    The guard returns ``(loss_sum / count, correct / count)`` over all ranks.
    """

    loss_sum: float
    correct: float
    count: float


@dataclass
class EvalReport(Result):
    """What the last guarded evaluation did on this rank; truthy when it succeeded.

    Attributes:
        ok: an attempt succeeded on every rank.
        value: what was returned (the result, or the fallback).
        attempts: attempts made (1 + retries used).
        reasons: why each failed attempt failed, as agreed (one entry per failed attempt).
        failed_ranks: global ranks that failed or were missing in the last failed attempt.
        elapsed_s: seconds in the whole call.
        error: an :class:`~ncclguard.errors.EvaluationFailed` when every attempt failed, else None.
    """

    ok: bool
    value: Any
    attempts: int = 0
    reasons: list[str] = field(default_factory=list)
    failed_ranks: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    error: EvaluationFailed | None = None


_eval_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, EvalGroup] = weakref.WeakKeyDictionary()


class _LastReport:
    """Holds the last report of this process (one holder, mutated; no module global rebound)."""

    __slots__ = ("report",)

    def __init__(self) -> None:
        self.report: EvalReport | None = None


_last = _LastReport()


def last_report() -> EvalReport | None:
    """The report of the last guarded evaluation on this process, or None.

    Returns:
        The :class:`EvalReport` of the last :func:`guarded_evaluate` (or integration built on
        it) that returned here, or None before the first one.
    """
    return _last.report


def guarded_evaluate(
    engine: torch.nn.Module,
    eval_fn: Callable[[], Any],
    *,
    step: int | None = None,
    **evaluation: Unpack[EvalKeywords],
) -> Any:
    """Runs ``eval_fn`` on every rank with a deadline; all ranks use its result or all skip it.

    Call it on every rank at the same point of training, like any collective.

    Args:
        engine: the DeepSpeed engine (or any ``torch.nn.Module``) being evaluated; it and the
            model it wraps are in eval mode during ``eval_fn`` and get their modes back after.
        eval_fn: the evaluation, no arguments; returns the metrics (e.g. ``(loss, accuracy)``)
            or an :class:`EvalSums` for the guard to reduce. It may call ``torch.distributed``
            collectives with ``group=None``: they run on a side group bounded by the deadline.
        step: the training step, for the monitor.
        **evaluation: the evaluation keywords (:class:`~ncclguard.evaluation.options.EvalKeywords`):
            ``eval_timeout_s`` (needed: the deadline of each attempt, seconds or timedelta; its old
            name ``timeout_s`` works with a DeprecationWarning), ``monitor`` (``log_metrics(dict,
            step)`` receives ``eval/evaluation_failed`` on failure), ``fallback`` (returned when
            every attempt failed), ``retries`` (further attempts after a failed one), ``shrink``
            (called before each retry on every rank, e.g. to halve the evaluation batch),
            ``grace_s`` and ``deadline_guard``.

    Returns:
        ``eval_fn``'s result (reduced, for :class:`EvalSums`), or ``fallback``.

    Raises:
        TypeError, ValueError: bad arguments (before any rank waits on another).
    """
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable with no arguments, got {type(eval_fn).__name__}")
    if not isinstance(engine, torch.nn.Module):
        raise TypeError(f"engine must be a DeepSpeed engine or a torch.nn.Module, got {type(engine).__name__}")
    return run_guarded(engine, eval_fn, eval_options(stacklevel=3, **evaluation), step)


def run_guarded(engine: torch.nn.Module, eval_fn: Callable[[], Any], opts: GuardOptions, step: int | None) -> Any:
    """:func:`guarded_evaluate` with validated options (for integrations that hold a
    :class:`GuardOptions`, e.g. a patched trainer's ``evaluate``).

    Args:
        engine: the module to hold in eval mode during ``eval_fn``.
        eval_fn: the evaluation, no arguments.
        opts: the options.
        step: the training step, for the monitor.

    Returns:
        ``eval_fn``'s result (reduced, for :class:`EvalSums`), or ``opts.fallback``;
        :func:`last_report` describes the call.
    """
    start = time.monotonic()
    world = group_info(None)
    report = EvalReport(ok=False, value=opts.fallback)
    with eval_mode(engine):
        for attempt in range(opts.retries + 1):
            report.attempts = attempt + 1
            shrink_error = _shrink(opts) if attempt else None
            ok, value, reason, failed = _attempt(world, eval_fn, opts, shrink_error)
            if ok:
                report.ok, report.value = True, value
                break
            report.reasons.append(f"attempt {attempt + 1}: {reason}")
            report.failed_ranks = failed
            log.warning("guarded evaluation, attempt %d of %d failed: %s", attempt + 1, opts.retries + 1, reason)
    report.elapsed_s = time.monotonic() - start
    if not report.ok:
        report.error = EvaluationFailed(
            f"the evaluation was skipped on every rank after {report.attempts} attempt(s): "
            + (report.reasons[-1] if report.reasons else "no reason given"),
            reasons=report.reasons,
            failed_ranks=report.failed_ranks,
        )
    _last.report = report
    if not report.ok:
        _tell_monitor(opts.monitor, report, step)
    return report.value


def _shrink(opts: GuardOptions) -> str | None:
    """Calls ``shrink``; an error is returned, not raised, so this rank still takes part in the attempt."""
    if opts.shrink is None:
        return None
    try:
        opts.shrink()
    except Exception as exc:  # noqa: BLE001 - a user's shrink() may raise anything; the attempt goes on
        log.exception("shrink() failed")
        return f"shrink() failed: {type(exc).__name__}: {exc}"
    return None


def _attempt(
    world: GroupInfo | None, eval_fn: Callable[[], Any], opts: GuardOptions, local_error: str | None
) -> tuple[bool, Any, str, list[int]]:
    """One attempt. Returns (ok on every rank, value, agreed reason, failed global ranks)."""
    if world is None or world.size == 1:
        value, error = _run_local(eval_fn, opts, None, Deadline.within(opts.eval_timeout_s), local_error)
        return error is None, value, error or "", [] if error is None else [0]

    barrier = safe_barrier(opts.eval_timeout_s)
    if not barrier:
        late = [world.global_rank(world.rank)] if barrier.late else []  # this rank is the missing one
        return False, None, f"barrier before the evaluation failed: {barrier.error}", barrier.missing_ranks or late
    deadline = Deadline.within(opts.eval_timeout_s)
    evals = _eval_groups.setdefault(world.group, EvalGroup())
    value, error = _run_local(eval_fn, opts, evals, deadline, local_error)
    try:
        answer = exchange(
            world, next_round(world, "guarded_eval"), {"ok": error is None, "error": error}, deadline.plus(opts.grace)
        )
    except StoreUnreachable as exc:
        evals.discard()
        return False, None, f"could not agree on the outcome: {exc}", []
    failed = {r: p["error"] for r, p in answer.payloads.items() if not p["ok"]}
    if answer.ok and not failed:
        return True, value, "", []
    evals.discard()
    missing = [world.global_rank(r) for r in answer.missing]
    parts = [f"rank {world.global_rank(r)}: {e}" for r, e in sorted(failed.items())]
    if missing:
        parts.append(f"ranks {missing} gave no answer within {opts.grace:g} s of the deadline")
    elif answer.late:
        parts.append("this rank gave its answer after the others had given up")
    ranks = sorted({world.global_rank(r) for r in failed} | set(missing))
    return False, None, "; ".join(parts), ranks


def _run_local(
    eval_fn: Callable[[], Any], opts: GuardOptions, evals: EvalGroup | None, deadline: Deadline, local_error: str | None
) -> tuple[Any, str | None]:
    """Runs eval_fn on this rank under the deadline. Returns (value, None) or (None, error text)."""
    if local_error is not None:
        return None, local_error
    try:
        if evals is None:
            with opts.deadline_guard(opts.eval_timeout_s):
                return _finish(eval_fn(), None, deadline), None
        group = evals.get(opts.eval_timeout_s)
        # The SIGALRM guard is innermost so that its exception can never land in the code that
        # restores the default group or stops the timeout thread.
        with deadline_timeout(group, deadline), routed_default_group(group):
            with opts.deadline_guard(max(deadline.left(), 1e-3)):
                value = eval_fn()
        return _finish(value, group, deadline), None
    except Exception as exc:  # noqa: BLE001 - any failure of eval_fn becomes this rank's answer
        reason = _describe(exc)
        log.warning("evaluation failed on this rank: %s", reason)
        return None, reason


def _describe(exc: BaseException) -> str:
    """One line for the report; names the exception the deadline interrupted, if any.

    When a collective gives up at the deadline, the SIGALRM guard's exception is raised while
    the collective's error propagates: the latter (its context) says where the rank was waiting.
    """
    text = f"{type(exc).__name__}: {exc}"
    inner = exc.__cause__ or exc.__context__
    if inner is not None:
        first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        text += f" (during {type(inner).__name__}: {first})"
    return text[:500]


def _finish(value: Any, group: dist.ProcessGroup | None, deadline: Deadline) -> Any:
    """Reduces an EvalSums over the side group; any other value is returned as it is."""
    if not isinstance(value, EvalSums):
        return value
    sums = torch.tensor([value.loss_sum, value.correct, value.count], dtype=torch.float64)
    if group is not None:
        if deadline.passed():
            raise TimeoutError("no time left before the deadline to reduce the evaluation's sums")
        # No explicit timeout: the side group's own timeout follows the deadline (deadline_timeout),
        # and the default deadline is capped below it, so the reduction gives up before the deadline.
        # (An explicit `remaining` could round above the group's timeout, which torch keeps in ms.)
        safe_all_reduce(sums, dist.ReduceOp.SUM, group).raise_for_error()
    loss_sum, correct, count = sums.tolist()
    if not count > 0 or not math.isfinite(loss_sum):
        raise ValueError(f"no usable evaluation result: loss_sum={loss_sum}, count={count}")
    return loss_sum / count, correct / count


def _tell_monitor(monitor: Any, report: EvalReport, step: int | None) -> None:
    """Sends ``eval/evaluation_failed`` to the monitor; its failure is logged, never raised."""
    if not callable(getattr(monitor, "log_metrics", None)):
        return
    metrics = {
        FAILED_METRIC: 1.0,
        "eval/attempts": float(report.attempts),
        "eval/failure_reason": report.reasons[-1] if report.reasons else "",
    }
    try:
        monitor.log_metrics(metrics, step)
    except Exception:  # noqa: BLE001 - a monitor must never take training down
        log.exception("monitor.log_metrics failed while reporting a failed evaluation")
