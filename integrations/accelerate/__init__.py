"""guarded_evaluate and start_watchdog for a training loop written with Hugging Face Accelerate.

Accelerate users own their loop, so there is nothing to hook: the loop calls
:func:`guarded_evaluate` where it evaluates, and :func:`start_watchdog` once after the
``Accelerator`` is built (its state has joined the process group by then).

- :func:`guarded_evaluate` is the guard of :mod:`ncclguard.evaluation.guard` (one guard,
  not a second one) around a user's evaluation: every rank uses its result or every rank skips it,
  by the deadline. ``accelerator.gather_for_metrics``, ``gather``, ``reduce`` and
  ``gather_object`` inside it call ``torch.distributed`` with no group, so they run on the guard's
  side group and give up at the deadline. The evaluation is labelled with the phase ``eval``.
- A dataloader prepared by Accelerate registers itself in the shared ``GradientState`` when its
  iteration starts and removes itself when the iteration ends (``DataLoaderStateMixin.begin`` /
  ``end`` in ``accelerate/data_loader.py``), and ``gather_for_metrics`` reads that state to drop
  the samples ``even_batches`` added. An iteration cut short by the deadline never reaches
  ``end``, so after a skip the guard puts the list of registered dataloaders back as it was;
  otherwise the training loop would read the dead evaluation loader's state (the end of the
  dataloader, which decides gradient synchronisation under gradient accumulation).
- A skip is logged with ``accelerator.log`` (to the trackers, on the main process) as
  ``eval/evaluation_failed``.
- :func:`recovering_step` (its DDP step in :mod:`ncclguard.integrations.accelerate.recovery`): a training step
  that commits on every rank and is redone on a rebuilt world when it fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Unpack

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ncclguard.integrations.accelerate needs accelerate: pip install 'ncclguard[hf]'") from exc

import torch
import torch.distributed as dist

from ncclguard import WatchdogConfig, phase
from ncclguard import start_watchdog as _start_watchdog
from ncclguard.collectives.groups import group_timeout_s
from ncclguard.evaluation.guard import FAILED_METRIC, last_report, run_guarded
from ncclguard.evaluation.options import EvalKeywords, eval_options
from ncclguard.recovery.options import RecoveryKeywords
from ncclguard.toolkit import log
from ncclguard.watching.watchdog import Watchdog

from ..shared import SKIPPED, SkippedEvaluation, skip_record, timeout_problems, watchdog_config
from .recovery import AcceleratorRecoveringStep, follow_world

__all__ = [
    "AcceleratorRecoveringStep",
    "FAILED_METRIC",
    "SkippedEvaluation",
    "dataloaders_restored_on_skip",
    "follow_world",
    "guarded_evaluate",
    "last_skip",
    "recovering_step",
    "start_watchdog",
    "timeout_problems",
    "watchdog_config",
]


def _check_accelerator(accelerator: Any) -> None:
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.num_processes > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"the Accelerator reports {accelerator.num_processes} processes but no torch.distributed process group "
            "is initialized; ncclguard needs one (launch with `accelerate launch` or torchrun)"
        )


def start_watchdog(
    accelerator: Accelerator,
    config: WatchdogConfig | dict[str, Any] | None = None,
    *,
    eval_timeout_s: float | timedelta | None = None,
    **fields: Any,
) -> Watchdog:
    """Starts ncclguard's watchdog for the processes of ``accelerator``; call it on every rank.

    The Accelerator's state has joined the process group (rank, world size and the store come
    from it). The process group's timeout (``InitProcessGroupKwargs(timeout=...)``) is read from
    the live group, and a warning is logged when the hang timeout or ``eval_timeout_s`` is not
    below it. Stop the watchdog with ``.stop()`` at the end of training.

    Args:
        accelerator: the ``Accelerator`` of the loop.
        config: a ``WatchdogConfig`` or a dict of its fields; None for the defaults
            (``NCCLGUARD_WATCHDOG_*``).
        eval_timeout_s: the deadline you give :func:`guarded_evaluate`, checked against the
            group timeout too.
        **fields: ``WatchdogConfig`` fields applied on top of ``config``.

    Returns:
        The running :class:`ncclguard.Watchdog`.

    Raises:
        TypeError: ``accelerator`` is not an Accelerator, or ``config`` of a wrong type.
        RuntimeError: several processes but no process group, or a watchdog already runs here.
        pydantic.ValidationError: a bad field.
    """
    _check_accelerator(accelerator)
    cfg = watchdog_config(config)
    if fields:
        cfg = WatchdogConfig(**{**(cfg.model_dump(exclude_unset=True) if cfg is not None else {}), **fields})
    assert cfg is not None  # config=False is not offered here
    deadline = None if eval_timeout_s is None else eval_options(eval_timeout_s=eval_timeout_s).eval_timeout_s
    for problem in timeout_problems(group_timeout_s(), deadline, cfg.hang_timeout_s):
        log.warning("ncclguard watchdog for accelerate: %s", problem)
    return _start_watchdog(cfg)


@contextmanager
def dataloaders_restored_on_skip(gradient_state: Any) -> Iterator[Callable[[], None]]:
    """Yields ``restore()``, which puts the ``GradientState``'s registered dataloaders back as
    they were on entry (call it after a skip; see the module doc)."""
    saved = list(getattr(gradient_state, "dataloader_references", [None]))

    def restore() -> None:
        # The public property's setter keeps weak references, as accelerate's own updates do.
        gradient_state.dataloader_references = saved

    yield restore


def _models(accelerator: Accelerator, model: torch.nn.Module | None) -> torch.nn.Module:
    """The module(s) to put in eval mode during the evaluation."""
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return model
    # Accelerator keeps what prepare() returned in `_models`; without it eval mode covers nothing.
    prepared = [m for m in getattr(accelerator, "_models", []) if isinstance(m, torch.nn.Module)]
    return torch.nn.ModuleList(prepared)


def guarded_evaluate(
    accelerator: Accelerator,
    eval_fn: Callable[[], Any],
    *,
    model: torch.nn.Module | None = None,
    step: int | None = None,
    **evaluation: Unpack[EvalKeywords],
) -> Any:
    """Runs ``eval_fn`` on every rank with a deadline; all ranks use its result or all skip it.

    Call it on every rank at the same point of the loop, as any collective. Inside ``eval_fn``,
    ``accelerator.gather_for_metrics`` and the other Accelerate collectives are bounded by the
    deadline (see the module doc).

    Args:
        accelerator: the ``Accelerator`` of the loop.
        eval_fn: the evaluation, no arguments; its return value is returned.
        model: the module(s) to hold in eval mode during ``eval_fn`` and restore after (default:
            every model ``accelerator.prepare`` returned).
        step: the training step, for the phase label, the tracker log and the skip record.
        **evaluation: the evaluation keywords every entry point takes
            (:class:`~ncclguard.evaluation.options.EvalKeywords`): ``eval_timeout_s`` (needed: the
            deadline of each attempt, seconds or timedelta; ``timeout_s``, its old name, works with a
            DeprecationWarning), ``fallback`` (returned when the evaluation is skipped; here None by
            default), ``retries``, ``shrink``, ``monitor``, ``grace_s``, ``deadline_guard``.

    Returns:
        ``eval_fn``'s result, or ``fallback`` when every rank skipped it. :func:`last_skip`
        then describes the skip.

    Raises:
        TypeError, ValueError, RuntimeError: bad arguments (before any rank waits on another).
    """
    _check_accelerator(accelerator)
    module = _models(accelerator, model)
    if not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable with no arguments, got {type(eval_fn).__name__}")
    fallback = evaluation.pop("fallback", None)
    # The guard's fallback is SKIPPED, so that a skip is told apart from any value eval_fn returns.
    opts = eval_options(stacklevel=3, **evaluation).model_copy(update={"fallback": SKIPPED})
    labels = {} if step is None else {"step": step}
    start = time.monotonic()
    with phase("eval", **labels), dataloaders_restored_on_skip(accelerator.gradient_state) as restore:
        value = run_guarded(module, eval_fn, opts, step)
        if value is not SKIPPED:
            _last.skip = None
            return value
        restore()
    report = last_report()
    skip = _last.skip = skip_record(report, step, time.monotonic() - start)
    log.warning("evaluation at step %s skipped on every rank after %.2f s: %s", step, skip.elapsed_s, skip.reason)
    metrics = {FAILED_METRIC: 1.0, "eval/attempts": float(report.attempts if report is not None else 1)}
    try:
        accelerator.log(metrics, step=step)
    except Exception:  # noqa: BLE001 - a tracker must never take training down
        log.exception("accelerator.log failed while reporting a skipped evaluation")
    return fallback


class _LastSkip:
    """Holds the last skip of this process (one holder, mutated; no module global rebound)."""

    __slots__ = ("skip",)

    def __init__(self) -> None:
        self.skip: SkippedEvaluation | None = None


_last = _LastSkip()


def last_skip() -> SkippedEvaluation | None:
    """The skip of the last :func:`guarded_evaluate` on this process.

    Returns:
        The :class:`SkippedEvaluation`, or None when the last call was not skipped (or none ran).
    """
    return _last.skip


def recovering_step(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rebuild: Callable[[], Any] | None = None,
    scheduler: Any = None,
    **recovery: Unpack[RecoveryKeywords],
) -> Any:
    """A recovering step for an Accelerate loop (see the module doc).

    Args:
        accelerator: the loop's ``Accelerator``.
        model: under DDP, the model ``accelerator.prepare`` returned; with the DeepSpeed plugin, the
            model before ``prepare`` (the step prepares it; the engine ``prepare`` returned is taken
            too, except by a restarted process on ZeRO-3: docs/stacks/accelerate.md).
        optimizer: the optimizer, prepared or not as ``model``.
        rebuild: with the DeepSpeed plugin only, builds a fresh module and optimizer
            (:class:`~ncclguard.integrations.accelerate.deepspeed.AcceleratorDeepSpeedStep`).
        scheduler: your LR scheduler, which your loop steps once per applied step: a healed rank
            receives its state (DDP only; with the DeepSpeed plugin, give DeepSpeed the scheduler).
        **recovery: the recovery keywords every adapter takes
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`), passed on whole.

    Returns:
        An :class:`AcceleratorRecoveringStep`; with the DeepSpeed plugin an
        :class:`~ncclguard.integrations.accelerate.deepspeed.AcceleratorDeepSpeedStep`.

    Raises:
        TypeError, ValueError: see those classes; ``rebuild`` without the DeepSpeed plugin.
    """
    if isinstance(accelerator, Accelerator) and accelerator.distributed_type == DistributedType.DEEPSPEED:
        from .deepspeed import AcceleratorDeepSpeedStep  # lazily: it needs deepspeed installed

        if scheduler is not None:
            raise TypeError(
                "scheduler= is for a DDP model; with the DeepSpeed plugin give DeepSpeed the scheduler (its config's "
                "scheduler, or accelerator.prepare(..., scheduler) before the engine is made): the engine keeps its state"
            )
        return AcceleratorDeepSpeedStep(accelerator, model, optimizer, rebuild=rebuild, **recovery)
    if rebuild is not None:
        raise TypeError(
            "rebuild= builds a DeepSpeed engine's module afresh; this Accelerator has no DeepSpeed plugin, and a "
            "DDP model is re-pointed after a rebuild, not built again: leave rebuild out"
        )
    return AcceleratorRecoveringStep(accelerator, model, optimizer, scheduler=scheduler, **recovery)
