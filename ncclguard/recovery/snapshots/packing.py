"""A snapshot as it is held and sent: a JSON manifest and one flat byte buffer.

:func:`pack` copies an :class:`~ncclguard.recovery.snapshots.state.OwnState`'s tensors into one
contiguous ``uint8`` tensor in host memory (reusing the buffer of the snapshot it replaces) and
describes them in a :class:`Manifest`: each tensor's name, dtype, shape and offset, the state's JSON
``meta``, the step, and a digest of the bytes. The same two things go to the buddy rank;
:func:`unpack` checks the digest and the manifest's own consistency before it gives the tensors
back as views of the buffer. Nothing is pickled: the manifest is JSON read into this pydantic model
with a size bound (:func:`ncclguard.store.codec.decode`).

The digest is an XXH3 (64-bit) of each 16 MiB piece, computed by a small thread pool, folded
into one BLAKE2b: it catches damaged bytes, not a forger (the peers are the job's own ranks), at
about the speed of a copy (one BLAKE2b over every byte ran at 3.5 GiB/s on one core here, a CRC-32
at 7.9, against a 10-35 GiB/s copy: the digest cost more than the copy it checks).

A peer's manifest is admitted before a byte of its payload is allocated (:func:`admit_peer`,
:func:`admit_fresh`): its entries must lie inside its buffer, in order, and match what this rank
holds (names, dtypes, shapes), so a bound comes from the shape of the state, never from a guess.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from ncclguard.errors import HealFailed, SnapshotDamaged
from ncclguard.recovery.snapshots.host_memory import host_buffer
from ncclguard.recovery.snapshots.state import OwnState
from ncclguard.store.codec import DecodeError, decode

__all__ = [
    "MAX_MANIFEST_BYTES",
    "Entry",
    "Manifest",
    "Snapshot",
    "admit_fresh",
    "admit_peer",
    "consistent",
    "digest",
    "pack",
    "read_manifest",
    "unpack",
]

MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~150 bytes an entry: room for ~400k tensors
ALIGN = 64  # every tensor starts on a 64-byte boundary, so a view of any dtype is aligned
PIECE = 16 << 20  # the digest's piece: large enough that a thread's start costs nothing beside it
SMALL_ENTRY = 1 << 20  # an entry the reference lacks may hold this much whatever the reference's sizes
_POOL: list[ThreadPoolExecutor] = []  # made on first use; a pool, not per-world state


class Entry(BaseModel):
    """One tensor of a snapshot: its name, what it is, and where its bytes lie in the buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(max_length=4096)
    dtype: str = Field(max_length=64)
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=64)
    offset: int = Field(ge=0)


class Manifest(BaseModel):
    """Everything about a snapshot but its bytes.

    Attributes:
        step: the step the state was taken at (the state is as that step found it).
        rank: the rank whose state it is, in the world it was taken in.
        entries: the tensors, in order.
        meta: the state's JSON part.
        nbytes: the buffer's length.
        digest: the buffer's digest (:func:`digest`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    entries: list[Entry] = Field(default_factory=list)
    meta: Any = None
    nbytes: int = Field(ge=0)
    digest: str = Field(max_length=64)


@dataclass
class Snapshot:
    """A manifest and its bytes (host memory)."""

    manifest: Manifest
    payload: torch.Tensor  # uint8, flat

    @property
    def step(self) -> int:
        """The step the state was taken at."""
        return self.manifest.step


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return found


def _size(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * _dtype(dtype).itemsize


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="ncclguard-digest"))
    return _POOL[0]


class _Pieces:
    """The digest of a buffer computed piece by piece as its bytes are written: each 16 MiB piece
    goes to the pool once every byte of it is there, so hashing overlaps the copies still running."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.data = memoryview(payload.numpy().data).cast("B")
        self.done = 0  # bytes handed to the pool
        self.sums: list[Future[int]] = []

    def ready(self, upto: int) -> None:
        """Bytes ``[0, upto)`` are written: hashes every whole piece among them not yet handed out."""
        n = len(self.data)
        while self.done < n and (self.done + PIECE <= upto or upto >= n):
            piece = self.data[self.done : self.done + PIECE]
            self.sums.append(_pool().submit(xxhash.xxh3_64_intdigest, piece))
            self.done += len(piece)

    def finish(self) -> str:
        """The digest (every byte written by now)."""
        self.ready(len(self.data))
        sums = [f.result() for f in self.sums] or [xxhash.xxh3_64_intdigest(self.data)]
        folded = hashlib.blake2b(len(self.data).to_bytes(8, "little"), digest_size=16)
        for piece_sum in sums:
            folded.update(piece_sum.to_bytes(8, "little"))
        return folded.hexdigest()


