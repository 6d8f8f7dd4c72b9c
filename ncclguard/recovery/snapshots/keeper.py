"""The snapshot keeper: this rank's own snapshots and the replicas it holds for its peers.

At a step boundary that is due (every ``K`` steps, the same ``K`` on every rank), :meth:`Keeper.take`
packs the rank's own state (:class:`~ncclguard.recovery.snapshots.state.StateCodec`) and its
generators into host memory, and swaps snapshots with the buddies over a side gloo group of the
world: it sends its own to its buddy and receives the replicas of the ranks whose buddy it is
(:mod:`~ncclguard.recovery.snapshots.placement`). Two of each are kept, the newest and the one
before: while the newest is on its way, the one before is the last that every rank is known to
hold, and a restore may have to go back to it.

``K``: with ``every=None`` each take measures its own cost against the step time seen since the
last one and asks for the smallest ``K`` that keeps snapshots under ``budget`` (2%) of the step
time; the ranks agree on the largest ``K`` asked (one all_reduce on the side group), so that they
take their snapshots at the same steps. A ``K`` set by hand is agreed once, at the first take of a
world: the takes after make no collective but the swap.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.recovery._step.step_state import StepState, generators_to_send
from ncclguard.recovery.commit import note_point_to_point
from ncclguard.recovery.heal import _to_json
from ncclguard.recovery.snapshots.exchange import _wait, swap
from ncclguard.recovery.snapshots.packing import Snapshot, pack
from ncclguard.recovery.snapshots.placement import buddies, host_key, host_number, sources
from ncclguard.recovery.snapshots.state import StateCodec
from ncclguard.world import Slot, World, current_world

__all__ = ["Keeper", "SideGroup", "side_group"]

MAX_EVERY = 1000  # a snapshot at least every 1000 steps, whatever it costs


@dataclass
class SideGroup:
    """The world's side group for snapshots, and where each rank's replica goes."""

    group: Any
    buddy: list[int]
    hosts: list[int]


def _side_group(world: World) -> SideGroup:
    group = dist.new_group(backend="gloo")
    mine = torch.tensor([host_number(host_key())], dtype=torch.int64)
    hosts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(hosts, mine, group=group)
    numbers = [int(h.item()) for h in hosts]
    return SideGroup(group, buddies(numbers), numbers)


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
        timeout_s: the bound of one swap with the buddies.

    Attributes:
        own: this rank's own snapshots, oldest first (at most 2).
        replicas: the replicas it keeps, by source rank, oldest first (at most 2 each).
        k: snapshots are taken every ``k`` steps (agreed by every rank).
        takes: snapshots taken so far (forced ones included).
        spent_s: seconds the training loop spent taking them (what the steps paid for them).
    """

    codec: StateCodec
    every: int | None = None
    budget: float = 0.02
    timeout_s: float = 60.0
    own: list[Snapshot] = field(default_factory=list)  # oldest first, at most 2
    replicas: dict[int, list[Snapshot]] = field(default_factory=dict)  # by source rank, oldest first
    k: int = 1
    next_due: int | None = None
    force: bool = True  # the first step, and the first after a restore, always take one
    takes: int = 0
    spent_s: float = 0.0
    _last_begin: float | None = None
    _step_time: float | None = None
    _cost: float = 0.0  # the last take's seconds
    _take_cost: float | None = None  # a take's seconds, smoothed over the unforced ones
    _told: bool = False

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
        """Takes this rank's snapshot of ``step`` and swaps it with the buddies (every rank at once).

        Args:
            step: the step whose start the state is.
            kept: the step's generators as the step found them (the engine's snapshot of the step).

        Raises:
            HealFailed: a swap failed or missed its deadline (the newest complete snapshots stay).
        """
        start = time.monotonic()
        side = side_group()
        me = dist.get_rank()
        state = self.codec.capture()
        found: list[torch.Tensor] = []
        state.meta["generators"] = _to_json(generators_to_send(kept), found, "generators")
        for i, t in enumerate(found):
            state.tensors[f"g:{i}"] = t
        reuse = self.own[0].payload if len(self.own) == 2 else None
        snap = pack(state, step, me, reuse)
        self.own = [*self.own[-1:], snap]
        srcs = sources(side.buddy, me)
        limit = 4 * snap.manifest.nbytes + (1 << 20)  # ranks' shards differ a little in size
        olds = {s: self.replicas[s][0].payload for s in srcs if len(self.replicas.get(s, [])) == 2}
        got = swap(snap, side.buddy[me], srcs, side.group, Deadline.after(self.timeout_s), limit, olds)
        for src, replica in got.items():
            self.replicas[src] = [*self.replicas.get(src, [])[-1:], replica]
        self._cost = time.monotonic() - start
        # A forced take (the first, or the first in a new world) also waits for slow peers and makes
        # the side group: it says nothing of what a take costs, so it asks for the K in force.
        self._agree_k(step, side, self.k if self.force else None)
        self.force = False
        self.takes += 1
        self.spent_s += time.monotonic() - start
        if not self._told:
            self._told = True
            log.warning(
                "snapshots: rank %d keeps its own state (%.1f MiB) twice and replicas of rank(s) %s twice: "
                "%.1f MiB of host memory; its replica goes to rank %d; one take costs %.3f s",
                me, snap.manifest.nbytes / 2**20, srcs, 2 * (snap.manifest.nbytes + sum(r.manifest.nbytes for r in got.values())) / 2**20,
                side.buddy[me], self._cost,
            )  # fmt: skip

    def _agree_k(self, step: int, side: SideGroup, keep: int | None) -> None:
        if self.every is not None and keep is None:
            self.next_due = step + self.k  # set by hand: agreed at the first take of this world
            return
        if self.every is not None:
            want = self.every
        else:
            if keep is None:
                self._take_cost = self._cost if self._take_cost is None else 0.7 * self._take_cost + 0.3 * self._cost
            want = keep if keep is not None else self._wanted_k()
        k = torch.tensor([want], dtype=torch.int64)
        # Bounded: a rank that died since the last take fails this step, it does not hang it.
        work = dist.all_reduce(k, op=dist.ReduceOp.MAX, group=side.group, async_op=True)
        _wait([work], Deadline.after(self.timeout_s), "the ranks' agreement on K")
        if int(k.item()) != self.k:
            log.info("snapshots: every %d step(s) from step %d (one take %.3f s)", int(k.item()), step, self._cost)
        self.k = int(k.item())
        self.next_due = step + self.k

    def _wanted_k(self) -> int:
        cost = self._take_cost if self._take_cost is not None else self._cost
        if self._step_time is None or cost <= 0:
            return 1
        return max(1, min(MAX_EVERY, math.ceil(cost / (self.budget * self._step_time))))

    def holdings(self, size: int) -> list[int]:
        """What this rank holds, for the restore's agreement: its own snapshots' steps (two
        places) and, for each rank of a world of ``size``, the steps of its replicas here (two
        places each); -1 where there is none."""
        out = [-1, -1] + [-1, -1] * size
        for i, s in enumerate(self.own[-2:]):
            out[i] = s.step
        for src, held in self.replicas.items():
            if 0 <= src < size:
                for i, s in enumerate(held[-2:]):
                    out[2 + 2 * src + i] = s.step
        return out

    def own_at(self, step: int) -> Snapshot | None:
        """This rank's own snapshot of ``step``, if it holds one."""
        return next((s for s in self.own if s.step == step), None)

    def replica_at(self, src: int, step: int) -> Snapshot | None:
        """The replica of rank ``src``'s snapshot of ``step`` held here, if any."""
        return next((s for s in self.replicas.get(src, []) if s.step == step), None)

    def forget(self) -> None:
        """Drops every snapshot (a world whose numbering changed: they no longer fit its ranks)."""
        self.own.clear()
        self.replicas.clear()
        self.force = True
