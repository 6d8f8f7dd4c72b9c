"""The restore: after a rebuild that admitted restarted ranks, every rank goes back to one snapshot.

Every rank of the new world calls :func:`restore` (the survivors after re-wrapping their model,
a restarted rank after wrapping its fresh one):

1. each rank's holdings (its own snapshots' steps, the replicas it keeps) are gathered, and every
   rank computes the same choice (:func:`choose`): the newest step ``S`` that every survivor holds
   of its own and of which a survivor holds each restarted rank's replica;
2. each holder sends its replica to the restarted rank it belongs to; the receiver checks its
   digest and whether it fits its model (names, shapes, dtypes, shard layout, world size), and
   every rank learns, in one all_reduce, who refused: then everyone stops, nothing applied anywhere;
3. the receivers apply the replica; a survivor whose live state is newer than ``S`` applies its own
   snapshot of ``S`` (a rollback: its loop goes back to ``S``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed
from ncclguard.recovery.heal import _from_json
from ncclguard.recovery.internals.step_state import restore_sent_generators
from ncclguard.recovery.snapshots.exchange import _wait, receive, send
from ncclguard.recovery.snapshots.keeper import Keeper, side_group
from ncclguard.recovery.snapshots.packing import Snapshot, unpack
from ncclguard.recovery.snapshots.state import OwnState
from ncclguard.results import Result
from ncclguard.world import current_world

__all__ = ["Restored", "choose", "restore"]


@dataclass
class Restored(Result):
    """One restore as this rank took part in it; truthy when every rank is at ``step``.

    Attributes:
        ok: every receiver applied its replica (or there was nothing to restore).
        role: ``"receiver"``, ``"holder"`` (sent a replica), ``"survivor"`` or ``"none"`` (nobody joined).
        step: the snapshot's step every rank is at now (None when nothing was restored).
        rolled_back: this survivor's live state went back to ``step``: its loop must go back too.
        receivers: the ranks that received (sorted).
        holders: who sent each receiver its replica.
        bytes: bytes this rank sent or received.
        elapsed_s: seconds from entry to return.
        timings: where those seconds went on this rank: ``agree`` (the holdings gathered, the
            step chosen), ``fetch`` (the replicas sent and received), ``check`` (each rank's check
            and the answer every rank learns), ``apply`` (the state put back).
        error: a :class:`~ncclguard.errors.HealFailed` when not ``ok``.
    """

    ok: bool
    role: str
    step: int | None = None
    rolled_back: bool = False
    receivers: list[int] = field(default_factory=list)
    holders: dict[int, int] = field(default_factory=dict)
    bytes: int = 0
    elapsed_s: float = 0.0
    error: HealFailed | None = None
    timings: dict[str, float] = field(default_factory=dict)


def choose(holdings: list[list[int]], receivers: list[int]) -> tuple[int, dict[int, int]] | str:
    """The step to go back to and who sends each receiver its replica, or why there is none.

    Args:
        holdings: per rank, :meth:`Keeper.holdings`: own steps at 0-1, then rank ``r``'s replica
            steps at ``2 + 2r`` and ``3 + 2r``.
        receivers: the ranks that hold nothing of their own (restarted).

    Returns:
        ``(step, {receiver: holder})``, or a sentence saying what is missing.
    """
    live = [r for r in range(len(holdings)) if r not in receivers]
    if not live:
        return "every rank of this world was restarted: no rank holds a snapshot"
    common = set.intersection(*({s for s in holdings[r][:2] if s >= 0} for r in live))
    for step in sorted(common, reverse=True):
        holders = {}
        for j in receivers:
            h = next((r for r in live if step in holdings[r][2 + 2 * j : 4 + 2 * j]), None)
            if h is None:
                break
            holders[j] = h
        else:
            return step, holders
    if not common:
        return f"the live ranks {rank_ranges(live)} hold no snapshot of one same step"
    lost = [j for j in receivers if not any(s in common for r in live for s in holdings[r][2 + 2 * j : 4 + 2 * j])]
    return (
        f"no live rank holds a replica of rank(s) {rank_ranges(lost)} at a step the others hold "
        f"({sorted(common)}): the ranks that kept them were lost too"
    )


def _split(state: OwnState) -> tuple[OwnState, Any]:
    """The codec's part of a snapshot, and its generators (the keeper adds them to every snapshot)."""
    tensors = {k: t for k, t in state.tensors.items() if not k.startswith("g:")}
    meta = {k: v for k, v in state.meta.items() if k != "generators"}
    gens = [
        t.clone() for k, t in state.tensors.items() if k.startswith("g:")
    ]  # views of the buffer crash set_rng_state
    return OwnState(tensors, meta), (state.meta.get("generators"), gens)