def digest(payload: torch.Tensor) -> str:
    """The digest (hex) of a flat ``uint8`` CPU tensor's bytes: an XXH3 of each 16 MiB piece,
    computed in parallel, folded into a 16-byte BLAKE2b (see the module doc)."""
    return _Pieces(payload).finish()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(state: OwnState, step: int, rank: int, reuse: torch.Tensor | None = None) -> Snapshot:
    """Copies ``state`` into one host buffer (``reuse``'s when its size fits) and describes it.

    Tensors on a GPU are copied into pinned host memory on a side CUDA stream, all issued at once,
    so the copies follow each other at the host link's limit, and each piece of the buffer is
    hashed as soon as the copies that fill it are done: the digest overlaps the copy (on one H200,
    a take went from 2.2-2.5x to 1.4-1.6x a plain copy). Tensors in host memory are copied first
    and hashed after: there the copy runs on torch's own threads, and hashing beside it slowed the
    take (2.9x a plain copy with spares on 16 cores; 4.5x overlapped).

    Args:
        state: the live state (its tensors are copied, not kept).
        step: the step it is taken at.
        rank: this rank.
        reuse: the buffer of a snapshot this one replaces.

    Returns:
        The :class:`Snapshot`.
    """
    entries, offset = [], 0
    for name, t in state.tensors.items():
        entries.append(Entry(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset))
        offset += _aligned(t.numel() * t.element_size())
    cuda = any(t.is_cuda for t in state.tensors.values())
    if reuse is not None and reuse.numel() == offset:
        payload = reuse
    else:  # pinned where a GPU sends: a pageable copy from a GPU is synchronous and slower
        payload = host_buffer(offset, pinned=cuda)
    pieces = _Pieces(payload)
    stream = torch.cuda.Stream() if cuda else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # the step's work on these tensors comes first
    copied: list[tuple[int, Any]] = []  # (where the copy ends, its CUDA event or None)
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        for e, t in zip(entries, state.tensors.values(), strict=True):
            n = t.numel() * t.element_size()
            if n:
                src = t.detach().reshape(-1).view(torch.uint8)
                payload[e.offset : e.offset + n].copy_(src, non_blocking=src.is_cuda)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                copied.append((e.offset + _aligned(n), event))
    for end, event in copied:  # a GPU's copies run on while the first pieces are hashed
        event.synchronize()
        pieces.ready(end)
    manifest = Manifest(step=step, rank=rank, entries=entries, meta=state.meta, nbytes=offset, digest=pieces.finish())
    return Snapshot(manifest, payload)


