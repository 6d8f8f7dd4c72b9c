"""Snapshot host buffers: exactly the size asked for, and on a GPU pinned in place, never taken from
torch's caching host allocator (which rounds up and keeps freed blocks; issue 59).

The CUDA tests skip without a GPU; ``benchmarks/gpu_session.sh`` runs them when one is lent.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ncclguard.recovery.snapshots import host_memory
from ncclguard.recovery.snapshots.host_memory import host_buffer, is_registered
from ncclguard.recovery.snapshots.packing import pack, unpack
from ncclguard.recovery.snapshots.state import OwnState

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_session.sh)")


def test_a_host_buffer_has_exactly_the_size_asked_and_a_negative_size_is_refused() -> None:
    for n in (0, 1, 4097, 3 * 2**20 + 5):
        buf = host_buffer(n, pinned=False)
        assert (buf.numel(), buf.dtype, buf.device.type, is_registered(buf)) == (n, torch.uint8, "cpu", False)
    with pytest.raises(ValueError, match="-1 bytes: the size must be >= 0"):
        host_buffer(-1, pinned=False)


def test_a_cpu_state_is_packed_into_a_plain_buffer_of_its_manifests_size() -> None:
    state = OwnState(tensors={"w": torch.randn(1000, 3), "b": torch.randn(7, dtype=torch.float64)})
    snap = pack(state, step=2, rank=0)
    assert (
        snap.payload.numel() == snap.manifest.nbytes == 12096
    )  # 12,000 bytes to 12,032 (64-byte aligned), 56 more to 64
    assert not is_registered(snap.payload) and not snap.payload.is_pinned()
    assert all(torch.equal(a, b) for a, b in zip(state.tensors.values(), unpack(snap).tensors.values(), strict=True))


def _held() -> int:
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0))


@cuda
def test_a_gpu_state_is_packed_into_a_buffer_pinned_in_place_and_unpinned_when_dropped() -> None:
    state = OwnState(tensors={"w": torch.randn(3_000_001, device="cuda"), "b": torch.randn(5, device="cuda")})
    before = _held()
    snap = pack(state, step=1, rank=0)
    ptr = snap.payload.data_ptr()
    assert is_registered(snap.payload) and snap.payload.is_pinned()
    assert snap.payload.numel() == snap.manifest.nbytes  # not rounded up to a power of two
    assert _held() == before  # nothing taken from the caching host allocator
    back = unpack(snap)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(state.tensors.values(), back.tensors.values(), strict=True))
    del snap, back
    gc.collect()
    assert ptr not in host_memory._REGISTERED


@cuda
def test_four_takes_each_dropping_the_one_before_hold_one_payload_of_pinned_memory() -> None:
    state = OwnState(tensors={"w": torch.randn(25_000_000, device="cuda")})  # 100 MB
    before = _held()
    kept = None
    for step in range(4):
        kept = pack(state, step=step, rank=0)  # the take before is dropped: snapshot_keep=1
        gc.collect()
    assert kept is not None and is_registered(kept.payload)
    assert len(host_memory._REGISTERED) == 1
    assert _held() == before
