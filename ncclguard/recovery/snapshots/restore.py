"""The restore: after a rebuild that admitted restarted ranks, every rank goes back to one snapshot.

Every rank of the new world calls :func:`restore` (the survivors after re-wrapping their model,
a restarted rank after wrapping its fresh one):

1. each rank's holdings (its own snapshots' steps, the replicas it keeps) are gathered, and every
   rank computes the same choice (:func:`choose`): the newest step ``S`` that every survivor holds
   of its own and of which a survivor holds each restarted rank's replica;
2. each holder sends its replica to the restarted rank it belongs to; the receiver admits its
   manifest against the model it has built (names, dtypes, shapes: the bound of what it allocates)
   and checks its digest when it has arrived, and every rank learns, in one all_reduce, who
   refused (a manifest that does not fit, a digest that does not match, NaN or Inf in a floating
   tensor of the replica or of a survivor's own snapshot): then the ranks go to the next older step
   that every survivor and a replica holder share (a keeper with ``keep=2``), and stop when there is
   none, nothing applied anywhere;
3. the receivers apply the replica; a survivor whose live state is newer than ``S`` applies its own
   snapshot of ``S`` (a rollback: its loop goes back to ``S``).

A framework that builds the model holding the state only as its loop starts (the HF Trainer builds
its DeepSpeed engine inside ``train()``, after it has read the state it resumes from) takes the two
halves apart: :func:`fetch` (1 and the transfers of 2, each rank unpacking what it will put in) before
the loop, :func:`put_back` (the check, the ranks' answer, 3) once the model is built. :func:`agree`
is the ranks' answer alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed, SnapshotDamaged, SnapshotRefused
from ncclguard.recovery._step.state import restore_sent_generators
from ncclguard.recovery.snapshots.exchange import Admit, _op, _run, at_most, receive, send
from ncclguard.recovery.snapshots.keeper import SLOTS, Keeper, side_group
from ncclguard.recovery.snapshots.packing import Snapshot, admit_fresh, unpack
from ncclguard.recovery.snapshots.state import OwnState, StateCodec
from ncclguard.recovery.state_json import from_json
from ncclguard.results import Result
from ncclguard.world import current_world

__all__ = ["Fetched", "Restored", "agree", "choose", "fetch", "put_back", "restore"]


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
        error: a :class:`~ncclguard.errors.HealFailed` when not ``ok``.
        timings: where those seconds went on this rank: ``agree`` (the holdings gathered, the
            step chosen), ``fetch`` (the replicas sent and received, unpacked), ``check`` (each
            rank's check and the answer every rank learns), ``apply`` (the state put back).
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


def choose(
    holdings: list[list[int]], receivers: list[int], refused: set[int] | frozenset[int] = frozenset()
) -> tuple[int, dict[int, int]] | str:
    """The step to go back to and who sends each receiver its replica, or why there is none.

    Args:
        holdings: per rank, :meth:`Keeper.holdings`: own steps at ``[0, SLOTS)``, then rank ``r``'s
            replica steps at ``[SLOTS * (1 + r), SLOTS * (2 + r))``.
        receivers: the ranks that hold nothing of their own (restarted).
        refused: steps tried already and refused by a receiver (a damaged or unfit replica).

    Returns:
        ``(step, {receiver: holder})``, or a sentence saying what is missing.
    """

    def held(r: int, slot: int) -> set[int]:
        return {s for s in holdings[r][SLOTS * slot : SLOTS * (slot + 1)] if s >= 0}

    live = [r for r in range(len(holdings)) if r not in receivers]
    if not live:
        return "every rank of this world was restarted: no rank holds a snapshot"
    common = set.intersection(*(held(r, 0) for r in live))
    for step in sorted(common - set(refused), reverse=True):
        holders = {}
        for j in receivers:
            h = next((r for r in live if step in held(r, 1 + j)), None)
            if h is None:
                break
            holders[j] = h
        else:
            return step, holders
    tried = f" (step(s) {sorted(refused)} refused)" if refused else ""
    if not common:
        return f"the live ranks {rank_ranges(live)} hold no snapshot of one same step"
    lost = [j for j in receivers if not any(s in common for r in live for s in held(r, 1 + j))]
    if not lost:
        return f"every step the live ranks share {sorted(common)} was refused by a receiver{tried}"
    return (
        f"no live rank holds a replica of rank(s) {rank_ranges(lost)} at a step the others hold "
        f"({sorted(common)}): the ranks that kept them were lost too{tried}"
    )


def _split(state: OwnState) -> tuple[OwnState, Any]:
    """The codec's part of a snapshot, and its generators (the keeper adds them to every snapshot)."""
    tensors = {k: t for k, t in state.tensors.items() if not k.startswith("g:")}
    meta = {k: v for k, v in state.meta.items() if k != "generators"}
    gens = [
        t.clone() for k, t in state.tensors.items() if k.startswith("g:")
    ]  # views of the buffer crash set_rng_state
    return OwnState(tensors, meta), (state.meta.get("generators"), gens)


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
    fetched = _fetch(keeper, current, deadline, receivers, None)
    if fetched is None:
        return Restored(True, "none")
    return _put_back(keeper, keeper.codec, fetched, deadline, start)


