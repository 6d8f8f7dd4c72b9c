"""Moving snapshots between ranks: a manifest's length, its JSON, an answer, then the bytes.

Every transfer is three sends from the sender (an int64 length, the manifest's bytes, the payload)
and one from the receiver (an int64: 1 to take the payload, 0 to refuse it), each waited on with
what is left of one deadline. The receiver bounds the manifest's length before it allocates, reads
the manifest as JSON into its pydantic model, and admits it (an ``admit`` function: its entries
against the state this rank holds) before it allocates the payload: a peer can make it neither
unpickle nor allocate without limit. A refused sender learns it at once and sends no payload.
When the payload has arrived, its digest is checked: a damaged replica is never kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed, SnapshotDamaged, SnapshotRefused
from ncclguard.recovery.snapshots.packing import MAX_MANIFEST_BYTES, Manifest, Snapshot, digest, read_manifest
from ncclguard.store.bounded import run_into
from ncclguard.store.deaths import DeathWatch
from ncclguard.world import current_world

__all__ = [
    "Admit",
    "Dead",
    "LOOK_EVERY_S",
    "at_most",
    "death_watch",
    "job_store",
    "receive",
    "run_watched",
    "send",
    "swap",
]

LOOK_EVERY_S = 0.5  # how often a watched wait reads the death notices (one store call when none is new)

#: The members known dead (``{rank: how it is known}``), read within a deadline.
Dead = Callable[[Deadline], dict[int, str]]

#: Says why a manifest cannot be taken here, or None to take it.
Admit = Callable[[Manifest], str | None]


def job_store() -> Any:
    """The job's store (the current world's, or the default group's), or None where there is none."""
    store = current_world().store
    if store is None and dist.is_initialized():
        store = compat.default_store()
    return store


def death_watch() -> Dead:
    """The members of the current world that their launchers reported dead since it was made, read
    within a deadline (nothing is known where the job's store is not: the deadline bounds the wait)."""
    world = current_world()
    store = job_store()
    if store is None:
        return lambda deadline: {}
    size = dist.get_world_size()
    watch = DeathWatch(store, world.deaths_seen, {r: world.origin(r) for r in range(size)}, dist.get_rank())
    return watch.look_within


def at_most(max_bytes: int) -> Admit:
    """An :data:`Admit` that takes a payload of at most ``max_bytes``."""

    def admit(m: Manifest) -> str | None:
        return None if m.nbytes <= max_bytes else f"it declares {m.nbytes} bytes, over this rank's bound of {max_bytes}"

    return admit


