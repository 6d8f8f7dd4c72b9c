"""The key schema: every key ncclguard reads or writes in a job's store is built here.

- :class:`RoundKeys`: the keys of one settle-once round (:mod:`ncclguard.store.rounds`): an
  arrival per rank, the arrival count, the outcome and the count of ranks gone.
  :func:`round_keys` gives those of a collectives round (``ncclguard/<round name>``).
- :class:`MeetingKeys`: the recovery meeting's round toward one generation, one attempt
  (``ncclguard/rebuild/g<G>/t<T>``); :func:`world_prefix`: where generation ``G``'s process
  group is built (``ncclguard/world/g<G>``); :func:`world_record_key`: the job's current world,
  for a restarted rank (``ncclguard/world/current``).
- :class:`Keys`: the watchdog's namespace, one per job run, restart, session and world
  generation (``ncclguard/wd/<run id>/<restart>/<session>/g<G>``): after a rebuild the watchdog
  of the new world starts afresh, and the old world's incidents never mix with the new one's.
- :func:`index_key`: where a job's current watchdog namespace is named for a reader outside the
  job (``python -m ncclguard status``), one key per session (``ncclguard/wd-index/<session>``).
"""

from __future__ import annotations

import os

__all__ = ["Keys", "MeetingKeys", "RoundKeys", "index_key", "round_keys", "world_prefix", "world_record_key"]


class RoundKeys:
    """The keys of one settle-once round under ``prefix``.

    Args:
        prefix: the round's namespace (no trailing ``/``).
        arrival: the tag of an arrival key (``<prefix>/<arrival><rank>``).
        outcome: the name of the outcome key (``<prefix>/<outcome>``).
    """

    __slots__ = ("_arrival", "_outcome", "prefix")

    def __init__(self, prefix: str, arrival: str = "r", outcome: str = "o") -> None:
        self.prefix, self._arrival, self._outcome = prefix, arrival, outcome

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoundKeys) and (self.prefix, self._arrival, self._outcome) == (
            other.prefix,
            other._arrival,
            other._outcome,
        )

    def __hash__(self) -> int:
        return hash((self.prefix, self._arrival, self._outcome))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix!r})"

    def arrival(self, rank: int) -> str:
        """The key under which ``rank`` publishes its arrival.

        Args:
            rank: the rank, in the round's group.

        Returns:
            The key.
        """
        return f"{self.prefix}/{self._arrival}{rank}"

    def rank_of(self, key: str) -> int:
        """The rank whose arrival ``key`` is (the inverse of :meth:`arrival`).

        Args:
            key: an arrival key of this round.

        Returns:
            The rank.

        Raises:
            ValueError: ``key`` is not an arrival key of this round.
        """
        head = f"{self.prefix}/{self._arrival}"
        if not key.startswith(head) or not key[len(head) :].isdigit():
            raise ValueError(f"{key!r} is not an arrival key under {head!r}")
        return int(key[len(head) :])

    @property
    def count(self) -> str:
        """The arrival counter (``add`` numbers the ranks as they arrive, from 1)."""
        return f"{self.prefix}/n"

    @property
    def outcome(self) -> str:
        """The outcome, settled once by compare-and-set."""
        return f"{self.prefix}/{self._outcome}"

    @property
    def gone(self) -> str:
        """Counts the ranks that have left the round (the last one out cleans up)."""
        return f"{self.prefix}/gone"

    def transient(self, size: int) -> list[str]:
        """Every key of the round but the outcome.

        Args:
            size: the round's group size.

        Returns:
            The arrivals of ranks ``0..size-1``, the counter and the count of ranks gone.
        """
        return [*(self.arrival(r) for r in range(size)), self.count, self.gone]

    def every(self, size: int) -> list[str]:
        """Every key of the round, the outcome included.

        Args:
            size: the round's group size.

        Returns:
            The keys.
        """
        return [*self.transient(size), self.outcome]


def round_keys(name: str) -> RoundKeys:
    """The keys of the collectives round ``name`` (``barrier/g/3``, ``call/g/7``).

    Args:
        name: the round's name, the same on every rank.

    Returns:
        Its keys, under ``ncclguard/<name>``: ``r<rank>``, ``n``, ``o``, ``gone``.
    """
    return RoundKeys(f"ncclguard/{name}")


class MeetingKeys(RoundKeys):
    """The keys of the recovery meeting's attempt ``attempt`` toward generation ``generation``:
    arrivals ``a<rank>``, the counter ``n``, the outcome ``v`` and ``gone``.

    Args:
        generation: the generation the meeting builds.
        attempt: the attempt (every rank counts its own attempts toward a generation).
    """

    __slots__ = ("attempt", "generation")

    def __init__(self, generation: int, attempt: int) -> None:
        super().__init__(f"ncclguard/rebuild/g{generation}/t{attempt}", arrival="a", outcome="v")
        self.generation, self.attempt = generation, attempt