@dataclass
class Fetched:
    """One rank's part of a restore once the step is agreed and the replicas sent (:func:`fetch`).

    Attributes:
        step: the snapshot's step every rank goes back to (None when the choice failed).
        holders: who sent each receiver its replica.
        receivers: the ranks that received (sorted).
        role: ``"receiver"``, ``"holder"`` or ``"survivor"``.
        state: the codec's part of what this rank puts in place (its replica, or its own snapshot
            of ``step``), or None (its live state is at ``step`` already).
        generators: the generators of that snapshot, for
            :func:`~ncclguard.recovery._step.state.restore_sent_generators` (None: none).
        rolled_back: this survivor goes back from a newer live state to ``step``.
        bytes: bytes this rank sent or received.
        refusal: why this rank cannot take ``state`` so far (a bad replica), or None.
        error: a fetch that failed on this rank (no step, a transfer), or None.
        timings: seconds of its parts on this rank, ``agree`` and ``fetch`` (see :class:`Restored`).
    """

    step: int | None
    holders: dict[int, int]
    receivers: list[int]
    role: str
    state: OwnState | None = None
    generators: Any = None
    rolled_back: bool = False
    bytes: int = 0
    refusal: str | None = None
    error: HealFailed | None = None
    timings: dict[str, float] = field(default_factory=dict)


def fetch(
    keeper: Keeper,
    current: int | None,
    timeout_s: float,
    receivers: list[int] | None = None,
    limit: int | None = None,
) -> Fetched | None:
    """The first half of :func:`restore`, for a framework that builds the model holding the state
    only later (the HF Trainer builds its DeepSpeed engine when its loop starts): every rank agrees
    on the step, the holders send the replicas, and each rank unpacks what it is to put in place.
    Nothing is applied; :func:`put_back` does that once the model is built. Every rank calls it.

    Args:
        keeper: this loop's snapshots.
        current: the step whose start this rank's live state is; None when it has none to keep
            (a restarted rank, or a survivor whose model is built anew: it takes its own snapshot).
        timeout_s: bound of the transfers.
        receivers: the ranks that receive; default the world's ``joined``.
        limit: the most bytes a receiver takes; default twice its model's own state (the codec's
            capture, which needs the model built).

    Returns:
        A :class:`Fetched` (its ``error`` says a failure on this rank), or None when nobody joined.
    """
    return _fetch(keeper, current, Deadline.after(timeout_s), receivers, limit)


def put_back(codec: StateCodec, fetched: Fetched, timeout_s: float) -> Restored:
    """The second half of :func:`restore`: every rank checks what :func:`fetch` gave it against its
    model (``codec``), all learn who refused, and only then does each put its state in place.

    Args:
        codec: the model's codec, built on the world the state goes into.
        fetched: this rank's :func:`fetch`.
        timeout_s: bound of the ranks' answer.

    Returns:
        A :class:`Restored`, falsy with a :class:`~ncclguard.errors.HealFailed` when any rank
        refused or failed before (nothing applied anywhere).
    """
    return _put_back(None, codec, fetched, Deadline.after(timeout_s), time.monotonic())


def _fetch(
    keeper: Keeper, current: int | None, deadline: Deadline, receivers: list[int] | None, limit: int | None
) -> Fetched | None:
    size, me = dist.get_world_size(), dist.get_rank()
    wanted = sorted(current_world().joined if receivers is None else set(receivers))
    if not wanted:
        return None
    fetched = Fetched(None, {}, wanted, "receiver" if me in wanted else "survivor")
    try:
        _agree_and_send(keeper, current, me, size, deadline, fetched, limit)
    except HealFailed as exc:
        fetched.error = exc
    return fetched


