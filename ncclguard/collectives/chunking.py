"""How a tensor is cut into chunks for the wire, and how a chunk maps back onto any tensor layout.

Chunk boundaries depend only on the element count and the policy, never on strides, so ranks
whose tensors differ in layout still issue identical sequences of collectives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ncclguard.config import Config, get_config

__all__ = ["chunk_count", "chunk_bounds", "logical_views"]


def chunk_count(numel: int, config: Config | None = None) -> int:
    """Number of chunks the default policy uses for ``numel`` elements.

    Under ``chunk_direct_below`` one call; up to ``chunk_large_from`` between ``mid_chunks``
    (2 to 5 by default) chunks of about ``mid_chunk_numel``; above it between ``large_chunks``
    (10 to 20) chunks of about ``large_chunk_numel``.
    """
    c = config or get_config()
    if numel < c.chunk_direct_below:
        return 1
    if numel <= c.chunk_large_from:
        lo, hi = c.mid_chunks
        want = math.ceil(numel / c.mid_chunk_numel)
    else:
        lo, hi = c.large_chunks
        want = math.ceil(numel / c.large_chunk_numel)
    return max(1, min(numel, max(lo, min(hi, want))))


def chunk_bounds(numel: int, chunk_numel: int | None = None, config: Config | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of each chunk, in order.

    Args:
        numel: elements of the tensor.
        chunk_numel: elements per chunk (the last may be shorter); None for the policy.
        config: the policy; default the configuration in force.
    """
    if numel == 0:
        return [(0, 0)]
    if chunk_numel is None:
        n = chunk_count(numel, config)
        chunk_numel = math.ceil(numel / n)
    return [(a, min(a + chunk_numel, numel)) for a in range(0, numel, chunk_numel)]


def logical_views(t: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that together hold its elements ``[start, stop)`` in row-major order.

    Works for any strides without copying: whole runs of rows become one view, partial rows
    recurse into the next dimension. Used to stage a chunk of a non-contiguous tensor through a
    small contiguous buffer.
    """
    if start >= stop:
        return
    if t.dim() == 0:
        yield t
        return
    if t.is_contiguous():
        yield t.view(-1)[start:stop]
        return
    row = t[0].numel() if t.shape[0] else 0
    first, last = start // row, (stop - 1) // row
    if start % row == 0 and stop % row == 0:
        yield t[first : last + 1]
        return
    if first == last:
        yield from logical_views(t[first], start - first * row, stop - first * row)
        return
    yield from logical_views(t[first], start - first * row, row)
    if last > first + 1:
        yield t[first + 1 : last]
    yield from logical_views(t[last], 0, stop - last * row)
