"""The snapshot keeper: this rank's own snapshots and the replicas it holds for its peers.

At a step boundary that is due (every ``K`` steps, the same ``K`` on every rank), :meth:`Keeper.take`
packs the rank's own state (:class:`~ncclguard.recovery.snapshots.state.StateCodec`) and its
generators into host memory, and swaps snapshots with the buddies over a side gloo group of the
world: it sends its own to its buddy and receives the replicas of the ranks whose buddy it is
(:mod:`~ncclguard.recovery.snapshots.placement`).

A take is a transaction. Its snapshot and the replicas it receives are *pending* until every rank
of the world says its swap succeeded (one all_reduce on the side group, which also agrees on
``K``); only then do they replace the committed ones. A failed take leaves the committed snapshots
whole, so a restore always finds a step that every survivor and a replica holder share. A rank
that cannot tell how the agreement ended (it failed there) keeps both, and says so in its holdings.

Memory: ``keep`` snapshots of its own and ``keep`` replicas of each source (1 by default: its state
twice in all, once its own and once a buddy's), plus, during a take, the pending pair. With
``spares=True`` the buffers a commit frees are kept for the next take (memory: twice as much), so
that a take copies into memory already mapped, at copy speed; without, each take maps new memory.

``K``: with ``every=None`` each take measures its own cost against the step time seen since the
last one and asks for the smallest ``K`` that keeps snapshots under ``budget`` (2%) of the step
time, or, once the job has lost a rank, Young's shorter interval for the failures seen
(:mod:`~ncclguard.recovery.snapshots.interval`); the ranks agree on the largest ``K`` asked, so
that they take their snapshots at the same steps. A ``K`` set by hand is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed, SnapshotRefused
from ncclguard.recovery._rebuild.reaper import reaper
from ncclguard.recovery._step.state import StepState, generators_to_send
from ncclguard.recovery.commit import note_point_to_point
from ncclguard.recovery.snapshots.agreement import (
    MAX_WHY,
    TAKE_FAILED,
    TAKE_OK,
    TAKE_REFUSED,
    TakeLosses,
    TakeOutcome,
    TakeRounds,
    TakeStatement,
    take_deadline_s,
)
from ncclguard.recovery.snapshots.exchange import _op, death_watch, job_store, swap
from ncclguard.recovery.snapshots.interval import FailureRate, wanted_k
from ncclguard.recovery.snapshots.memory import GROWN, Fit, MemoryCap, steady_bytes
from ncclguard.recovery.snapshots.packing import Manifest, Snapshot, admit_peer, pack
from ncclguard.recovery.snapshots.placement import buddies, host_key, host_number, sources
from ncclguard.recovery.snapshots.state import StateCodec
from ncclguard.recovery.state_json import to_json
from ncclguard.world import Slot, World, current_world

__all__ = ["SLOTS", "Keeper", "SideGroup", "side_group"]

MAX_KEEP = 2
SLOTS = MAX_KEEP + 1  # the places of one rank's or one replica's steps in the holdings: kept, then pending


@dataclass
class SideGroup:
    """The world's side group for snapshots, and where each rank's replica goes."""

    group: Any
    buddy: list[int]
    hosts: list[int]


def _side_group(world: World) -> SideGroup:
    # Bounded: a peer that died before it made the group fails this take at its deadline, not never.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_SIDE_TIMEOUT_S))
    mine = torch.tensor([host_number(host_key())], dtype=torch.int64)
    hosts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(hosts, mine, group=group)
    numbers = [int(h.item()) for h in hosts]
    return SideGroup(group, buddies(numbers), numbers)


_SIDE_TIMEOUT_S = 300.0  # the side group's own bound; every wait on it passes a shorter deadline
SIDE: Slot[SideGroup] = Slot("snapshot side group", _side_group)


def side_group() -> SideGroup:
    """The current world's side group for snapshots (made on first use: every rank must ask at once)."""
    side = current_world().get(SIDE)
    # Outside the slot's factory, which runs under the world's lock. Its sends join two ranks only:
    # the commit must not compare its sequence numbers.
    note_point_to_point(side.group)
    return side