def _put_back(keeper: Keeper | None, codec: StateCodec, fetched: Fetched, deadline: Deadline, start: float) -> Restored:
    me = dist.get_rank()
    result = Restored(False, fetched.role, fetched.step, receivers=fetched.receivers, holders=fetched.holders)
    result.bytes, result.timings = fetched.bytes, dict(fetched.timings)
    try:
        if fetched.error is not None and keeper is not None:
            raise fetched.error  # restore(): a rank whose transfer failed says so alone, as before
        _check_and_apply(codec, fetched, me, dist.get_world_size(), deadline, result.timings)
        result.ok, result.rolled_back = True, fetched.rolled_back
    except HealFailed as exc:
        result.error = exc
        log.error("snapshots: the restore failed: %s", exc)
    result.elapsed_s = time.monotonic() - start
    if keeper is not None:
        keeper.force = True  # the receivers hold nothing to replicate yet, and their sources' replicas are gone
    if result.ok and fetched.receivers:  # a state carried to a new model alone is its caller's to log
        log.warning(
            "snapshots: every rank is back at step %s (rank %d %s, %d bytes, %.3f s; replicas from %s)",
            result.step, me, result.role + (", rolled back" if result.rolled_back else ""), result.bytes,
            result.elapsed_s, result.holders,
        )  # fmt: skip
    return result


