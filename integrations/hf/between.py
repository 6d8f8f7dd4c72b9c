"""Failures between two steps of the HF Trainer, under ``guard_trainer(recover=True)``.

The recovery engine's transaction covers ``training_step`` (:mod:`ncclguard.integrations.hf.recovery`),
but the Trainer runs collectives of its own outside it, between two optimizer steps
(transformers 5.x, ``Trainer._run_epoch``):

- ``_maybe_log_save_evaluate``: the loss of a logging step is averaged over the ranks with
  ``nested_gather(tr_loss)`` (an ``all_gather``), an evaluation gathers its predictions, a save
  under DeepSpeed gathers and waits for every rank;
- ``get_batch_samples`` → ``_get_num_items_in_batch``: the items of a step are summed over the
  ranks (``accelerator.gather``) when the model takes ``num_items_in_batch``;
  ``_track_num_input_tokens`` (``include_num_input_tokens_seen``), after each micro-batch;
- ``_finalize_training``, after the last step: ``store_flos`` (an ``all_gather``), the best model
  loaded (``load_best_model_at_end``);
- the callbacks (``CallbackHandler.call_event``: ``on_step_end``, ``on_log``, ``on_evaluate``,
  ``on_save``, ...), where users' own collectives run;
- under DeepSpeed, the engine's step held until the commit and applied after it (ZeRO's gradient
  norm is an ``all_reduce``).

A rank that dies there (SIGKILL in an ``on_step_end`` callback, the OOM killer) makes its peers'
collective raise ("Connection closed by peer") outside any transaction: the error used to leave
``trainer.train()`` on every survivor, so every rank of the job died and the restarted processes
waited for survivors that were not there. :class:`BetweenSteps` wraps those calls on the trainer
instance: while ``train()`` runs, a failure of the distributed backend there
(:func:`backend_failure`) is kept, not raised, and becomes the failure of the next step's
transaction (or, after the last step, of one settled as ``train()`` ends): every rank's commit
fails, the world is rebuilt, the dead rank restarted and healed, as for a failure inside a step.
What the failed call had left to do (the log of that step, an evaluation, a save) is done again
only where the recovery goes back to an earlier step (a snapshot's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from ncclguard.toolkit import log

__all__ = ["BetweenSteps", "backend_failure"]

_COUNT = "_get_num_items_in_batch"  # also counted inside a step's redo (hf/recovery.py): a failure there is the step's
# The Trainer's methods (transformers 5.x) that run collectives outside training_step, and what they do.
_BETWEEN = (
    ("_maybe_log_save_evaluate", "the log, evaluation or save"),  # nested_gather(tr_loss), eval gathers, a save
    (_COUNT, "counting the step's items over the ranks"),  # accelerator.gather
    ("_track_num_input_tokens", "counting the input tokens over the ranks"),  # accelerator.gather, per micro-batch
    ("store_flos", "summing the FLOs over the ranks"),  # distributed_broadcast_scalars, in _finalize_training too
    ("_load_best_model", "loading the best model at the end"),  # DeepSpeed's load_checkpoint
)


def backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the distributed backend: a ``RuntimeError`` (gloo's and
    NCCL's errors, torch's ``DistError`` family) raised inside ``torch.distributed``, or caused by one.
    A user's bug (a ``KeyError`` in a metric, a ``RuntimeError`` of a tensor op) is not one."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, dist.DistError):
            return True
        if isinstance(found, RuntimeError) and _raised_in_torch_distributed(found):
            return True
        found = found.__cause__
    return False


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch.distributed"):
            return True
        tb = tb.tb_next
    return False


class BetweenSteps:
    """Keeps a backend failure raised between two steps for the next step's transaction (module doc).

    Args:
        trainer: the ``transformers.Trainer``.
        in_step: tells whether a step's transaction is open (the items of a redo are counted inside it).

    Attributes:
        active: True while ``trainer.train()`` runs (outside it every call raises as it would).
        failure: the failure kept for the next transaction, or None.
    """

    def __init__(self, trainer: Any, in_step: Callable[[], bool]) -> None:
        self.trainer, self._in_step = trainer, in_step
        self.active = False
        self.failure: BaseException | None = None

    def install(self) -> None:
        """Wraps, on the instance, the Trainer's calls between steps that run collectives."""
        trainer = self.trainer
        for name, what in _BETWEEN:
            original = getattr(trainer, name, None)
            if callable(original):  # another version of transformers may lack one
                setattr(trainer, name, self._wrapped(original, what, step_own=name == _COUNT))
        handler = trainer.callback_handler
        handler.call_event = self._callbacks(handler.call_event)

    @contextmanager
    def in_train(self) -> Iterator[None]:
        """Marks ``trainer.train()`` running: the failures are kept only then."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def run(self, fn: Callable[[], Any], what: str, on_failure: Callable[[], Any] = lambda: None) -> Any:
        """``fn()``; a backend failure while ``train()`` runs is kept instead of raised, and
        ``on_failure()`` is returned."""
        try:
            return fn()
        except Exception as exc:
            if not (self.active and backend_failure(exc)):
                raise
            self.keep(exc, what)
            return on_failure()

    def keep(self, exc: BaseException, what: str) -> None:
        """Keeps ``exc`` for the next transaction (the first one kept wins)."""
        if self.failure is not None:
            log.debug("guard_trainer: %s failed too (%s: %s)", what, type(exc).__name__, exc)
            return
        self.failure = exc
        log.warning(
            "guard_trainer: %s failed on this rank between two steps at global step %d (%s: %s); the next step "
            "fails on every rank and is recovered as a step that failed",
            what,
            self.trainer.state.global_step,
            type(exc).__name__,
            exc,
        )

    def take(self) -> BaseException | None:
        """The failure kept, now forgotten here."""
        failure, self.failure = self.failure, None
        return failure

    def _wrapped(
        self,
        original: Callable[..., Any],
        what: str,
        step_own: bool = False,
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if step_own and self._in_step():  # a redo's count: a failure there is the step's own
                return original(*args, **kwargs)
            return self.run(lambda: original(*args, **kwargs), what)

        call.__doc__ = (
            f"{getattr(original, '__qualname__', what)}; a backend failure is kept for the next step (ncclguard)"
        )
        return call

    def _callbacks(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``CallbackHandler.call_event``: a callback's backend failure is kept, and the event returns
        the control it was given (the Trainer assigns it)."""

        def call_event(event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            return self.run(
                lambda: original(event, args, state, control, **kwargs), f"the {event} callbacks", lambda: control
            )

        call_event.__doc__ = "CallbackHandler.call_event; a backend failure is kept for the next step (ncclguard)"
        return call_event
