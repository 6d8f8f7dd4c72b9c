"""A snapshot as it is held and sent: a JSON manifest and one flat byte buffer.

:func:`pack` copies an :class:`~ncclguard.recovery.snapshots.state.OwnState`'s tensors into one
contiguous ``uint8`` tensor in host memory (reusing the buffer of the snapshot it replaces) and
describes them in a :class:`Manifest`: each tensor's name, dtype, shape and offset, the state's JSON
``meta``, the step, and a BLAKE2b digest of the bytes. The same two things go to the buddy rank;
:func:`unpack` checks the digest and the manifest's own consistency before it gives the tensors
back as views of the buffer. Nothing is pickled: the manifest is JSON read into this pydantic model
with a size bound (:func:`ncclguard.store.codec.decode`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ncclguard.errors import HealFailed
from ncclguard.recovery.snapshots.state import OwnState
from ncclguard.store.codec import DecodeError, decode

__all__ = ["MAX_MANIFEST_BYTES", "Entry", "Manifest", "Snapshot", "pack", "read_manifest", "unpack"]

MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~150 bytes an entry: room for ~400k tensors
ALIGN = 64  # every tensor starts on a 64-byte boundary, so a view of any dtype is aligned


class Entry(BaseModel):
    """One tensor of a snapshot: its name, what it is, and where its bytes lie in the buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(max_length=4096)
    dtype: str = Field(max_length=64)
    shape: list[int] = Field(max_length=64)
    offset: int = Field(ge=0)


class Manifest(BaseModel):
    """Everything about a snapshot but its bytes.

    Attributes:
        step: the step the state was taken at (the state is as that step found it).
        rank: the rank whose state it is, in the world it was taken in.
        entries: the tensors, in order.
        meta: the state's JSON part.
        nbytes: the buffer's length.
        digest: BLAKE2b (16 bytes, hex) of the buffer.
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


def digest(payload: torch.Tensor) -> str:
    """The BLAKE2b digest (hex) of a flat ``uint8`` CPU tensor's bytes."""
    return hashlib.blake2b(payload.numpy().data, digest_size=16).hexdigest()


def pack(state: OwnState, step: int, rank: int, reuse: torch.Tensor | None = None) -> Snapshot:
    """Copies ``state`` into one host buffer (``reuse``'s when its size fits) and describes it.

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
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    payload = reuse if reuse is not None and reuse.numel() == offset else torch.empty(offset, dtype=torch.uint8)
    for e, t in zip(entries, state.tensors.values(), strict=True):
        n = t.numel() * t.element_size()
        if n:
            payload[e.offset : e.offset + n].copy_(t.detach().reshape(-1).cpu().view(torch.uint8))
    manifest = Manifest(step=step, rank=rank, entries=entries, meta=state.meta, nbytes=offset, digest=digest(payload))
    return Snapshot(manifest, payload)


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
        raise HealFailed(
            f"the snapshot of rank {m.rank} at step {m.step} is damaged: its {snap.payload.numel()} bytes do not "
            f"match the digest of the {m.nbytes} taken"
        )
    tensors: dict[str, torch.Tensor] = {}
    for e in m.entries:
        try:
            n = _size(e.dtype, e.shape)
        except ValueError as exc:
            raise HealFailed(f"the snapshot's entry {e.name}: {exc}") from exc
        if e.offset + n > m.nbytes:
            raise HealFailed(f"the snapshot's entry {e.name} lies outside its {m.nbytes} bytes")
        piece = snap.payload[e.offset : e.offset + n]
        tensors[e.name] = (
            piece.view(_dtype(e.dtype)).reshape(e.shape) if n else torch.empty(e.shape, dtype=_dtype(e.dtype))
        )
    return OwnState(tensors, m.meta if isinstance(m.meta, dict) else {})
