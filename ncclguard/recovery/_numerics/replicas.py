"""The recovery engine's replica check (docs/numerics.md, "Replicas checked"): every
``replica_check_every`` steps each rank states a digest of its parameters and its optimizer's state
as the step found them (:func:`~ncclguard.recovery._numerics.digest.replica_digests`); the commit
names a rank whose digest differs from the majority's (:mod:`ncclguard.recovery._numerics.drift`),
the same on every rank, and the step is not applied. :meth:`ReplicaCheck.heal` then copies a
majority peer's parameters and optimizer state to the drifted ranks in the same world (the heal
transport, :func:`~ncclguard.recovery.heal.heal_from_peer`; no rebuild) and the engine redoes the
step. Without a majority (two ranks that differ) nobody can be named:
:class:`~ncclguard.errors.ReplicasDiverged` on every rank.

On the DDP wrapper ``RecoveringStep`` builds (:meth:`ReplicaCheck.install`) and on a framework's own
``DistributedDataParallel`` (Accelerate's, the HF Trainer's, Lightning's: :meth:`ReplicaCheck.adopt`),
where every rank holds the whole replica. FSDP2 and DeepSpeed shard it: not covered, said once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.errors import ReplicasDiverged
from ncclguard.recovery._commit.said import note_replicas
from ncclguard.recovery._numerics.digest import replica_digests
from ncclguard.recovery._numerics.drift import ReplicaDrift
from ncclguard.recovery._numerics.policy import Suspects
from ncclguard.recovery._numerics.told import tell_drift
from ncclguard.recovery.adapter import Adapter
from ncclguard.recovery.commit import CommitResult
from ncclguard.recovery.heal import HealResult, heal_from_peer

__all__ = ["DriftSeen", "ReplicaCheck"]

MAX_SEEN = 100  # findings kept in ReplicaCheck.seen


@dataclass(frozen=True)
class DriftSeen:
    """One drifted replica as the engine healed it (:attr:`ReplicaCheck.seen`).

    Attributes:
        step: the loop's step number.
        ranks: the drifted ranks.
        parts: by part, the ranks whose digest of it differed.
        source: the majority rank they were healed from.
        healed: the heal succeeded.
    """

    step: int
    ranks: list[int]
    parts: dict[str, list[int]]
    source: int
    healed: bool


class ReplicaCheck:
    """One engine's replica check (see the module doc).

    Args:
        every: the check's period in steps; None: off.
        adapter: the engine's adapter (its module and optimizer are digested and healed).
        suspects: the numerical check's suspect devices (a drifted rank is counted there too).
        timeout_s: bound of one heal.
        chunk_bytes: bytes per broadcast of the heal.

    Attributes:
        on: the adapter's wrapper is one the check covers (set by :meth:`install`).
        seen: the latest findings, oldest first (at most 100).
    """

    def __init__(
        self, every: int | None, adapter: Adapter, suspects: Suspects, timeout_s: float, chunk_bytes: int
    ) -> None:
        self.every, self.adapter, self.suspects = every, adapter, suspects
        self.timeout_s, self.chunk_bytes = timeout_s, chunk_bytes
        self.on = False
        self.seen: deque[DriftSeen] = deque(maxlen=MAX_SEEN)
        self._said_unchecked = False

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """The adapter built a DDP wrapper of its own: its replicas are checked (when ``every`` is set).

        Returns:
            ``model``, the wrapper.
        """
        self.on = self.every is not None
        return model

    def adopt(self, model: torch.nn.Module, framework: str) -> None:
        """A framework built the wrapper (Accelerate, the HF Trainer, Lightning): its replicas are checked
        where it is a ``DistributedDataParallel``; anything else is said once (at info level) and left.
        Cheap: a framework's hook may call it every step.

        Args:
            model: the framework's wrapper of the current world.
            framework: how the log names the framework.
        """
        if isinstance(model, DistributedDataParallel):
            self.on = self.every is not None
            return
        self.on = False
        self.unchecked(
            f"{framework}'s model is a {type(model).__name__}, not a DistributedDataParallel whose ranks hold whole replicas"
        )

    def unchecked(self, why: str) -> None:
        """Says once (at info level) why the replicas are not checked; nothing when the check is off."""
        if self.every is not None and not self._said_unchecked:
            self._said_unchecked = True
            log.info("%s: replicas are not checked: %s (docs/numerics.md)", self.adapter.name, why)

    def due(self, number: int) -> bool:
        """Whether step ``number``'s commit states the digests (the same on every rank)."""
        if self.every is None or number % self.every != 0:
            return False
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if several and not self.on:  # FSDP2, a wrap= of the user's, another adapter
            self.unchecked(f"{self.adapter.name}'s model is not covered (only a DistributedDataParallel wrapper is)")
            return False
        return several

    def state(self, number: int) -> None:
        """Notes, for this rank's next commit, its replica's digests when step ``number`` is due
        (nothing otherwise): the parameters and the optimizer's state as the step found them."""
        if self.due(number):
            note_replicas(replica_digests(self.adapter.get_module(), self.adapter.get_optimizer()))

    def heal(self, res: CommitResult, step: int, attempt: int = 1) -> HealResult:
        """Heals the drifted ranks a commit named from the lowest majority rank, in this world; on
        every rank, after the step's state was put back. The finding is told to the watchdog (an
        incident: :mod:`ncclguard.recovery._numerics.told`), healed or not.

        Args:
            res: the commit (``res.drift`` set, the same on every rank).
            step: the loop's step number.
            attempt: the step's attempt whose commit found it.

        Returns:
            The heal's result (falsy: the world may be dead, the next commit rebuilds it).

        Raises:
            ReplicasDiverged: no digest is held by a majority: no rank can be named (every rank).
        """
        drift = res.drift
        assert drift is not None  # res.only_drift
        if not drift.majority:
            error = self._undecided(drift, step)
            tell_drift(step, attempt, drift, "raised", None, (), res.step, self.adapter.name)  # before the raise
            raise error
        source = drift.majority[0]
        log.warning(
            "%s: silent data corruption seen at step %d: %s's %s differed from ranks %s's before the step (%s); "
            "the step was not applied on any rank; %s healed from rank %d in this world (no rebuild) and the step "
            "is redone",
            self.adapter.name,
            step,
            _ranks(drift.ranks),
            "replica" if len(drift.ranks) == 1 else "replicas",
            rank_ranges(drift.majority),
            "; ".join(f"{part}: {_ranks(odd)}" for part, odd in drift.parts.items()),
            f"{_ranks(drift.ranks)} {'is' if len(drift.ranks) == 1 else 'are'}",
            source,
        )
        suspects = self.suspects.seen(drift.ranks, step)
        for rank in suspects:
            log.warning(
                "%s: rank %d was flagged again at step %d (a drifted replica), within %d steps of the last time: "
                "its device is suspect (a failing GPU or its memory); consider taking it out of the job",
                self.adapter.name,
                rank,
                step,
                self.suspects.within,
            )
        healed = heal_from_peer(
            self.adapter.get_module(),
            self.adapter.get_optimizer(),
            receivers=list(drift.ranks),
            source=source,
            step=step,
            timeout=self.timeout_s,
            chunk_bytes=self.chunk_bytes,
        )
        self.seen.append(DriftSeen(step, list(drift.ranks), dict(drift.parts), source, bool(healed)))
        outcome: Literal["healed", "heal failed"] = "healed" if healed else "heal failed"
        tell_drift(step, attempt, drift, outcome, source, suspects, res.step, self.adapter.name)
        return healed

    def _undecided(self, drift: ReplicaDrift, step: int) -> ReplicasDiverged:
        parts = sorted(drift.parts)
        error = ReplicasDiverged(
            f"{self.adapter.name}: the replicas of {_ranks(drift.ranks)} differ at step {step} ({', '.join(parts)}) and "
            "no digest is held by a majority: a silent data corruption on one of them, which cannot be told (two "
            "ranks, or as many digests as ranks); the step was not applied on any rank. Resume from a checkpoint, "
            "or run with three or more ranks to have the drifted one named and healed",
            step=step,
            ranks=list(drift.ranks),
            parts=parts,
        )
        log.critical("%s", error)
        return error


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
