"""Whether the ranks' random generators can be handed from one rank to another, checked at every
commit where a heal from a live peer does so (:class:`SeedCheck`).

A heal from a live peer (DDP's: :func:`~ncclguard.recovery.heal.heal_from_peer`) sends the restarted
rank the peer's generators as the step found them, so that its redo draws what it drew in the run
without the fault. That holds when every rank's generators are the same at a step: one seed on every
rank, as the HF Trainer's ``set_seed(args.seed)`` and Accelerate's ``set_seed(seed)`` make. With a
seed per rank (``set_seed(seed, device_specific=True)``, ``torch.manual_seed(seed + rank)``), the
restarted rank would draw its peer's dropout masks from then on, and the run would diverge from the
one without the fault with nothing said. Sharded state (FSDP2, ZeRO) is restored from the rank's own
snapshot, its own generators with it: no check there.

So each rank states, in its commit, a digest of each generator its step drew from, as the step
found it (:func:`~ncclguard.recovery._commit.said.note_generators`): an unseeded ``random`` or NumPy
differs in every process, and matters only to a step that draws from it. The outcome names the ranks
whose generators differ, the same on every rank. At the run's first commit with ``heal=True`` asked for,
that is refused (:class:`~ncclguard.errors.GeneratorsApart`, on every rank, before the step is
applied). Where heal is on by default, or the generators part later (a rank drew alone), it is said
once at error level, and again at each heal that follows.
"""

from __future__ import annotations

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.errors import GeneratorsApart
from ncclguard.recovery._commit.said import note_generators
from ncclguard.recovery._step.state import StepState, drawn_generators
from ncclguard.recovery.commit import CommitResult

__all__ = ["SeedCheck", "apart_text"]

_FIX = (
    "seed every rank the same (transformers/accelerate set_seed(seed) without device_specific=True, "
    "torch.manual_seed(seed)) and let the sampler give each rank its data, or seed each step from the "
    "step and the rank (docs/stacks/loop.md)"
)


def apart_text(apart: dict[str, list[int]], step: int | None) -> str:
    """The generators found apart, in words.

    Args:
        apart: by generator name, the ranks whose generator differs from most ranks' (every
            stating rank where no state is held by most).
        step: the step the commit was for, or None.

    Returns:
        One sentence, naming the generators and their ranks (those on the same ranks together).
    """
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in sorted(apart.items()):
        by_ranks.setdefault(tuple(ranks), []).append(name)
    each = "; ".join(f"{_listed(names)} differ on {_ranks(list(ranks))}" for ranks, names in by_ranks.items())
    at = f" at step {step}" if step is not None else ""
    return f"the ranks' random generators are not alike{at} ({each}: a seed per rank?)"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


class SeedCheck:
    """One engine's check of its ranks' generators (see the module doc).

    Attributes:
        states: the engine heals from a live peer: each commit states the generators.
        apart: the first outcome that found them apart (by generator, the odd ranks), or None.
    """

    def __init__(self, name: str, *, states: bool, explicit: bool) -> None:
        """Args:
        name: the adapter's name, for the log.
        states: whether the engine heals from a live peer (``heal`` on, state not sharded).
        explicit: ``heal=True`` was asked for (not left to its default).
        """
        self.name = name
        self.states = states
        self._explicit = explicit
        self._first = True
        self.apart: dict[str, list[int]] | None = None

    def state(self, kept: StepState) -> None:
        """Notes, for this rank's next commit (where stated), the digests of the generators the step
        drew from, as the step found them: one it never draws from (an unseeded ``random`` or NumPy,
        different in every process) cannot make a redo differ.

        Args:
            kept: the step's snapshot (its generators as the step found them).
        """
        if self.states:
            note_generators(drawn_generators(kept))

    def check(self, res: CommitResult, step: int | None) -> None:
        """:meth:`judge`, raising what it returns.

        Raises:
            GeneratorsApart: see :meth:`judge`.
        """
        error = self.judge(res, step)
        if error is not None:
            raise error

    def judge(self, res: CommitResult, step: int | None) -> GeneratorsApart | None:
        """Reads one commit's outcome.

        Args:
            res: the commit's result (its ``generators_apart`` is the same on every rank).
            step: the step it was for.

        Returns:
            The error to raise on every rank (the run's first commit, ``heal=True``), or None.
        """
        # This engine's first commit in the job's first world: the same on every rank (a restarted
        # process's engine commits first in a later world, after its heal made its generators its peer's).
        first, self._first = self._first and res.generation == 0, False
        if not self.states or not res.generators_apart or self.apart is not None:
            return None
        self.apart = {k: list(v) for k, v in res.generators_apart.items()}
        text = apart_text(self.apart, step)
        if first and self._explicit:
            error = GeneratorsApart(
                f"{self.name}: {text}. heal=True hands a restarted rank a live peer's generators, so the healed "
                f"run could not be the run without the fault. Either {_FIX}, or pass heal=False"
            )
            log.critical("%s", error)
            return error
        log.error(
            "%s: %s; a rank healed from a live peer from now on draws that peer's random numbers, and the run "
            "goes on, but not as it would have without the fault. To heal exactly, %s",
            self.name,
            text,
            _FIX,
        )
        return None

    def healed(self, ranks: list[int]) -> None:
        """Says, at a heal from a live peer, that the ranks it healed took the peer's generators
        while the ranks' generators were found apart (nothing when they were not)."""
        if self.states and self.apart is not None and ranks:
            log.error(
                "%s: %s healed with a live peer's generators while %s; from here the run is not the one "
                "without the fault",
                self.name,
                f"{_ranks(sorted(ranks))} {'was' if len(ranks) == 1 else 'were'}",
                apart_text(self.apart, None),
            )
