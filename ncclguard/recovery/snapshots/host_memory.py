"""Host buffers for snapshots, of exactly the size asked for, pinned in place where a GPU copies.

A GPU's state is copied into pinned host memory (a copy from a GPU into pageable memory is
synchronous and slower). ``torch.empty(n, pin_memory=True)`` takes that memory from torch's caching
host allocator, which rounds each block up to a power of two and keeps a freed block for reuse:
four takes of a 1.61 GB payload, each dropping the one before, left its counters at 4.29 GB
allocated and 8.59 GB active, and the process's resident memory at 4.94 GB, on an H200
(``benchmarks/pinned_hold.py``, ``benchmarks/results/pinned_hold_h200.json``). A plain buffer of
exactly ``n`` bytes, page-locked in place with ``cudaHostRegister`` and unlocked when it is dropped,
held 2.26 GB resident for the same takes and copied at the same rate (55.2 against 55.1 GB/s). So
the memory the snapshot line logs and ``snapshot_max_bytes`` caps is the memory held.

Where registering fails (a locked-memory limit, ``ulimit -l``), the buffer comes from the caching
allocator as before, and that is logged once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ncclguard._log import log

__all__ = ["host_buffer", "is_registered"]

# data_ptr of each buffer this module registered and has not unregistered yet.
_REGISTERED: set[int] = set()
_FELL_BACK: list[bool] = []  # not empty once a failed registration was logged (once a process)


def is_registered(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is a host buffer :func:`host_buffer` page-locked in place (and still is)."""
    return buffer.data_ptr() in _REGISTERED


def _unregister(cudart: Any, ptr: int) -> None:
    _REGISTERED.discard(ptr)
    # The memory is still allocated here: a tensor's weak references are cleared before its storage
    # is released. An error (the CUDA context already gone at exit) leaves nothing to undo.
    cudart.cudaHostUnregister(ptr)


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A flat ``uint8`` host tensor of exactly ``nbytes`` bytes.

    Args:
        nbytes: its size in bytes (>= 0).
        pinned: page-lock it for a GPU's copies (``cudaHostRegister``; the caching host allocator's
            ``pin_memory=True`` where that fails).

    Returns:
        The tensor; a pinned one is unlocked when it is garbage-collected.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"a host buffer of {nbytes} bytes: the size must be >= 0")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned or nbytes == 0:
        return buffer
    cudart = torch.cuda.cudart()
    ptr = buffer.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        if not _FELL_BACK:
            _FELL_BACK.append(True)
            log.warning(
                "snapshot buffers: cudaHostRegister of %d bytes returned error %d (a locked-memory limit? "
                "`ulimit -l`); they come from torch's caching host allocator instead, which rounds each up to a "
                "power of two and keeps freed ones: the host memory held can be up to twice the snapshot line's",
                nbytes, err,
            )  # fmt: skip
        del buffer  # freed before its replacement is allocated: never both held at once
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    _REGISTERED.add(ptr)
    weakref.finalize(buffer, _unregister, cudart, ptr)
    return buffer
