"""Moving snapshots between ranks: a manifest's length, its JSON, then the bytes, point to point.

Every transfer is three sends (an int64 length, the manifest's bytes, the payload) matched by three
receives, each waited on with what is left of one deadline. The receiver bounds the manifest's
length before it allocates, reads the manifest as JSON into its pydantic model, and allocates the
payload from the manifest's ``nbytes``, which it checks against its own bound: a peer can make it
neither unpickle nor allocate without limit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.errors import HealFailed
from ncclguard.recovery.snapshots.packing import MAX_MANIFEST_BYTES, Snapshot, read_manifest

__all__ = ["receive", "send", "swap"]


def _wait(works: list[Any], deadline: Deadline, what: str) -> None:
    for work in works:
        if deadline.passed():
            raise HealFailed(f"the deadline passed before {what}")
        try:
            work.wait(timeout=deadline.as_timedelta())
        except Exception as exc:  # gloo's errors are RuntimeErrors of many kinds
            raise HealFailed(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _header(snap: Snapshot) -> tuple[torch.Tensor, torch.Tensor]:
    raw = snap.manifest.model_dump_json().encode()
    return torch.tensor([len(raw)], dtype=torch.int64), torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def send(snap: Snapshot, dst: int, group: Any, deadline: Deadline) -> None:
    """Sends ``snap`` to ``dst`` of ``group`` (which calls :func:`receive`)."""
    length, raw = _header(snap)
    _wait([dist.isend(length, dst, group=group)], deadline, f"the snapshot's length to rank {dst}")
    _wait([dist.isend(raw, dst, group=group)], deadline, f"the snapshot's manifest to rank {dst}")
    _wait(
        [dist.isend(snap.payload, dst, group=group)],
        deadline,
        f"the snapshot's {snap.payload.numel()} bytes to rank {dst}",
    )


def receive(src: int, group: Any, deadline: Deadline, max_bytes: int, reuse: torch.Tensor | None = None) -> Snapshot:
    """Receives a snapshot from ``src`` of ``group`` (which calls :func:`send`).

    Args:
        src: the sender's rank in ``group``.
        group: the process group.
        deadline: for the whole transfer.
        max_bytes: the payload this rank accepts at most.
        reuse: a buffer to receive the payload into when its size fits.

    Raises:
        HealFailed: a part failed or missed the deadline, or the sender announced too much.
    """
    length = torch.zeros(1, dtype=torch.int64)
    _wait([dist.irecv(length, src, group=group)], deadline, f"the snapshot's length from rank {src}")
    n = int(length.item())
    if not 0 < n <= MAX_MANIFEST_BYTES:
        raise HealFailed(f"rank {src} announced a manifest of {n} bytes (bound {MAX_MANIFEST_BYTES})")
    raw = torch.empty(n, dtype=torch.uint8)
    _wait([dist.irecv(raw, src, group=group)], deadline, f"the snapshot's manifest from rank {src}")
    manifest = read_manifest(bytes(raw.numpy()), f"the snapshot manifest from rank {src}")
    if manifest.nbytes > max_bytes:
        raise HealFailed(
            f"rank {src} would send a snapshot of {manifest.nbytes} bytes, over this rank's bound of {max_bytes}"
        )
    payload = (
        reuse
        if reuse is not None and reuse.numel() == manifest.nbytes
        else torch.empty(manifest.nbytes, dtype=torch.uint8)
    )
    _wait([dist.irecv(payload, src, group=group)], deadline, f"the snapshot's {manifest.nbytes} bytes from rank {src}")
    return Snapshot(manifest, payload)


def swap(
    snap: Snapshot,
    dst: int,
    srcs: list[int],
    group: Any,
    deadline: Deadline,
    max_bytes: int,
    reuse: dict[int, torch.Tensor],
) -> dict[int, Snapshot]:
    """Sends ``snap`` to ``dst`` and receives one from each of ``srcs``, all at once (every rank of
    the group calls it; posting the sends first and receiving in rank order cannot deadlock: gloo's
    sends complete into the peer's buffers whatever the order of the receives).

    Returns:
        The snapshots received, by sender.
    """
    length, raw = _header(snap)
    works = [
        dist.isend(length, dst, group=group),
        dist.isend(raw, dst, group=group),
        dist.isend(snap.payload, dst, group=group),
    ]
    got = {src: receive(src, group, deadline, max_bytes, reuse.get(src)) for src in srcs}
    _wait(works, deadline, f"the snapshot's sends to rank {dst}")
    return got