def _apply(keeper: Keeper, state: OwnState, generators: Any) -> None:
    keeper.codec.apply(state)
    sent, gens = generators
    if sent is not None:
        restore_sent_generators(_from_json(sent, gens))


def restore(keeper: Keeper, current: int | None, timeout_s: float, receivers: list[int] | None = None) -> Restored:
    """Brings every rank of the world to one snapshot's step (see the module doc); every rank calls it.

    Args:
        keeper: this loop's snapshots.
        current: the step whose start this rank's live state is (None on a restarted rank).
        timeout_s: bound of the whole restore.
        receivers: the ranks that receive; default the world's ``joined`` (the same on every rank).

    Returns:
        A :class:`Restored`; falsy with a :class:`~ncclguard.errors.HealFailed` when no snapshot
        fits or a receiver refused (nothing applied anywhere) or a transfer failed.
    """
    start, deadline = time.monotonic(), Deadline.after(timeout_s)
    size, me = dist.get_world_size(), dist.get_rank()
    wanted = sorted(current_world().joined if receivers is None else set(receivers))
    if not wanted:
        return Restored(True, "none")
    result = Restored(False, "receiver" if me in wanted else "survivor", receivers=wanted)
    try:
        _restore(keeper, current, me, size, wanted, deadline, result)
        result.ok = True
    except HealFailed as exc:
        result.error = exc
        log.error("snapshots: the restore failed: %s", exc)
    result.elapsed_s = time.monotonic() - start
    keeper.force = True  # the receivers hold nothing to replicate yet, and their sources' replicas are gone
    if result.ok:
        log.warning(
            "snapshots: every rank is back at step %s (rank %d %s, %d bytes, %.3f s; replicas from %s)",
            result.step, me, result.role + (", rolled back" if result.rolled_back else ""), result.bytes,
            result.elapsed_s, result.holders,
        )  # fmt: skip
    return result


def _restore(
    keeper: Keeper, current: int | None, me: int, size: int, wanted: list[int], deadline: Deadline, result: Restored
) -> None:
    # On the world's side group: the transfers involve some ranks only, and the default group's
    # sequence numbers must stay equal on every rank (the next commit compares them).
    side = side_group().group
    last = [time.monotonic()]

    def lap(name: str) -> None:
        now = time.monotonic()
        result.timings[name] = round(now - last[0], 4)
        last[0] = now

    mine = torch.tensor(keeper.holdings(size) if me not in wanted else [-1] * (2 + 2 * size), dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    _wait([dist.all_gather(everyone, mine, group=side, async_op=True)], deadline, "the snapshots' holdings")
    chosen = choose([t.tolist() for t in everyone], wanted)
    if isinstance(chosen, str):
        raise HealFailed(chosen)
    step, holders = chosen
    result.step, result.holders = step, holders
    lap("agree")
    got: Snapshot | None = None
    for j, h in holders.items():
        if me == h:
            replica = keeper.replica_at(j, step)
            assert replica is not None  # choose() saw this rank hold it
            result.role, result.bytes = "holder", result.bytes + replica.manifest.nbytes
            send(replica, j, side, deadline)
        elif me == j:
            fresh = keeper.codec.capture().tensors.values()  # the fresh model's own size bounds what it takes
            limit = 2 * sum(t.numel() * t.element_size() for t in fresh) + (1 << 20)
            got = receive(h, side, deadline, limit)
            result.bytes = got.manifest.nbytes
    lap("fetch")
    # Every rank checks what it would apply, and all learn who refused before anything is copied.
    refusal, state, generators = None, None, None
    try:
        if got is not None:
            state, generators = _split(unpack(got))
            if got.manifest.rank != me:
                refusal = f"the replica is rank {got.manifest.rank}'s, not this rank's ({me})"
        elif current != step:
            own = keeper.own_at(step)
            state, generators = _split(unpack(own)) if own is not None else (None, None)
        refusal = refusal or (keeper.codec.check(state) if state is not None else None)
    except HealFailed as exc:
        refusal = str(exc)
    flags = torch.zeros(size, dtype=torch.int64)
    flags[me] = 1 if refusal is not None else 0
    _wait([dist.all_reduce(flags, group=side, async_op=True)], deadline, "the ranks' answer")
    refused = [r for r in range(size) if flags[r]]
    lap("check")
    if refused:
        raise HealFailed(
            f"rank(s) {rank_ranges(refused)} refused the snapshot of step {step}" + (f": {refusal}" if refusal else ""),
            refused_ranks=refused,
        )
    if state is not None:
        _apply(keeper, state, generators)
        result.rolled_back = got is None
    lap("apply")
