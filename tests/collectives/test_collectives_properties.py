"""Property-based tests (hypothesis): chunk boundaries, ``logical_views``, and equality of
``safe_all_reduce`` with ``dist.all_reduce`` over random shapes, strides, dtypes and ops.

The pure parts run hypothesis here. The equality needs real ranks: one torchrun launch runs
``tests/workers/sweep_worker.py``, where every rank draws the same cases from hypothesis
(derandomized, generate phase only, no database), checks that they drew the same ones, then runs
them all (see that file).
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from sweep_worker import MAX_EXAMPLES, view_of

from ncclguard.collectives.chunking import chunk_bounds, chunk_count, logical_views
from ncclguard.config import Config


@st.composite
def policies(draw: st.DrawFn) -> Config:
    """A valid chunk policy, small enough that tiny tensors cross every tier."""
    direct = draw(st.integers(1, 2_000))
    large_from = draw(st.integers(direct, 10_000))
    mid_lo = draw(st.integers(1, 6))
    large_lo = draw(st.integers(1, 25))
    return Config(
        chunk_direct_below=direct,
        chunk_large_from=large_from,
        mid_chunks=(mid_lo, draw(st.integers(mid_lo, 8))),
        mid_chunk_numel=draw(st.integers(1, 3_000)),
        large_chunks=(large_lo, draw(st.integers(large_lo, 30))),
        large_chunk_numel=draw(st.integers(1, 3_000)),
    )


def _check_bounds(bounds: list[tuple[int, int]], numel: int) -> None:
    if numel == 0:
        assert bounds == [(0, 0)]
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False):
        assert b == c  # contiguous, no gap, no overlap
    assert all(b > a for a, b in bounds)  # no empty chunk


@settings(max_examples=400, deadline=None)
@given(numel=st.integers(0, 50_000), policy=policies())
def test_policy_chunks_cover_every_element_once_within_the_tier_limits(numel, policy):
    bounds = chunk_bounds(numel, None, policy)
    _check_bounds(bounds, numel)
    if numel == 0:
        return
    n = chunk_count(numel, policy)
    assert len(bounds) <= n and len(bounds) >= math.ceil(n / 2)  # ceil-sized chunks may need fewer
    if numel < policy.chunk_direct_below:
        assert bounds == [(0, numel)]
    else:
        lo, hi = policy.mid_chunks if numel <= policy.chunk_large_from else policy.large_chunks
        assert n <= hi and (n >= lo or n == numel)  # the tier's range, unless there are fewer elements
    # Chunks differ in size by at most one chunk's rounding: only the last may be shorter.
    sizes = [b - a for a, b in bounds]
    assert all(s == sizes[0] for s in sizes[:-1]) and sizes[-1] <= sizes[0]


@settings(max_examples=400, deadline=None)
@given(numel=st.integers(0, 100_000), chunk=st.integers(1, 120_000))
def test_explicit_chunk_numel_gives_ceil_chunks_of_that_size(numel, chunk):
    bounds = chunk_bounds(numel, chunk)
    _check_bounds(bounds, numel)
    if numel:
        assert len(bounds) == math.ceil(numel / chunk)
        assert all(b - a == chunk for a, b in bounds[:-1]) and 0 < bounds[-1][1] - bounds[-1][0] <= chunk


@st.composite
def strided(draw: st.DrawFn) -> torch.Tensor:
    """A view with arbitrary strides: permuted, stepped, narrowed, 0-d or empty included."""
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    ops = draw(st.lists(st.integers(0, 10_000), max_size=4))
    base = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    return view_of(base, ops)


@settings(max_examples=500, deadline=None)
@given(t=strided(), data=st.data())
def test_logical_views_are_the_row_major_range_and_alias_the_tensor(t, data):
    n = t.numel()
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    views = list(logical_views(t, a, b))
    got = torch.cat([v.reshape(-1) for v in views]) if views else torch.empty(0, dtype=t.dtype)
    assert torch.equal(got, t.reshape(-1)[a:b])
    if n:
        for v in views:  # views, never copies: writes land in t
            assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    # Writing through the views changes exactly elements [a, b) of t.
    before = t.clone()
    for v in views:
        v.add_(1000)
    changed = (t.reshape(-1) != before.reshape(-1)).nonzero().flatten().tolist()
    assert changed == list(range(a, b))


@pytest.fixture(scope="module")
def sweep():
    return run_ranks("sweep_worker", 2, timeout_s=240)


@pytest.mark.multirank
def test_safe_all_reduce_equals_dist_all_reduce_on_random_cases(sweep):
    for r in (0, 1):
        s = sweep[r]
        assert s["cases"] == MAX_EXAMPLES and s["same_cases_on_every_rank"] is True
        assert s["mismatches"] == []
        assert s["failed_calls"] == []
    # The cases reached what they are for: every dtype and op, strided and chunked ones, atomic.
    seen = sweep[0]["seen"]
    assert set(seen["dtype"]) >= {
        "bool",
        "uint8",
        "int8",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    }
    assert set(seen["op"]) >= {"SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"}
    assert seen["non_contiguous"] > 60 and seen["chunked"] > 40 and seen["atomic"] > 100 and seen["empty_or_0d"] > 10
