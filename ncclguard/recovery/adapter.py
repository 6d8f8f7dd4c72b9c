"""What one framework supplies to the recovery engine (:class:`Adapter`), and how it asks the engine
to enter its loop again (:class:`Reenter`); everything else is the engine's
(:mod:`ncclguard.recovery.engine`).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ncclguard.recovery.heal import HealResult
    from ncclguard.recovery.rebuild import RebuildResult
    from ncclguard.recovery.records import Recovered
    from ncclguard.recovery.snapshots.state import StateCodec

__all__ = ["Adapter", "Reenter"]


class Reenter(Exception):
    """Raised by an adapter's :meth:`Adapter.rewrap` when its framework's loop must be entered again
    at the failed step on every rank (a restarted rank joined: it starts there, so the survivors
    start there too, and their collectives meet). The engine keeps the step's transaction, which
    the next :meth:`Recovery.begin` for it goes on with."""


class Adapter(abc.ABC):
    """What one framework supplies to the engine; everything else is the engine's.

    Subclasses say how to reach the module and its optimizer, how to re-wrap the model on a new
    world, and optionally what to keep beyond the snapshot, how to clear the gradients before an
    attempt and where to log a recovery.

    Attributes:
        name: how logs name the adapter (``"guard_trainer"``, ``"RecoveringStep"``, ...).
    """

    name = "recovery"
    #: True when the framework builds the model that holds sharded state only as its own loop starts
    #: (the HF Trainer builds its DeepSpeed engine inside ``train()``): a restarted rank then joins
    #: without a restore, and the adapter restores in two halves, :meth:`Recovery.fetch_snapshot`
    #: before the loop (the step, the replicas) and :meth:`Recovery.put_snapshot_back` once the model is built.
    restores_in_loop = False

    @abc.abstractmethod
    def get_module(self) -> torch.nn.Module:
        """The unwrapped module (its buffers are kept, its state is healed)."""

    def get_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose state a heal sends (None: none is sent)."""
        return None

    def keep(self) -> Any:
        """What a redo must find as the step found it, beyond the buffers and the generators."""
        return None

    def restore(self, kept: Any) -> None:
        """Puts back what :meth:`keep` took, before a redo."""
        return None

    def zero_grad(self) -> None:
        """Clears the gradients before an attempt (default: the optimizer's, to None)."""
        opt = self.get_optimizer()
        if opt is not None:
            opt.zero_grad(set_to_none=True)

    def discard_gradients(self, redo: bool) -> None:
        """After a step whose values every rank refused (a NaN or an Inf, no rebuild) and
        :meth:`zero_grad`: drops what the framework still holds of that step's gradients beyond
        the parameters' ``.grad`` (DeepSpeed's ZeRO keeps them in its own partitions), so that the
        redo, the next batch or the caller of a raise starts clean. Default: nothing.

        Args:
            redo: the step runs again now (else it is skipped or raised).

        Raises:
            Reenter: (``redo`` only) the framework must enter its loop again at this step to build
                what holds no refused gradient (the HF Trainer's DeepSpeed engine); the step's
                attempts so far are carried to it.
        """
        return None

    @abc.abstractmethod
    def rewrap(self, rebuilt: RebuildResult) -> None:
        """Drops what was built on the old world and builds it on the new one (DDP, a framework's
        rank and size); called after every successful rebuild, before the redo."""

    def log(self, record: Recovered) -> None:
        """Logs a recovered step to the framework's trackers (the engine logs it to ncclguard's)."""
        return None

    def heal_extra(self) -> Any:
        """On a live rank: what a restarted rank needs besides the module and the optimizer (a
        trainer's state, a scheduler's): tensors and JSON values, sent with the heal."""
        return None

    def on_healed(self, result: HealResult) -> None:
        """On a restarted rank: takes what :meth:`heal_extra` sent (``result.extra``)."""
        return None

    def state_codec(self) -> StateCodec | None:
        """How to take this rank's own state out of the model and put it back, for a model whose
        ranks hold different state (FSDP2's shards, DeepSpeed ZeRO's partitions): with ``heal``,
        the engine then keeps snapshots replicated on a buddy rank and restores a restarted rank
        from them (:mod:`ncclguard.recovery.snapshots`). None (the default): every rank holds the
        same state, and a live peer sends it whole (:func:`~ncclguard.recovery.heal.heal_from_peer`)."""
        return None

    def wrap_joined(self) -> None:
        """On a restarted rank with sharded state, after it joined the world and before the
        restore: builds what holds the state on the joined world (FSDP2 shards the module)."""
        return None

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """On every rank, after a stop every rank agreed on (SIGTERM): writes the newest state in
        the framework's own checkpoint format under ``directory`` (:mod:`ncclguard.recovery.preempt`).

        Args:
            directory: the preemption directory (it exists).
            step: the number of the last step applied.

        Returns:
            The checkpoint to give the framework's resume call.

        Raises:
            NotImplementedError: this adapter has no writer (the stop goes on; nothing is written).
        """
        raise NotImplementedError(f"{self.name} has no checkpoint writer for a preemption")