@dataclass
class Keeper:
    """Own snapshots and replicas of one training loop on this rank (see the module doc).

    Args:
        codec: takes the state out of the live model and puts it back.
        every: take a snapshot every this many steps; None: chosen to cost at most ``budget``.
        budget: the share of the step time snapshots may cost when ``every`` is None.
        timeout_s: the fixed part of one swap's deadline (``heal_timeout_s``); the deadline adds the
            take's bytes at a slow link's rate or at the rate this job's takes showed, the slower.
        keep: committed snapshots kept of its own and of each replica (1 or 2; 2 lets a restore
            fall back to the one before when the newest cannot be used).
        spares: keep the buffers a commit frees for the next take (faster takes, twice the memory).
        max_bytes: the most host memory its committed snapshots and replicas may hold; over it the
            spares go, then the second snapshot kept (:mod:`~ncclguard.recovery.snapshots.memory`).

    Attributes:
        own: this rank's committed snapshots, oldest first (at most ``keep``).
        replicas: the committed replicas it keeps, by source rank, oldest first (at most ``keep`` each).
        pending: the snapshot of a take not known to be committed (its agreement failed here), or None.
        pending_replicas: the replicas that take received, by source rank.
        k: snapshots are taken every ``k`` steps (agreed by every rank).
        takes: snapshots committed so far (forced ones included).
        lost: the takes that did not commit with every rank at the agreement (the step went on,
            the committed snapshots stayed), and how the next is put off (:class:`TakeLosses`).
        deadline_s: the last take's deadline, from its size (:func:`~ncclguard.recovery.snapshots.agreement.take_deadline_s`).
        spent_s: seconds the training loop spent taking them (what the steps paid for them).
    """

    codec: StateCodec
    every: int | None = None
    budget: float = 0.02
    timeout_s: float = 60.0
    keep: int = 1
    spares: bool = False
    max_bytes: int | None = None
    own: list[Snapshot] = field(default_factory=list)  # oldest first
    replicas: dict[int, list[Snapshot]] = field(default_factory=dict)  # by source rank, oldest first
    pending: Snapshot | None = None
    pending_replicas: dict[int, Snapshot] = field(default_factory=dict)
    k: int = 1
    next_due: int | None = None
    force: bool = True  # the first step, and the first after a restore, always take one
    takes: int = 0
    lost: TakeLosses = field(default_factory=TakeLosses)
    deadline_s: float = 0.0
    _per_byte: float | None = None  # what a take cost per byte moved, smoothed over the ones that succeeded
    rounds: TakeRounds = field(default_factory=TakeRounds)  # its takes' agreements, numbered per world
    spent_s: float = 0.0
    _spare: dict[int, torch.Tensor] = field(default_factory=dict)  # freed buffers by owner rank (spares=True)
    _last_begin: float | None = None
    _step_time: float | None = None
    _cost: float = 0.0  # the last take's seconds
    _take_cost: float | None = None  # a take's seconds, smoothed over the unforced ones
    _told_bytes: int = 0  # the own snapshot's size the memory line was said for
    _cap: MemoryCap = field(default_factory=MemoryCap)
    _failures: FailureRate = field(default_factory=FailureRate)
    _mtbf: float | None = None  # the failures' mean interval when the last K was asked

    def __post_init__(self) -> None:
        if not 1 <= self.keep <= MAX_KEEP:
            raise ValueError(f"keep must be 1 or {MAX_KEEP} (snapshots kept of each), got {self.keep!r}")
        self._cap = MemoryCap(self.max_bytes)

    def note_begin(self) -> None:
        """Marks a step's start: the step time is measured between two of them, less the takes."""
        now = time.monotonic()
        if self._last_begin is not None:
            spent = max(now - self._last_begin - self._cost, 1e-6)
            self._step_time = spent if self._step_time is None else 0.8 * self._step_time + 0.2 * spent
        self._last_begin, self._cost = now, 0.0

    def due(self, step: int) -> bool:
        """Whether a snapshot is to be taken at ``step`` (the same answer on every rank)."""
        return self.force or self.next_due is None or step >= self.next_due

    def take(self, step: int, kept: StepState) -> None:
        """Takes this rank's snapshot of ``step``, swaps it with the buddies and commits it once
        every rank's swap succeeded (every rank at once; see the module doc).

        Args:
            step: the step whose start the state is.
            kept: the step's generators as the step found them (the engine's snapshot of the step).

        Raises:
            HealFailed: a rank did not come to the take's agreement (it died, or missed the
                deadline): the step fails, the committed snapshots stay. A take that failed or
                was refused with every rank there raises nothing: the step goes on, the next take
                comes later (:attr:`lost`).
        """
        start = time.monotonic()
        side = _op("the snapshots' side group", side_group)  # made at the first take: every rank at once
        began = time.monotonic()  # the side group is made by every rank at once: the ranks start together here
        me, size = dist.get_rank(), dist.get_world_size()
        state = self.codec.capture()
        found: list[torch.Tensor] = []
        state.meta["generators"] = to_json(generators_to_send(kept), found, "generators")
        for i, t in enumerate(found):
            state.tensors[f"g:{i}"] = t
        snap = pack(state, step, me, self._spare_for(me))
        self.pending, self.pending_replicas = snap, {}
        srcs = sources(side.buddy, me)
        moved = snap.manifest.nbytes * (1 + len(srcs))  # sent, and about as much received per source
        # The replicas it will hold are about its own size (shards of one model). Fitted at the first
        # take and again when the state has grown: the engine's first take comes before the optimizer's
        # first step, when Adam has no moments yet (a third of what the rank will hold).
        made = len(self._cap.decided)
        fit = self._cap.fit(moved, self.keep, self.spares)
        if len(self._cap.decided) > made:  # fitted now: said once, not at every take
            self._fit(fit)
        self.deadline_s = take_deadline_s(moved, self._per_byte, self.timeout_s)
        error: HealFailed | None = None
        if size > 1:
            try:
                reuse = {s: b for s in srcs if (b := self._spare_for(s)) is not None}
                admit = _peer_admission(snap.manifest, size)
                dead = death_watch()  # a sender that died mid-take ends the wait for it at once
                deadline = Deadline(began + self.deadline_s)
                self.pending_replicas = swap(snap, side.buddy[me], srcs, side.group, deadline, admit, reuse, dead)
            except HealFailed as exc:
                error = exc
        self._cost = time.monotonic() - start
        if error is None and moved:
            per_byte = (time.monotonic() - began) / moved
            self._per_byte = per_byte if self._per_byte is None else 0.7 * self._per_byte + 0.3 * per_byte
        # A forced take (the first, or the first in a new world) also waits for slow peers and makes
        # the side group: it says nothing of what a take costs, so it asks for the K in force.
        kind = TAKE_OK if error is None else TAKE_REFUSED if isinstance(error, SnapshotRefused) else TAKE_FAILED
        # A rank is given a whole take's deadline again to come: the ranks began together.
        outcome = self._settle(step, self.k if self.force else None, kind, error, Deadline(began + 2 * self.deadline_s))
        if outcome.kind != TAKE_OK:
            self.pending, self.pending_replicas = None, {}
            if outcome.kind == TAKE_FAILED:
                self._drop_side_group(side)  # a timed-out wait closed its pair: the next take makes a new one
            self.next_due = self.lost.put_off(step, self.k, outcome, self.own[-1].step if self.own else None)
            return
        self._commit()
        self.force = False
        self.takes += 1
        self.spent_s += time.monotonic() - start
        if snap.manifest.nbytes > GROWN * self._told_bytes:  # said at the first take, and once grown
            self._told_bytes = snap.manifest.nbytes
            self._tell(snap, srcs, side.buddy[me], size, side.hosts)

    def _spare_for(self, owner: int) -> torch.Tensor | None:
        return self._spare.pop(owner, None) if self.spares else None

    def _commit(self) -> None:
        """The pending snapshot and replicas replace the oldest committed ones (every rank's swap succeeded)."""
        assert self.pending is not None
        me = self.pending.manifest.rank
        self.own, dropped = _kept([*self.own, self.pending], self.keep)
        freed = {me: dropped}
        for src, replica in self.pending_replicas.items():
            self.replicas[src], freed[src] = _kept([*self.replicas.get(src, []), replica], self.keep)
        if self.spares:
            self._spare = {r: d[-1].payload for r, d in freed.items() if d}
        self.pending, self.pending_replicas = None, {}

    def _drop_side_group(self, side: SideGroup) -> None:
        """Forgets the side group a failed swap left (every rank does, having read one outcome), so
        that the next take makes a new one; its pending work ends on the reaper's thread."""
        current_world().drop(SIDE)
        try:
            dist.destroy_process_group(side.group)
        except (RuntimeError, ValueError) as exc:  # already gone with its world: nothing to forget
            log.info("snapshots: the side group was not destroyed (%s)", exc)
        reaper.bury([side.group], hold_s=_SIDE_TIMEOUT_S + 5.0, label="snapshot side group")

    def _settle(
        self, step: int, keep: int | None, kind: int, error: HealFailed | None, deadline: Deadline
    ) -> TakeOutcome:
        """The take's agreement (:func:`~ncclguard.recovery.snapshots.agreement.agree`): how every
        rank's swap went, and the K they take from this step on (the largest asked).

        Raises:
            HealFailed: a rank did not come (the pending snapshot is kept: this rank cannot tell
                whether the others committed it).
        """
        if self.every is not None:
            want = self.every
        else:
            if keep is None and kind == TAKE_OK:
                self._take_cost = self._cost if self._take_cost is None else 0.7 * self._take_cost + 0.3 * self._cost
            if keep is None:
                want = self._wanted_k()
            elif self._take_cost is not None:
                # A forced take's own cost says nothing, but the failures seen since may call for a
                # shorter K than the one in force. Without this, kills closer than K steps apart keep
                # every take forced and K where it was: at 100M parameters (10 s steps, K = 10, a kill
                # every 70 s) each kill went back 6 steps and the job gained one step a kill.
                want = min(keep, self._wanted_k())
            else:
                want = keep
        me, size = dist.get_rank(), dist.get_world_size()
        statement = TakeStatement(rank=me, kind=kind, want=want, why=str(error or "")[:MAX_WHY])
        store = job_store()
        if size == 1 or store is None:
            outcome = TakeOutcome(kind=kind, k=want, whys={me: statement.why} if kind != TAKE_OK else {})
        else:
            generation = current_world().generation
            outcome = self.rounds.agree(store, generation, statement, size, deadline, death_watch())
        if outcome.kind != TAKE_OK:
            return outcome
        self.lost.committed()
        if outcome.k != self.k:
            why = f"; a failure every {self._mtbf:.0f} s so far: Young's interval" if self._mtbf is not None else ""
            log.info("snapshots: every %d step(s) from step %d (one take %.3f s%s)", outcome.k, step, self._cost, why)
        self.k, self.next_due = outcome.k, step + outcome.k
        return outcome

    def _fit(self, fit: Fit) -> None:
        """Keeps what the memory cap leaves, and says what gave way."""
        if fit.dropped:
            self.keep, self.spares = fit.keep, fit.spares
            self.own, self.replicas = self.own[-self.keep :], {r: v[-self.keep :] for r, v in self.replicas.items()}
            if not self.spares:
                self._spare.clear()
            log.warning(
                "snapshots: %s dropped to stay under snapshot_max_bytes (%.1f MiB): %.1f MiB held in steady state",
                " and ".join(fit.dropped), (self.max_bytes or 0) / 2**20, fit.needed / 2**20,
            )  # fmt: skip
        if fit.over:
            log.warning(
                "snapshots: one snapshot of this rank's state and its replicas need %.1f MiB, over snapshot_max_bytes "
                "(%.1f MiB); kept all the same (nothing else can restore this rank). Raise the cap, shard the state "
                "over more ranks, or turn heal off",
                fit.needed / 2**20, (self.max_bytes or 0) / 2**20,
            )  # fmt: skip

    def _tell(self, snap: Snapshot, srcs: list[int], buddy: int, size: int, hosts: list[int]) -> None:
        own = snap.manifest.nbytes
        held = own + sum(r.manifest.nbytes for held in self.replicas.values() for r in held[-1:])
        if size < 2:
            log.warning(
                "snapshots: a world of one keeps its own state (%.1f MiB) %d time(s) and no replica: a lost "
                "process cannot be restored from memory",
                own / 2**20,
                self.keep,
            )
            return
        me = dist.get_rank()
        here = hosts.count(hosts[me])  # the ranks of this host (their shards are about this one's size)
        steady = steady_bytes(held, self.keep, self.spares)
        log.warning(
            "snapshots: rank %d holds %.1f MiB in steady state (its own %.1f MiB and replicas of rank(s) %s, %d of "
            "each%s), up to %.1f MiB during a take; this host's %d rank(s) about %.1f MiB; its replica goes to "
            "rank %d; one take costs %.3f s",
            me, steady / 2**20, own / 2**20, srcs, self.keep, ", with spare buffers" if self.spares else "",
            (steady + (0 if self.spares else held)) / 2**20, here, here * steady / 2**20, buddy, self._cost,
        )  # fmt: skip

    def _wanted_k(self) -> int:
        cost = self._take_cost if self._take_cost is not None else self._cost
        if self._step_time is None or cost <= 0:
            return 1
        store = job_store()
        self._mtbf = self._failures.read(store) if store is not None else None
        return wanted_k(cost, self._step_time, self.budget, self._mtbf)

    def holdings(self, size: int) -> list[int]:
        """What this rank holds, for the restore's agreement: its own snapshots' steps
        (:data:`SLOTS` places: the committed ones, then a pending one) and, for each rank of a
        world of ``size``, the steps of its replicas here (as many places each); -1 where none."""
        out = [-1] * (SLOTS * (1 + size))
        mine = [s.step for s in self.own] + ([self.pending.step] if self.pending is not None else [])
        out[: len(mine)] = mine
        for src in set(self.replicas) | set(self.pending_replicas):
            if 0 <= src < size:
                steps = [s.step for s in self.replicas.get(src, [])]
                if src in self.pending_replicas:
                    steps.append(self.pending_replicas[src].step)
                at = SLOTS * (1 + src)
                out[at : at + len(steps)] = steps
        return out

    def own_at(self, step: int) -> Snapshot | None:
        """This rank's own snapshot of ``step``, committed or pending, if it holds one."""
        return next((s for s in [*self.own, *([self.pending] if self.pending else [])] if s.step == step), None)

    def replica_at(self, src: int, step: int) -> Snapshot | None:
        """The replica of rank ``src``'s snapshot of ``step`` held here, committed or pending, if any."""
        held = [*self.replicas.get(src, []), *([self.pending_replicas[src]] if src in self.pending_replicas else [])]
        return next((s for s in held if s.step == step), None)

    def forget(self) -> None:
        """Drops every snapshot (a world whose numbering changed: they no longer fit its ranks)."""
        self.own.clear()
        self.replicas.clear()
        self.pending, self.pending_replicas = None, {}
        self._spare.clear()
        self.force = True


def _kept(snaps: list[Snapshot], keep: int) -> tuple[list[Snapshot], list[Snapshot]]:
    """The newest ``keep`` of ``snaps`` (oldest first), and those dropped."""
    return snaps[-keep:], snaps[:-keep]


def _peer_admission(mine: Manifest, size: int) -> Callable[[Manifest], str | None]:
    def admit(m: Manifest) -> str | None:
        if m.step != mine.step:
            return f"it is of step {m.step}, this take's is {mine.step}"
        return admit_peer(m, mine, size)

    return admit