class _nothing:
    """A context that does nothing (``contextlib.nullcontext`` without its generic type)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def consistent(m: Manifest) -> str | None:
    """Why a manifest cannot describe its own buffer (an entry outside it, entries out of order or
    overlapping, a length that is not theirs, an unknown dtype), or None."""
    end = 0
    for e in m.entries:
        try:
            n = _size(e.dtype, e.shape)
        except ValueError as exc:
            return f"the entry {e.name[:80]}: {exc}"
        if e.offset != end:
            return f"the entry {e.name[:80]} starts at {e.offset}, not at {end} where the one before ends"
        end = e.offset + _aligned(n)
    if end != m.nbytes:
        return f"its entries take {end} bytes, not the {m.nbytes} it declares"
    return None


def _whole_sizes(mine: Manifest) -> tuple[dict[str, int], int]:
    """The whole (global) byte size of each sharded tensor this rank's own state declares (FSDP2's
    DTensors: ``meta["module"][name]["global"]``), and the largest: bounds that come from the
    model's own shapes here, never from the peer's claim."""
    declared = mine.meta.get("module") if isinstance(mine.meta, dict) else None
    out: dict[str, int] = {}
    for name, d in (declared or {}).items():
        shape = d.get("global") if isinstance(d, dict) else None
        if isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape):
            try:
                out[name] = _size(str(d.get("dtype")), shape)
            except ValueError:
                continue
    return out, max(out.values(), default=0)


def admit_peer(m: Manifest, mine: Manifest, world_size: int) -> str | None:
    """Why a buddy's replica cannot be held here, or None: it must be consistent, name the tensors
    this rank's own snapshot names, with their dtypes, and none may be larger than the whole tensor
    it can be a shard of: ``world_size`` times this rank's shard, or 1 MiB, or, for a sharded
    parameter, the whole size its global shape here declares (a shard here may be empty: FSDP2
    gives a rank none of a tensor whose first dimension is smaller than the world), and for an
    optimizer's tensor the largest such whole size (its moments are shaped as a parameter).

    Args:
        m: the peer's manifest.
        mine: this rank's own snapshot of the same step.
        world_size: ranks of the world (shards of one tensor differ by at most that factor).
    """
    problem = consistent(m)
    if problem is not None:
        return problem
    ours = {e.name: e for e in mine.entries}
    if [e.name for e in m.entries] != list(ours):
        extra = sorted({e.name for e in m.entries} - set(ours))[:3]
        missing = sorted(set(ours) - {e.name for e in m.entries})[:3]
        return f"its tensors are not this rank's (only there: {extra or 'none'}; only here: {missing or 'none'})"
    whole, largest = _whole_sizes(mine)
    for e in m.entries:
        o = ours[e.name]
        if e.dtype != o.dtype:
            return f"{e.name[:80]} is {e.dtype} there and {o.dtype} here"
        bound = max(world_size * _size(o.dtype, o.shape), SMALL_ENTRY, whole.get(e.name, 0))
        if e.name.startswith("o:"):
            bound = max(bound, largest)
        if _size(e.dtype, e.shape) > bound:
            return f"{e.name[:80]} declares {e.shape}, more than a shard of a tensor whose shard here is {o.shape}"
    return None


def admit_fresh(m: Manifest, fresh: OwnState) -> str | None:
    """Why a restarted rank cannot take a replica into the state it has just built, or None.

    The restarted rank's state is whole in its shapes (its model's shards), not in its content: an
    optimizer such as Adam makes its moments at its first step. So a tensor the fresh state names
    must have its dtype and shape; one it lacks (optimizer state, generators) may be as large as its
    largest tensor (or 1 MiB), and there may be at most four for each of its tensors, plus 64.

    Args:
        m: the replica's manifest.
        fresh: this rank's own state, as its fresh model holds it (the codec's capture).
    """
    problem = consistent(m)
    if problem is not None:
        return problem
    ours = {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in fresh.tensors.items()}
    largest = max([SMALL_ENTRY] + [t.numel() * t.element_size() for t in fresh.tensors.values()])
    others = 0
    for e in m.entries:
        if e.name in ours:
            if (e.dtype, e.shape) != ours[e.name]:
                want = ours[e.name]
                return f"{e.name[:80]} is {e.dtype}{e.shape} in the replica and {want[0]}{want[1]} here"
            continue
        others += 1
        if _size(e.dtype, e.shape) > largest:
            return f"{e.name[:80]} declares {e.shape} ({e.dtype}), larger than any tensor of this rank's state"
    if others > 4 * len(ours) + 64:
        return f"it declares {others} tensors this rank's state does not name, for {len(ours)} it does"
    return None


def read_manifest(raw: bytes, what: str) -> Manifest:
    """A manifest from a peer's bytes: bounded, JSON, checked.

    Raises:
        HealFailed: it does not parse or is not a manifest.
    """
    try:
        return decode(Manifest, raw, what, MAX_MANIFEST_BYTES)
    except DecodeError as exc:
        raise HealFailed(f"{what} cannot be read: {exc}") from exc


def unpack(snap: Snapshot) -> OwnState:
    """The state a snapshot holds, its tensors views of its buffer, after checking its bytes.

    Raises:
        HealFailed: the bytes do not match the digest, or an entry lies outside the buffer.
    """
    m = snap.manifest
    if snap.payload.numel() != m.nbytes or digest(snap.payload) != m.digest:
        raise SnapshotDamaged(
            f"the snapshot of rank {m.rank} at step {m.step} is damaged: its {snap.payload.numel()} bytes do not "
            f"match the digest of the {m.nbytes} taken"
        )
    problem = consistent(m)
    if problem is not None:
        raise HealFailed(f"the snapshot of rank {m.rank} at step {m.step} cannot be read: {problem}")
    tensors: dict[str, torch.Tensor] = {}
    for e in m.entries:
        n = _size(e.dtype, e.shape)
        piece = snap.payload[e.offset : e.offset + n]
        tensors[e.name] = (
            piece.view(_dtype(e.dtype)).reshape(e.shape) if n else torch.empty(e.shape, dtype=_dtype(e.dtype))
        )
    return OwnState(tensors, m.meta if isinstance(m.meta, dict) else {})
