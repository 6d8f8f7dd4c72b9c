"""Preemption under ``NcclGuardCallback(recover=True)``: SIGTERM stops every rank at one agreed step,
with Lightning's own checkpoint to resume from (:mod:`ncclguard.recovery.preempt`).

Lightning 2.6 has its own SIGTERM handling, which cannot run beside the engine's
(``trainer/connectors/signal_connector.py``, ``loops/training_epoch_loop.py``):

- ``Trainer._run`` calls ``_SignalConnector.register_signal_handlers()`` once the model and the
  checkpoint are set up, just before ``_run_stage``; it sets SIGTERM to a composition of its
  ``_sigterm_notifier_fn`` and the handler that was there (the engine's). That notifier calls
  ``dist.broadcast`` from inside the signal handler, wherever the main thread was (a broadcast that
  can meet another rank's DDP all_reduce), and sets ``received_sigterm``;
- ``_TrainingEpochLoop.on_advance_end`` raises ``SIGTERMException`` at the batch's end on every rank
  that received SIGTERM, and ``advance`` broadcasts rank 0's flag before each batch: the commit
  never gets a say, and a rank told alone stops alone.

So, with ``recover=True``, the callback wraps (on the trainer's instances, undone at teardown):

- ``register_signal_handlers``: Lightning's handlers are set as usual (SIGUSR1 and SLURM's
  requeue included), then SIGTERM is taken back by the engine's handler, which only notes the
  request (:func:`~ncclguard.recovery.preempt.take_sigterm`): ``received_sigterm`` stays False, so
  Lightning's loops never raise ``SIGTERMException`` and broadcast 0;
- ``_SignalConnector.teardown``: SIGTERM is given back to Lightning's handler first, then Lightning
  restores the handlers that were there before ``fit`` (the engine's), as it always does;
- ``on_advance_end`` of the training epoch loop: after it (the batch's hooks, the LR schedulers,
  a validation that was due: where Lightning itself raises ``SIGTERMException``), when the step's
  commit said stop on every rank, every rank writes ``trainer.save_checkpoint`` into the preemption
  directory and exits 143 (:func:`~ncclguard.recovery.preempt.stop_now`). A checkpoint taken there
  resumes through Lightning's own restart logic (``_TrainingEpochLoop.update_restart_stage``: a
  checkpoint taken between batches) with ``trainer.fit(model, ckpt_path=path)``. A stop agreed at
  the last step lets ``fit`` end as usual, as Lightning does (``not self._is_training_done``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncclguard.recovery.preempt import give_sigterm_back, stop_now, take_sigterm

if TYPE_CHECKING:
    from .recovery import StepRecovery

__all__ = ["preempt_wrappers", "save_lightning"]


def save_lightning(trainer: Any, directory: Path, *, sharded: bool) -> Path:
    """Lightning's own checkpoint of the step just applied, written by ``trainer.save_checkpoint``
    (every rank calls it): ``epoch=<E>-step=<global_step>.ckpt`` under DDP, the directory of the same
    name (``torch.distributed.checkpoint`` shards plus Lightning's ``meta.pt``) under
    ``ModelParallelStrategy``.

    Args:
        trainer: the trainer.
        directory: the preemption directory (it exists).
        sharded: ``ModelParallelStrategy`` (its ``save_checkpoint`` writes a directory).

    Returns:
        The checkpoint, for ``trainer.fit(model, ckpt_path=...)``.
    """
    name = f"epoch={trainer.current_epoch}-step={trainer.global_step}"  # ModelCheckpoint's default name
    path = directory / (name if sharded else f"{name}.ckpt")
    trainer.save_checkpoint(path)
    return path


def preempt_wrappers(trainer: Any, recovery: StepRecovery) -> list[tuple[Any, str, Callable[..., Any]]]:
    """The instance attributes the callback sets for a preemption (the module doc says why).

    Args:
        trainer: the trainer, in the callback's ``setup`` for ``fit``.
        recovery: the engine's adapter (its ``save_checkpoint`` writes the checkpoint; its engine
            says whether a stop was agreed, ``stop_after``, and where to write).

    Returns:
        ``(owner, attribute, wrapper)`` for the callback's ``_wrap``.
    """
    connector, epoch_loop = trainer._signal_connector, trainer.fit_loop.epoch_loop
    register, teardown, advance_end = connector.register_signal_handlers, connector.teardown, epoch_loop.on_advance_end
    lightnings: list[Any] = []  # Lightning's SIGTERM handler while the engine's holds the signal

    def register_signal_handlers() -> None:
        register()
        lightnings.append(take_sigterm())

    def teardown_signals() -> None:
        while lightnings:
            give_sigterm_back(lightnings.pop())
        teardown()

    def on_advance_end(data_fetcher: Any) -> None:
        advance_end(data_fetcher)
        engine = recovery.engine  # read now: ModelParallelStrategy makes the engine again in setup
        if engine.stop_after is not None and not epoch_loop._is_training_done:
            stop_now(recovery, engine.options.preempt_dir, engine.stop_after)

    return [
        (connector, "register_signal_handlers", register_signal_handlers),
        (connector, "teardown", teardown_signals),
        (epoch_loop, "on_advance_end", on_advance_end),
    ]