def _agree_and_send(
    keeper: Keeper, current: int | None, me: int, size: int, deadline: Deadline, fetched: Fetched, limit: int | None
) -> None:
    # On the world's side group: the transfers involve some ranks only, and the default group's
    # sequence numbers must stay equal on every rank (the next commit compares them).
    side = _op("the snapshots' side group", side_group).group
    wanted = fetched.receivers
    lap = _Laps(fetched.timings)
    mine = torch.tensor(keeper.holdings(size) if me not in wanted else [-1] * (SLOTS * (1 + size)), dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    _run("the snapshots' holdings", partial(dist.all_gather, everyone, mine, group=side, async_op=True), deadline)
    holdings = [t.tolist() for t in everyone]
    lap("agree")
    admit = at_most(limit) if limit is not None else None
    refused: set[int] = set()
    last: tuple[int, list[int], str | None] | None = None  # the step tried last, who refused it, why here
    while True:
        chosen = choose(holdings, wanted, refused)
        if isinstance(chosen, str) and last is not None:
            tried, bad, why = last
            raise HealFailed(
                f"rank(s) {rank_ranges(bad)} refused the snapshot of step {tried}"
                + (f": {why}" if why else "")
                + f"; no older step is left to go back to ({chosen})",
                refused_ranks=bad,
            )
        if isinstance(chosen, str):
            raise HealFailed(chosen)
        step, holders = chosen
        fetched.step, fetched.holders = step, holders
        fetched.state, fetched.generators, fetched.refusal, fetched.rolled_back = None, None, None, False
        if admit is None and me in wanted:
            admit = _fresh_admission(keeper)
        problem = _transfer(keeper, current, me, step, holders, side, deadline, fetched, admit)
        # Every rank learns who could not take the step's replica: all go to an older one together.
        flags = torch.zeros(size, dtype=torch.int64)
        flags[me] = 1 if problem is not None else 0
        _run("the ranks' answer on the replicas", partial(dist.all_reduce, flags, group=side, async_op=True), deadline)
        bad = [r for r in range(size) if flags[r]]
        if not bad:
            break
        log.warning(
            "snapshots: rank(s) %s could not take the snapshot of step %d%s; trying an older one",
            rank_ranges(bad), step, f" ({problem})" if problem else "",
        )  # fmt: skip
        refused.add(step)
        last = (step, bad, problem)
    lap("fetch")


def _fresh_admission(keeper: Keeper) -> Admit:
    """What a restarted rank takes: a replica whose entries fit the state its fresh model holds."""
    fresh = keeper.codec.capture()  # the model is built and wrapped: its shards' shapes are known
    return lambda m: admit_fresh(m, fresh)


def _transfer(
    keeper: Keeper,
    current: int | None,
    me: int,
    step: int,
    holders: dict[int, int],
    side: Any,
    deadline: Deadline,
    fetched: Fetched,
    admit: Admit | None,
) -> str | None:
    """This rank's part of sending the replicas of ``step`` and unpacking what it puts in place.

    Returns:
        Why this rank cannot take ``step`` (its replica refused or damaged), or None. A failure of
        the transfer itself (a peer gone, the deadline) raises.
    """
    got: Snapshot | None = None
    try:
        for j, h in holders.items():
            if me == h:
                replica = keeper.replica_at(j, step)
                assert replica is not None  # choose() saw this rank hold it
                fetched.role = "holder"
                try:
                    send(replica, j, side, deadline)
                    fetched.bytes += replica.manifest.nbytes
                except SnapshotRefused:
                    pass  # the receiver says why in the ranks' answer
            elif me == j:
                assert admit is not None
                got = receive(h, side, deadline, admit)
                fetched.bytes = got.manifest.nbytes
        if got is not None:
            fetched.state, fetched.generators = _split(unpack(got))
            if got.manifest.rank != me:
                return f"the replica is rank {got.manifest.rank}'s, not this rank's ({me})"
            return _nonfinite(fetched.state, f"rank {h}'s replica of step {step}")
        elif current != step:
            own = keeper.own_at(step)
            if own is None:
                return f"this rank holds no snapshot of its own at step {step}"
            fetched.state, fetched.generators = _split(unpack(own))
            fetched.rolled_back = True
            return _nonfinite(fetched.state, f"this rank's snapshot of step {step}")
    except (SnapshotRefused, SnapshotDamaged) as exc:  # this step's replica: an older step may be whole
        return str(exc)
    return None


def _nonfinite(state: OwnState, what: str) -> str | None:
    """Why a state that holds NaN or Inf in a floating tensor is not applied, or None. A replica is
    never trusted blindly: its digest says its bytes arrived as they were taken, not that the
    numbers were sound (a step whose gradient turned NaN before the take); the ranks then go to the
    step before. One pass over the state, at a restore only."""
    for name, t in state.tensors.items():
        if (t.is_floating_point() or t.is_complex()) and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return f"{what} holds NaN or Inf in {name[:80]} ({bad} of {t.numel()} values): not applied"
    return None


def _check_and_apply(
    codec: StateCodec, fetched: Fetched, me: int, size: int, deadline: Deadline, timings: dict[str, float]
) -> None:
    # Every rank checks what it would apply, and all learn who refused before anything is copied.
    lap = _Laps(timings)
    refusal = str(fetched.error) if fetched.error is not None else fetched.refusal
    try:
        if refusal is None and fetched.state is not None:
            refusal = codec.check(fetched.state)
    except Exception as exc:  # noqa: BLE001 - a check that cannot read the state refuses it
        refusal = f"{type(exc).__name__}: {exc}"
    try:
        _agree(refusal, f"the snapshot of step {fetched.step}", me, size, deadline)
    finally:
        lap("check")
    if fetched.state is not None:
        codec.apply(fetched.state)
        sent, gens = fetched.generators if fetched.generators is not None else (None, [])
        if sent is not None:
            restore_sent_generators(from_json(sent, gens))
    lap("apply")


class _Laps:
    """Writes the seconds since its last call (or its making) under a part's name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.last = into, time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.into[name] = round(now - self.last, 4)
        self.last = now


def agree(refusal: str | None, what: str, timeout_s: float) -> None:
    """Every rank of the world says whether it refuses ``what``, on the snapshots' side group; if
    any does, every rank raises the same error (nothing is to be applied anywhere). Every rank calls it.

    Args:
        refusal: why this rank refuses, or None.
        what: what is agreed on, for the error.
        timeout_s: bound of the exchange.

    Raises:
        HealFailed: a rank refused (its reason when it is this one), or the exchange failed.
    """
    _agree(refusal, what, dist.get_rank(), dist.get_world_size(), Deadline.after(timeout_s))


def _agree(refusal: str | None, what: str, me: int, size: int, deadline: Deadline) -> None:
    flags = torch.zeros(size, dtype=torch.int64)
    flags[me] = 1 if refusal is not None else 0
    side = _op("the snapshots' side group", side_group).group
    _run("the ranks' answer", partial(dist.all_reduce, flags, group=side, async_op=True), deadline)
    refused = [r for r in range(size) if flags[r]]
    if refused:
        raise HealFailed(
            f"rank(s) {rank_ranges(refused)} refused {what}" + (f": {refusal}" if refusal else ""),
            refused_ranks=refused,
        )
