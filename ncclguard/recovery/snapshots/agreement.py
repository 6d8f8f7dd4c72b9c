"""A take's agreement and its deadline: how every rank's swap went, settled once in the job's store.

Why the store and not the side group: a gloo point-to-point wait that misses its deadline closes
its pair ("Application timeout caused pair closure"), so after one rank's swap timed out the side
group can no longer carry the answer to "did every swap succeed". A settle-once round
(:func:`ncclguard.store.rounds.settle_round`) works whatever state the side group is in, and tells
apart the two ways a take can fail:

- every rank came to the round (the world is whole): a swap that failed or was refused fails the
  *take* only. The step goes on, the committed snapshots stay, the next take comes later, and a
  failed swap's side group is made again (:class:`~ncclguard.recovery.snapshots.keeper.Keeper`);
- a rank did not come within the round's deadline, or its launcher says it died: the step fails
  (:class:`~ncclguard.errors.HealFailed`) and the engine recovers.

With the node tier on (docs/scale.md), the round goes through it as a commit's does: each node's
ranks meet in their node's store and one carrier a node talks to the job's store (:class:`TakeTier`).

Each rank states its swap's kind (:data:`TAKE_OK`, :data:`TAKE_REFUSED`, :data:`TAKE_FAILED`),
why, and the ``K`` it asks for; the settling rank reads the statements once and writes the outcome:
the worst kind, the largest ``K``, the reasons. Statements and the outcome are JSON read into the
models below, bounded, never unpickled.

The deadline follows the take's size (:func:`take_deadline_s`): ``heal_timeout_s`` for the fixed
part, plus the bytes it moves at the slower of a slow link's rate and four times the rate learned
from this job's takes. A take of 2 GB is then not held to the 60 s of a take of 2 MB.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed, StoreUnreachable
from ncclguard.recovery._commit.tier import nodes_of, settle_on_tier
from ncclguard.store import node_store
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.codec import decode_each, decode_outcome, encode
from ncclguard.store.keys import RoundKeys
from ncclguard.store.rounds import Members, Peek, Rule, settle_round
from ncclguard.store.tier_round import TierKeys, TierPeek, TierPlace, forget_tiered
from ncclguard.store.values import count_up, delete_keys
from ncclguard.watching.sensors.progress import MAX_SNAPSHOTS_CHARS, SNAPSHOTS_SAY
from ncclguard.world import current_world

__all__ = [
    "SLACK",
    "SLOW_LINK_BYTES_PER_S",
    "TAKE_FAILED",
    "TAKE_OK",
    "TAKE_REFUSED",
    "TakeLosses",
    "TakeOutcome",
    "TakeRounds",
    "TakeStatement",
    "TakeTier",
    "agree",
    "decide",
    "keeper_serial",
    "take_deadline_s",
    "take_keys",
    "takes_lost",
]

TAKE_OK, TAKE_REFUSED, TAKE_FAILED = 0, 1, 2  # how a take went on a rank: the outcome takes the worst
SLOW_LINK_BYTES_PER_S = 50 * 2**20  # a take's bytes are given at least this slow a link (400 Mbit/s)
SLACK = 4.0  # times the learned seconds per byte: a loaded host or a busy link is not a failed take
MAX_WHY = 1_000  # characters of one rank's reason kept in a statement
_MAX_STATEMENT_BYTES = 4 * 1024
LOST_IN_A_ROW_SAID = 3  # takes lost in a row before the one line that says what to change
MAX_PUT_OFF = 8  # the next take is put off at most 2 x 8 K steps
_WHAT_TO_CHANGE = {
    TAKE_FAILED: "A swap that misses its deadline over and over: a link or a host too slow for the snapshot's size. "
    "Raise heal_timeout (the deadline's fixed part), set snapshot_every higher, or turn heal off",
    TAKE_REFUSED: "A refusal that lasts: the ranks' states differ in layout (a module changed on one rank) or a "
    "replica is over snapshot_max_bytes; see docs/reference/recovery-snapshots.md",
}


def take_deadline_s(nbytes: int, seconds_per_byte: float | None, floor_s: float) -> float:
    """How long one take's swap may take: ``floor_s`` plus its bytes at the slower of
    :data:`SLOW_LINK_BYTES_PER_S` and :data:`SLACK` times the rate learned.

    Args:
        nbytes: the bytes the take moves on this rank (its snapshot, sent, and the replicas it receives).
        seconds_per_byte: what this job's takes cost per byte so far, or None before the first.
        floor_s: the fixed part (``heal_timeout_s``): meeting the peers, the manifests, the answers.

    Returns:
        Seconds.
    """
    per_byte = 1.0 / SLOW_LINK_BYTES_PER_S
    if seconds_per_byte is not None:
        per_byte = max(per_byte, SLACK * seconds_per_byte)
    return floor_s + max(nbytes, 0) * per_byte


def _restart() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def take_keys(generation: int, serial: int, n: int) -> RoundKeys:
    """The round keys of take ``n`` of a keeper in world ``generation``
    (``ncclguard/take/<restart>/g<gen>/k<serial>/t<n>``).

    Args:
        generation: the world's generation.
        serial: the keeper's number among those that took in that world (:func:`keeper_serial`).
        n: the take's count in that world by that keeper (the same on every rank: takes are agreed).
    """
    return RoundKeys(f"ncclguard/take/{_restart()}/g{generation}/k{serial}/t{n}")


def keeper_serial(store: dist.Store, generation: int, rank: int, deadline: Deadline) -> int:
    """This keeper's number among the keepers that took in world ``generation``, the same on every
    rank: each rank counts its own keepers' first takes in that world in the job's store, so that a
    restarted process counts on from its predecessor's.

    Why: the last take of a keeper leaves its outcome in the store (a late rank reads it there). A
    second keeper in the same world (a second training loop, the same job's reference run) would
    otherwise meet that outcome under its own round's keys and read another take's ending as its own.

    Raises:
        StoreUnreachable: the store did not answer by ``deadline``.
    """
    key = f"ncclguard/take/{_restart()}/g{generation}/keepers/r{rank}"
    return count_up(store, key, deadline, "the keeper's number")


class TakeStatement(BaseModel):
    """One rank's account of its swap.

    Attributes:
        rank: the rank.
        kind: :data:`TAKE_OK`, :data:`TAKE_REFUSED` or :data:`TAKE_FAILED`.
        want: the ``K`` it asks for from this take on.
        why: what went wrong, or "".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    kind: int = Field(ge=TAKE_OK, le=TAKE_FAILED)
    want: int = Field(ge=1)
    why: str = Field(default="", max_length=MAX_WHY)


class TakeOutcome(BaseModel):
    """What every rank reads of a take's round.

    Attributes:
        kind: the worst kind stated (:data:`TAKE_FAILED` too when a rank is missing).
        k: the largest ``K`` asked (0 when a rank is missing).
        whys: the reason of each rank whose swap did not succeed, by rank.
        missing: the ranks that did not come to the round (the step fails).
        dead: those of them their launcher reported dead, and how it is known.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: int = Field(ge=TAKE_OK, le=TAKE_FAILED)
    k: int = Field(ge=0)
    whys: dict[int, str] = Field(default_factory=dict)
    missing: list[int] = Field(default_factory=list)
    dead: dict[int, str] = Field(default_factory=dict)


def decide(said: dict[int, TakeStatement | None], size: int, dead: dict[int, str] | None = None) -> TakeOutcome:
    """The outcome of a round from the statements present (None: unreadable, taken as failed).

    Args:
        said: the statements present, by rank.
        size: the world's size.
        dead: the ranks their launchers reported dead.

    Returns:
        The outcome.
    """
    missing = sorted(set(range(size)) - set(said))
    whys: dict[int, str] = {}
    kind, k = TAKE_FAILED if missing else TAKE_OK, 1
    for r, st in sorted(said.items()):
        if st is None:
            whys[r], kind = "its statement could not be read", TAKE_FAILED
            continue
        kind, k = max(kind, st.kind), max(k, st.want)
        if st.kind != TAKE_OK:
            whys[r] = st.why
    return TakeOutcome(
        kind=kind,
        k=0 if missing else k,
        whys=whys,
        missing=missing,
        dead={r: why for r, why in sorted((dead or {}).items()) if r in missing},
    )


def _statements(peek: Peek) -> dict[int, TakeStatement | None]:
    return decode_each(TakeStatement, peek.arrivals(), "take statement", _MAX_STATEMENT_BYTES, "snapshots")


def _rule(
    store: dist.Store,
    keys: RoundKeys,
    size: int,
    dead: Callable[[Deadline], dict[int, str]],
    peek: Peek | None = None,
) -> Rule[TakeOutcome]:
    everyone = peek or Peek(store, keys, size)  # the settling rank reads the statements; nobody else does

    def early(peek: Peek) -> str | None:
        gone = dead(Deadline.within(1.0))
        if not gone:
            return None
        return encode(decide(_statements(peek), size, gone))

    def read(raw: bytes) -> TakeOutcome:
        return decode_outcome(TakeOutcome, raw, "the take outcome", keys.outcome, _MAX_STATEMENT_BYTES * (size + 1))

    # No members: the keys stay until the keeper's next take, whose agree() deletes them once every
    # rank came to it, so a late rank still finds this outcome.
    return Rule(
        everyone=lambda: encode(decide(_statements(everyone), size)),
        given_up=lambda peek: encode(decide(_statements(peek), size, dead(Deadline.within(1.0)))),
        read=read,
        members=lambda v: Members((), True),
        early=early,
        poll_s=0.5,
    )


@dataclass
class TakeTier:
    """A keeper's takes through the node tier (``recovery/_commit/tier.py``), in one world.

    Attributes:
        node_of: each member's node (from its launch rank).
        near: a client of this rank's node's store; None: the one its watchdog is linked to
            (``node_store.near_client``), or none, when it is linked to none yet.
        paths: round prefix -> how this rank went through that round (``settle_tiered``'s path:
            what it deletes of the round's keys).
    """

    node_of: tuple[int, ...]
    near: Any | None = None
    paths: dict[str, str] = field(default_factory=dict)


def agree(
    store: dist.Store,
    keys: RoundKeys,
    previous: RoundKeys | None,
    statement: TakeStatement,
    size: int,
    deadline: Deadline,
    dead: Callable[[Deadline], dict[int, str]],
    tier: TakeTier | None = None,
) -> TakeOutcome:
    """Runs one take's round: states this rank's swap and reads the outcome every rank reads.

    Args:
        store: the job's store.
        keys: this take's round keys (:func:`take_keys`).
        previous: the keys of this world's take before it, deleted here once every rank came to
            this one (flat: each rank its own statement, rank 0 the rest; through the tier:
            :func:`~ncclguard.store.tier_round.forget_tiered`), or None.
        statement: this rank's account.
        size: the world's size.
        deadline: when the ranks not there are given up (sooner where their launcher says they died).
        dead: the members known dead (:func:`~ncclguard.recovery.snapshots.exchange.death_watch`).
        tier: the round goes through the node tier: each node's ranks meet in their node's store,
            one carrier a node talks to the job's store (docs/scale.md); None: flat.

    Returns:
        The outcome.

    Raises:
        HealFailed: a rank did not come (missed the deadline or died): the step fails.
        StoreUnreachable: the store did not answer.
    """
    rank, waited_s = statement.rank, deadline.left()
    thread_store = store_for_this_thread(store, deadline)
    place = None
    if tier is None:
        rule = _rule(thread_store, keys, size, dead)
        what = f"take {keys.prefix}"
        outcome = settle_round(thread_store, keys, rank, size, encode(statement), deadline, rule, what).outcome
    else:
        near = tier.near if tier.near is not None else node_store.near_client(waited_s, deadline)
        place = TierPlace(rank, tier.node_of, near)
        peek = TierPeek(thread_store, TierKeys(keys), place, _MAX_STATEMENT_BYTES)
        rule, known = _rule(thread_store, keys, size, dead, peek), (lambda: dead(Deadline.within(1.0)))
        outcome, tier.paths[keys.prefix] = settle_on_tier(
            thread_store, keys, place, encode(statement), deadline, waited_s, rule, peek, known
        )
    if outcome.missing:
        gone = "; ".join(f"rank {r}: {why}" for r, why in outcome.dead.items())
        raise HealFailed(
            f"the take's agreement: rank(s) {outcome.missing} did not come"
            + (f" ({gone})" if gone else f" within {waited_s:.0f} s")
        )
    if previous is not None and tier is not None and place is not None:
        forget_tiered(thread_store, previous, place, tier.paths.pop(previous.prefix, ""), deadline.plus(1.0))
    elif previous is not None:
        mine = [previous.arrival(rank), *((previous.count, previous.gone, previous.outcome) if rank == 0 else ())]
        try:
            delete_keys(thread_store, mine, deadline.plus(1.0), "clean-up of the take before")
        except (RuntimeError, StoreUnreachable) as exc:  # the outcome stands; the keys only stay
            log.info("snapshots: the keys of the take before stay in the store (%s)", exc)
    return outcome


@dataclass
class TakeLosses:
    """The takes that did not commit with every rank at the agreement, and when the next comes.

    Attributes:
        failed: every take lost so far (refused ones included).
        refused: of those, the takes refused somewhere (a manifest the admission did not take).
        in_a_row: takes lost since the last that committed.
    """

    failed: int = 0
    refused: int = 0
    in_a_row: int = 0
    _said: set[str] = field(default_factory=set)
    # Every keeper's lost takes in this process, read by :func:`takes_lost`: a keeper (and its
    # count) goes with its engine, and a process may run several loops one after another.
    in_process: ClassVar[int] = 0

    def put_off(self, step: int, k: int, outcome: TakeOutcome, newest: int | None) -> int:
        """Counts a lost take of ``step`` and says so: once per reason; from the third in a row in
        the heartbeat (``ncclguard status``), and once in one line that says what to change.

        Args:
            step: the take's step.
            k: the interval in force.
            outcome: the take's outcome (refused or failed).
            newest: the step of the newest snapshot kept, or None.

        Returns:
            The step of the next take: twice as late per take lost in a row, up to 16 K later (a
            lasting cause, a layout the admission does not take or a link too slow, must not cost
            every step).
        """
        refused = outcome.kind == TAKE_REFUSED
        self.failed += 1
        TakeLosses.in_process += 1
        self.refused += refused
        self.in_a_row += 1
        due = step + 2 * max(k, 1) * min(self.in_a_row, MAX_PUT_OFF)
        what = "refused" if refused else "failed"
        why = "; ".join(f"rank {r}: {w}" for r, w in outcome.whys.items()) or f"another rank's swap {what}"
        key = why if refused else f"failed: {why.split(':')[0]}"  # a failure's text holds times: once per rank
        if key not in self._said:
            self._said.add(key)
            log.warning(
                "snapshots: step %d's snapshot %s (%s); the step goes on, the snapshots before stay, the next take "
                "is at step %d (%d lost so far, %d of them refused)",
                step, what, why, due, self.failed, self.refused,
            )  # fmt: skip
        if self.in_a_row >= LOST_IN_A_ROW_SAID:
            said = (
                f"{self.in_a_row} takes in a row lost, the newest snapshot is of step {newest}; the last {what}: {why}"
            )
            current_world().get(SNAPSHOTS_SAY).text = said[:MAX_SNAPSHOTS_CHARS]
        if self.in_a_row == LOST_IN_A_ROW_SAID:
            log.error(
                "snapshots: %d takes in a row lost (the last: %s): no snapshot newer than step %s to heal from. %s",
                self.in_a_row, why, newest, _WHAT_TO_CHANGE[outcome.kind],
            )  # fmt: skip
        return due

    def committed(self) -> None:
        """A take committed: the losses in a row end, and the heartbeat says nothing of them."""
        if self.in_a_row:
            self.in_a_row = 0
            current_world().get(SNAPSHOTS_SAY).text = None


@dataclass
class TakeRounds:
    """A keeper's take agreements: numbered per world (:func:`take_keys`), the one before deleted.

    Attributes:
        generation: the world the count is of (-1 before the first take).
        serial: the keeper's number in that world (:func:`keeper_serial`).
        n: the takes agreed on in that world so far.
    """

    generation: int = -1
    serial: int = 0
    n: int = 0
    tier: TakeTier | None = None  # decided at the world's first take, the same on every rank

    def agree(
        self,
        store: dist.Store,
        generation: int,
        statement: TakeStatement,
        size: int,
        deadline: Deadline,
        dead: Callable[[Deadline], dict[int, str]],
    ) -> TakeOutcome:
        """The next take's round in world ``generation`` (see :func:`agree`).

        Raises:
            HealFailed: a rank did not come, or the store failed (the step fails, the loop goes on).
        """
        try:
            if self.generation != generation:
                serial = keeper_serial(store, generation, statement.rank, deadline)
                self.generation, self.serial, self.n = generation, serial, 0
                self.tier = _tier(size)
            n, self.n = self.n, self.n + 1
            previous = take_keys(generation, self.serial, n - 1) if n else None
            keys = take_keys(generation, self.serial, n)
            return agree(store, keys, previous, statement, size, deadline, dead, self.tier)
        except HealFailed:  # a rank did not come: the take is lost with the step
            TakeLosses.in_process += 1
            raise
        except (StoreUnreachable, RuntimeError) as exc:  # the store's own errors
            TakeLosses.in_process += 1
            raise HealFailed(f"the take's agreement: the job's store failed: {exc}") from exc


def _tier(size: int) -> TakeTier | None:
    """Whether this world's takes go through the node tier: as its commits do, decided from the
    launcher's variables and the tier's settings (``recovery/_commit/tier.py``, ``nodes_of``)."""
    world = current_world()
    nodes = nodes_of([world.origin(r) for r in range(size)])
    if nodes is None:
        return None
    log.info("snapshots: the takes' agreements through the node tier, %d nodes", max(nodes) + 1)
    return TakeTier(nodes)


def takes_lost() -> int:
    """The snapshot takes lost in this process so far, by every keeper it ran: failed or refused
    with every rank at the agreement (:class:`TakeLosses`), or lost with their step when a rank did
    not come or the store failed. A fault-free run loses none (the test harness checks it).

    Returns:
        The count (0 before the first take).
    """
    return TakeLosses.in_process