def world_prefix(generation: int) -> str:
    """The store prefix under which generation ``generation``'s process group is built.

    Args:
        generation: the world's generation (0 for the world the job started with).

    Returns:
        The prefix, ``ncclguard/world/g<generation>``.
    """
    return f"ncclguard/world/g{generation}"


def world_record_key() -> str:
    """Where the job's current world is recorded for a restarted process
    (:class:`ncclguard.store.world_record.WorldRecord`): ``ncclguard/world/current``, outside every
    generation's prefix, so that forgetting a generation keeps it.

    Returns:
        The key.
    """
    return "ncclguard/world/current"


class Keys:
    """The watchdog's key schema: one namespace per job run, restart, session and generation.

    Args:
        session: the watchdog session (``WatchdogConfig.session``).
        run_id: the job's run id (``TORCHELASTIC_RUN_ID``; ``"run"`` without one).
        restart: the restart count (``TORCHELASTIC_RESTART_COUNT``; a restarted job starts afresh).
        generation: the world's generation (``rebuild_world`` makes a new one; 0 at the start).
    """

    def __init__(self, session: str, run_id: str = "run", restart: str = "0", generation: int = 0) -> None:
        self.session, self.run_id, self.restart, self.generation = session, run_id, restart, generation
        self.ns = f"ncclguard/wd/{run_id}/{restart}/{session}/g{generation}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keys) and self.ns == other.ns

    def __hash__(self) -> int:
        return hash(self.ns)

    def __repr__(self) -> str:
        return f"Keys({self.ns!r})"

    @classmethod
    def from_env(cls, session: str, generation: int = 0) -> Keys:
        """The keys of ``session`` in this job, from torchrun's environment.

        Args:
            session: the watchdog session.
            generation: the world's generation.

        Returns:
            The keys.
        """
        return cls(
            session,
            os.environ.get("TORCHELASTIC_RUN_ID", "run"),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            generation,
        )

    @property
    def count(self) -> str:
        """The incident counter (``add`` numbers incidents from 1)."""
        return f"{self.ns}/count"

    def heartbeat(self, rank: int) -> str:
        """Where ``rank`` publishes its heartbeat."""
        return f"{self.ns}/hb/{rank}"

    def claim(self, signature: str) -> str:
        """Taken by the first rank that detects the incident ``signature`` (``hang/0/15``)."""
        return f"{self.ns}/claim/{signature}"

    def incident(self, n: int) -> str:
        """Incident ``n`` as described by the rank that raised it."""
        return f"{self.ns}/incident/{n}"

    def statement(self, n: int, rank: int) -> str:
        """``rank``'s statement on incident ``n``."""
        return f"{self.ns}/incident/{n}/st/{rank}"

    def head(self, n: int, rank: int) -> str:
        """The head of ``rank``'s statement on incident ``n`` (above 1,024 ranks)."""
        return f"{self.ns}/incident/{n}/head/{rank}"

    def dumped(self, n: int) -> str:
        """Counts the ranks that dumped incident ``n``."""
        return f"{self.ns}/incident/{n}/dumped"

    def merger(self, n: int) -> str:
        """Taken by the rank that merges incident ``n``."""
        return f"{self.ns}/incident/{n}/merger"

    def merged(self, n: int) -> str:
        """The merged note of incident ``n``."""
        return f"{self.ns}/incident/{n}/merged"

    def resolved(self, n: int) -> str:
        """Set once the op of hang incident ``n`` completed on some rank."""
        return f"{self.ns}/incident/{n}/resolved"

    @property
    def ending(self) -> str:
        """Counts the ranks that know the job is ending: their watchdog stopped, or they read
        :attr:`closing`."""
        return f"{self.ns}/ending"

    @property
    def closing(self) -> str:
        """Set by the process that hosts the store once its watchdog stopped: the store goes when
        that process ends, and its peers take that for the job's end, not an incident."""
        return f"{self.ns}/closing"

    def fenced(self, rank: int) -> str:
        """Set by ``rank``'s ``fence`` rung before it exits (a :class:`FenceNote`)."""
        return f"{self.ns}/fenced/{rank}"

    def digest(self, node: int) -> str:
        """``node``'s digest of its ranks' heartbeats, put by its agent (the node tier, docs/scale.md)."""
        return f"{self.ns}/digest/{node}"

    def member(self, local_rank: int) -> str:
        """In a node's own store: the rank in this world of the node's process ``local_rank``."""
        return f"{self.ns}/member/{local_rank}"

    def node_addr(self, node: int) -> str:
        """Where ``node``'s agent names its store's ``host:port``: outside every generation, as the
        agent serves it for the whole life of its process."""
        return f"ncclguard/wd/{self.run_id}/{self.restart}/{self.session}/node/{node}"


def index_key(session: str) -> str:
    """Where rank 0's watchdog names its current namespace (run id, restart, generation, size).

    A reader outside the job knows the store's address but not torchrun's run id or restart count;
    this fixed key tells it where the heartbeats and incidents are.

    Args:
        session: the watchdog session (``WatchdogConfig.session``).

    Returns:
        The key, ``ncclguard/wd-index/<session>``.
    """
    return f"ncclguard/wd-index/{session}"
