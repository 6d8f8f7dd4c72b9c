"""Single-process behaviour of the guarded collectives: policy, layout, configuration, world of one."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
from pydantic import ValidationError

import ncclguard
from ncclguard.collectives.chunking import chunk_bounds, chunk_count, logical_views
from ncclguard.config import Config, configure, get_config
from ncclguard.deadlines import adaptive_timeout, size_timeout, to_seconds
from ncclguard.errors import CollectiveFailed, CollectiveMismatch, CollectiveTimeout, GroupFailed


@pytest.mark.parametrize(
    "numel, chunks",
    [
        (1, 1),
        (99_999_999, 1),
        (100_000_000, 2),
        (250_000_000, 3),
        (500_000_000, 5),
        (500_000_001, 11),
        (600_000_000, 12),
        (1_000_000_000, 20),
        (4_000_000_000, 20),
    ],
)
def test_default_chunk_policy_follows_the_seeds_tiers(numel, chunks):
    assert chunk_count(numel) == chunks
    bounds = chunk_bounds(numel)
    assert len(bounds) == chunks
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_chunk_policy_is_configurable():
    configure(chunk_direct_below=10, chunk_large_from=100, mid_chunks=(3, 3), large_chunks=(7, 7))
    assert [chunk_count(n) for n in (9, 10, 100, 101)] == [1, 3, 3, 7]


def test_explicit_chunk_numel_and_empty():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0) == [(0, 0)]


def test_size_timeout_tiers_from_the_seeds():
    assert [size_timeout(n) for n in (1, 9_999_999, 10_000_000, 99_999_999, 100_000_000)] == [300, 300, 900, 900, 1800]
    assert adaptive_timeout(5, 20) == 300


def test_bandwidth_timeout_policy():
    configure(timeout_policy="bandwidth", timeout_base_s=10, min_bandwidth_gbps=2)
    assert adaptive_timeout(1, 4_000_000_000) == pytest.approx(12.0)


@pytest.mark.parametrize(
    "overrides, phrase",
    [
        ({"chunk_direct_below": 10, "chunk_large_from": 5}, "chunk_direct_below"),
        ({"mid_chunks": (5, 2)}, "mid_chunks"),
        ({"timeout_small_s": 1000, "timeout_medium_s": 900}, "tiers"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"timeout_large_s": -1}, "timeout_large_s"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_config_rejects_broken_invariants_and_keeps_the_old_one(overrides, phrase):
    before = get_config()
    with pytest.raises(ValidationError, match=phrase):
        configure(**overrides)
    assert get_config() == before


def test_config_reads_environment(monkeypatch):
    monkeypatch.setenv("NCCLGUARD_MAX_INFLIGHT", "4")
    monkeypatch.setenv("NCCLGUARD_TIMEOUT_POLICY", "bandwidth")
    c = Config()
    assert c.max_inflight == 4 and c.timeout_policy == "bandwidth"
    monkeypatch.setenv("NCCLGUARD_MAX_INFLIGHT", "-3")
    with pytest.raises(ValidationError, match="max_inflight"):
        Config()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(60.0).reshape(6, 10).t(),
        lambda: torch.arange(120.0).reshape(4, 5, 6)[:, ::2, 1:],
        lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
        lambda: torch.arange(10.0)[::3],
        lambda: torch.tensor(7.0),
    ],
)
def test_logical_views_cover_any_range_in_row_major_order(make):
    t = make()
    flat = t.reshape(-1)
    n = t.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            views = list(logical_views(t, a, b))
            got = torch.cat([v.reshape(-1) for v in views]) if views else torch.empty(0)
            assert torch.equal(got, flat[a:b]), (a, b)
            for v in views:  # views, never copies: writes land in t
                assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def test_world_of_one_without_process_group():
    t = torch.arange(5.0)
    res = ncclguard.safe_all_reduce(t, op=torch.distributed.ReduceOp.AVG, timeout=timedelta(seconds=1))
    assert res.ok and bool(res) and res.error is None and res.numel == 5 and res.nbytes == 20
    assert torch.equal(t, torch.arange(5.0))
    assert res.raise_for_error() is res
    assert bool(ncclguard.safe_barrier(timeout=1))


def test_bad_input_without_process_group():
    with pytest.raises(TypeError, match="torch.Tensor"):
        ncclguard.safe_all_reduce(3.0)
    with pytest.raises(ValueError, match="positive"):
        ncclguard.safe_all_reduce(torch.ones(1), timeout=timedelta(0))
    with pytest.raises(TypeError, match="timedelta"):
        ncclguard.safe_all_reduce(torch.ones(1), timeout="10")
    with pytest.raises(ValueError, match="positive"):
        ncclguard.safe_barrier(timeout=-1)
    with pytest.raises(ValueError, match="positive"):
        to_seconds(float("inf"))


def test_errors_form_one_hierarchy():
    from ncclguard.errors import CollectiveError

    assert issubclass(CollectiveTimeout, TimeoutError)
    for cls in (CollectiveTimeout, CollectiveFailed, CollectiveMismatch):
        assert issubclass(cls, CollectiveError) and issubclass(cls, ncclguard.NcclGuardError)
    assert issubclass(GroupFailed, ncclguard.NcclGuardError)
    from ncclguard.errors import BarrierFailed, BarrierTimeout, StoreUnreachable

    # A barrier's failures are collective errors too, so one except clause catches both calls.
    assert issubclass(BarrierTimeout, CollectiveTimeout) and issubclass(BarrierTimeout, TimeoutError)
    assert issubclass(BarrierFailed, CollectiveFailed)
    assert issubclass(StoreUnreachable, ncclguard.NcclGuardError)
    e = CollectiveTimeout("x", op="all_reduce(SUM)", numel=3, missing_ranks=[2], chunk=(1, 4))
    assert e.to_dict()["missing_ranks"] == [2] and e.to_dict()["chunk"] == [1, 4]


def test_log_messages_carry_the_rank(monkeypatch, caplog):
    from ncclguard._log import log

    monkeypatch.setenv("RANK", "5")
    with caplog.at_level(logging.INFO, logger="ncclguard"):
        log.info("hello")
    assert caplog.records[-1].getMessage() == "[rank 5] hello"
    assert caplog.records[-1].rank == 5


def test_public_face_is_explicit():
    for name in ncclguard.__all__:
        assert hasattr(ncclguard, name), name