def _op(what: str, start: Callable[[], Any]) -> Any:
    """Starts one op: gloo raises at once, not at the wait, on a pair its peer already closed."""
    try:
        return start()
    except Exception as exc:  # gloo's errors are RuntimeErrors of many kinds
        raise HealFailed(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _run(what: str, start: Callable[[], Any], deadline: Deadline, dead: Dead | None = None) -> None:
    """Starts one op and waits for it within what is left of ``deadline`` (see :func:`_wait`)."""
    _wait([_op(what, start)], deadline, what, dead)


def _wait(works: list[Any], deadline: Deadline, what: str, dead: Dead | None = None) -> None:
    """Waits for ``works`` within ``deadline``; with ``dead``, gives up as soon as it names a member.

    A gloo point-to-point work cannot be waited on in slices (a wait that times out closes its pair:
    "Application timeout caused pair closure"), so the wait runs whole on a thread of its own while
    this one reads the death notices. Given up, that thread stays in its wait until the deadline
    (the side group is a dead world's by then; exit waits for it, :mod:`ncclguard.store.bounded`).

    Raises:
        HealFailed: a work failed, missed the deadline, or a member died.
    """
    if dead is None:
        _wait_each(works, deadline, what)
        return
    box: dict[str, Any] = {}
    done = threading.Event()
    waiter = partial(run_into, partial(_wait_each, works, deadline, what), box, done)
    threading.Thread(target=waiter, name="ncclguard-snapshot-wait", daemon=True).start()
    while not done.wait(max(min(LOOK_EVERY_S, deadline.left()), 0.001)):
        if deadline.passed() and not done.wait(1.0):  # the wait itself ends at the deadline: a second more
            raise HealFailed(f"the deadline passed before {what}")
        _give_up_if_dead(dead, deadline, what)
    if "error" in box:
        raise box["error"]


def _give_up_if_dead(dead: Dead, deadline: Deadline, what: str) -> None:
    gone = dead(Deadline.within(min(1.0, max(deadline.left(), 0.001))))
    if gone:
        said = "; ".join(f"rank {r}: {why}" for r, why in sorted(gone.items()))
        raise HealFailed(f"{what} failed: a member is gone ({said})")


def _wait_each(works: list[Any], deadline: Deadline, what: str) -> None:
    for work in works:
        if deadline.passed():
            raise HealFailed(f"the deadline passed before {what}")
        try:
            work.wait(timeout=deadline.as_timedelta())
        except Exception as exc:  # gloo's errors are RuntimeErrors of many kinds
            raise HealFailed(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def run_watched(what: str, start: Callable[[], Any], deadline: Deadline, dead: Dead) -> None:
    """Starts one collective and waits for it within ``deadline``, giving up as soon as ``dead``
    names a member: a rank that died mid-take leaves its ring neighbours an error, but the others
    of a gloo all_reduce wait on the live ones, up to the deadline (heal_timeout_s, 60 s).

    Only for collectives: a gloo all_reduce's work says it is complete by itself, and a wait that
    timed out leaves it to be waited on again ("Operation timed out!", ``is_completed()`` False; a
    failed op is complete); a point-to-point work is complete only once waited on (torch 2.13,
    measured here), so sends and receives wait on a thread of their own (:func:`_wait`).

    Args:
        what: the op in words, for the error.
        start: starts the op (``async_op=True``) and returns its work.
        deadline: when to stop waiting.
        dead: the members known dead (``{rank: how it is known}``), read within a deadline.

    Raises:
        HealFailed: the op failed, missed the deadline, or a member died.
    """
    work = _op(what, start)
    while True:
        if deadline.passed():
            raise HealFailed(f"the deadline passed before {what}")
        try:
            work.wait(timeout=timedelta(seconds=max(min(LOOK_EVERY_S, deadline.left()), 0.001)))
            return
        except Exception:  # noqa: BLE001 - gloo's errors are RuntimeErrors of many kinds; a timeout is one
            if work.is_completed():  # its own outcome: an error, or a success just after the timeout
                try:
                    work.wait()
                except Exception as exc:  # gloo's errors are RuntimeErrors of many kinds
                    raise HealFailed(f"{what} failed: {type(exc).__name__}: {exc}") from exc
                return
        _give_up_if_dead(dead, deadline, what)


def _header(snap: Snapshot) -> tuple[torch.Tensor, torch.Tensor]:
    raw = snap.manifest.model_dump_json().encode()
    return torch.tensor([len(raw)], dtype=torch.int64), torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _answer(dst: int, group: Any, deadline: Deadline, dead: Dead | None = None) -> bool:
    """The receiver's answer to this rank's manifest: True to send the payload."""
    answer = torch.zeros(1, dtype=torch.int64)
    receiving = partial(dist.irecv, answer, dst, group=group)
    _run(f"rank {dst}'s answer to the snapshot's manifest", receiving, deadline, dead)
    return int(answer.item()) == 1


def send(snap: Snapshot, dst: int, group: Any, deadline: Deadline) -> None:
    """Sends ``snap`` to ``dst`` of ``group`` (which calls :func:`receive`).

    Raises:
        SnapshotRefused: the receiver refused the manifest (no payload was sent).
        HealFailed: a part failed or missed the deadline.
    """
    length, raw = _header(snap)
    _run(f"the snapshot's length to rank {dst}", partial(dist.isend, length, dst, group=group), deadline)
    _run(f"the snapshot's manifest to rank {dst}", partial(dist.isend, raw, dst, group=group), deadline)
    if not _answer(dst, group, deadline):
        raise SnapshotRefused(f"rank {dst} refused the snapshot of step {snap.step}")
    _run(
        f"the snapshot's {snap.payload.numel()} bytes to rank {dst}",
        partial(dist.isend, snap.payload, dst, group=group),
        deadline,
    )


def receive(src: int, group: Any, deadline: Deadline, admit: Admit, reuse: torch.Tensor | None = None) -> Snapshot:
    """Receives a snapshot from ``src`` of ``group`` (which calls :func:`send`), admitted before
    its payload is allocated and checked against its digest once it is here.

    Args:
        src: the sender's rank in ``group``.
        group: the process group.
        deadline: for the whole transfer.
        admit: says why the manifest cannot be taken here (:func:`at_most`,
            :func:`~ncclguard.recovery.snapshots.packing.admit_fresh`, ...), or None.
        reuse: a buffer to receive the payload into when its size fits.

    Raises:
        SnapshotRefused: the manifest was refused (the sender was told; no payload came).
        HealFailed: a part failed or missed the deadline, the manifest cannot be read, or the
            bytes do not match their digest.
    """
    length = torch.zeros(1, dtype=torch.int64)
    _run(f"the snapshot's length from rank {src}", partial(dist.irecv, length, src, group=group), deadline)
    n = int(length.item())
    if not 0 < n <= MAX_MANIFEST_BYTES:
        raise HealFailed(f"rank {src} announced a manifest of {n} bytes (bound {MAX_MANIFEST_BYTES})")
    raw = torch.empty(n, dtype=torch.uint8)
    _run(f"the snapshot's manifest from rank {src}", partial(dist.irecv, raw, src, group=group), deadline)
    try:
        manifest: Manifest | None = read_manifest(bytes(raw.numpy()), f"the snapshot manifest from rank {src}")
        assert manifest is not None
        refusal = admit(manifest)
    except HealFailed as exc:
        manifest, refusal = None, str(exc)
    answer = torch.tensor([0 if refusal is not None else 1], dtype=torch.int64)
    _run(f"the answer to rank {src}'s manifest", partial(dist.isend, answer, src, group=group), deadline)
    if refusal is not None or manifest is None:
        raise SnapshotRefused(f"rank {src}'s snapshot is refused: {refusal}")
    payload = (
        reuse
        if reuse is not None and reuse.numel() == manifest.nbytes
        else torch.empty(manifest.nbytes, dtype=torch.uint8)
    )
    _run(
        f"the snapshot's {manifest.nbytes} bytes from rank {src}",
        partial(dist.irecv, payload, src, group=group),
        deadline,
    )
    if digest(payload) != manifest.digest:
        raise SnapshotDamaged(
            f"rank {src}'s snapshot of step {manifest.step} arrived damaged: its {manifest.nbytes} bytes do not "
            "match their digest"
        )
    return Snapshot(manifest, payload)


def swap(
    snap: Snapshot,
    dst: int,
    srcs: list[int],
    group: Any,
    deadline: Deadline,
    admit: Admit,
    reuse: dict[int, torch.Tensor],
    dead: Dead | None = None,
) -> dict[int, Snapshot]:
    """Sends ``snap`` to ``dst`` and receives one from each of ``srcs``, all at once (every rank of
    the group calls it). No wait can close a cycle: each rank posts its manifest first, answers the
    manifests it receives before it waits for its own answer, and posts its payload before it
    receives the others' (gloo's sends complete into the peer's buffers whatever the order).

    Args:
        dead: the members known dead: every wait gives up as soon as it names one (a sender that
            died mid-take leaves its receiver waiting on it up to the deadline otherwise).

    Returns:
        The snapshots received (admitted, their digests checked), by sender.

    Raises:
        HealFailed: a transfer failed, was refused, missed the deadline, or a member died.
    """
    length, raw = _header(snap)
    works = [
        _op(f"the snapshot's length to rank {dst}", partial(dist.isend, length, dst, group=group)),
        _op(f"the snapshot's manifest to rank {dst}", partial(dist.isend, raw, dst, group=group)),
    ]
    manifests: dict[int, Manifest] = {}
    refused: list[str] = []
    for src in srcs:
        n = torch.zeros(1, dtype=torch.int64)
        _run(f"the snapshot's length from rank {src}", partial(dist.irecv, n, src, group=group), deadline, dead)
        if not 0 < int(n.item()) <= MAX_MANIFEST_BYTES:
            raise HealFailed(f"rank {src} announced a manifest of {int(n.item())} bytes (bound {MAX_MANIFEST_BYTES})")
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        _run(f"the snapshot's manifest from rank {src}", partial(dist.irecv, buf, src, group=group), deadline, dead)
        try:
            m = read_manifest(bytes(buf.numpy()), f"the snapshot manifest from rank {src}")
            refusal = admit(m)
        except HealFailed as exc:
            refusal = str(exc)
        if refusal is None:
            manifests[src] = m
        else:
            refused.append(f"rank {src}'s: {refusal}")
        answer = torch.tensor([0 if refusal is not None else 1], dtype=torch.int64)
        works.append(_op(f"the answer to rank {src}'s manifest", partial(dist.isend, answer, src, group=group)))
    if _answer(dst, group, deadline, dead):
        works.append(_op(f"the snapshot's bytes to rank {dst}", partial(dist.isend, snap.payload, dst, group=group)))
    else:
        refused.append(f"rank {dst} refused this rank's")
    got: dict[int, Snapshot] = {}
    for src, m in manifests.items():
        spare = reuse.get(src)
        payload = spare if spare is not None and spare.numel() == m.nbytes else torch.empty(m.nbytes, dtype=torch.uint8)
        receiving = partial(dist.irecv, payload, src, group=group)
        _run(f"the snapshot's {m.nbytes} bytes from rank {src}", receiving, deadline, dead)
        if digest(payload) != m.digest:
            refused.append(f"rank {src}'s arrived damaged (its bytes do not match their digest)")
        else:
            got[src] = Snapshot(m, payload)
    _wait(works, deadline, f"the snapshot's sends to rank {dst}", dead)
    if refused:
        raise SnapshotRefused("the snapshots' swap was refused: " + "; ".join(refused))
    return got
