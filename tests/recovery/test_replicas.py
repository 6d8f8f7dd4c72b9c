"""The replica check's pure parts, without processes: the digest (any single flipped bit in any dtype
changes it; equal bytes give equal digests, whatever the strides) and the majority rule that names a
drifted rank at the commit (docs/numerics.md, "Replicas checked")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.recovery._commit.statements import (
    MAX_PROBLEMS,
    MAX_STATEMENT_BYTES,
    CommitOutcome,
    CommitStatement,
    decide,
    outcome_limit,
)
from ncclguard.recovery._numerics import digest as digest_module
from ncclguard.recovery._numerics.digest import replica_digests, tensor_digest
from ncclguard.recovery._numerics.drift import ReplicaDrift, only_drift, replica_drift
from ncclguard.recovery._numerics.policy import Suspects
from ncclguard.recovery._numerics.replicas import ReplicaCheck
from ncclguard.recovery.adapter import Adapter
from ncclguard.store.codec import decode, encode

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    return t.clone() if dtype != torch.bool else (raw % 2).view(torch.bool).clone()


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    out = t.clone()
    raw = out.view(torch.uint8)
    raw[byte] ^= 1 << bit
    return out


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 600),
    seed=st.integers(0, 2**31 - 1),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    chunk=st.sampled_from([7, 64, 1 << 20]),
)
def test_any_single_flipped_bit_in_any_dtype_changes_the_digest(dtype, n, seed, where, bit, chunk):
    t = _tensor(dtype, n, seed)
    nbytes = t.numel() * t.element_size()
    byte = int(where * nbytes)
    if dtype == torch.bool:
        bit = 0  # a bool holds 0 or 1: its only meaningful bit
    flipped = _flip(t, byte, bit)
    with chunked(chunk):  # small chunks: a tensor over several chunks, their fold included
        assert int(tensor_digest(flipped)) != int(tensor_digest(t))
        assert int(tensor_digest(t.clone())) == int(tensor_digest(t))  # equal bytes, equal digests


@contextlib.contextmanager
def chunked(chunk: int) -> Iterator[None]:
    """The digest's chunk set to ``chunk`` (its weights are cached per chunk size), put back after."""
    saved = digest_module.CHUNK
    digest_module.CHUNK = chunk
    digest_module._WEIGHTS.clear()
    try:
        yield
    finally:
        digest_module.CHUNK = saved
        digest_module._WEIGHTS.clear()


@settings(max_examples=50, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 20), cols=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_equal_values_give_equal_digests_whatever_the_strides(dtype, rows, cols, seed):
    t = _tensor(dtype, rows * cols, seed).reshape(rows, cols)
    transposed = t.t().contiguous().t()  # the same values, column-major
    assert not transposed.is_contiguous() or rows == 1 or cols == 1
    assert int(tensor_digest(transposed)) == int(tensor_digest(t))


def test_two_words_swapped_change_the_digest_and_an_empty_tensor_digests_to_zero():
    t = torch.arange(10, dtype=torch.int32)
    swapped = t.clone()
    swapped[2], swapped[7] = t[7], t[2]
    assert int(tensor_digest(swapped)) != int(tensor_digest(t))
    assert int(tensor_digest(torch.empty(0))) == 0


def test_a_replica_states_its_parameters_and_its_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert set(replica_digests(model, opt)) == {"parameters"}  # no optimizer state before its first step
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = replica_digests(model, opt)
    assert set(before) == {"parameters", "optimizer"} and all(len(v) == 16 for v in before.values())
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin_opt.load_state_dict(opt.state_dict())
    assert replica_digests(twin, twin_opt) == before
    with torch.no_grad():
        opt.state[model.weight]["exp_avg_sq"].view(-1).view(torch.int32)[5] ^= 1 << 3
    after = replica_digests(model, opt)
    assert after["parameters"] == before["parameters"] and after["optimizer"] != before["optimizer"]


# --- the majority rule --------------------------------------------------------------------------------------


def test_the_rank_whose_digest_differs_from_the_majority_is_named_with_the_majority():
    a, b = {"parameters": "a", "optimizer": "o"}, {"parameters": "b", "optimizer": "o"}
    assert replica_drift({0: a, 1: a, 2: b}) == ReplicaDrift(ranks=[2], majority=[0, 1], parts={"parameters": [2]})
    assert replica_drift({0: a, 1: a, 2: a}) is None
    assert replica_drift({0: a, 1: {}, 2: b}) == ReplicaDrift(ranks=[0, 2], majority=[], parts={"parameters": [0, 2]})
    assert replica_drift({0: a, 1: {}, 2: {}}) is None  # fewer than two stated: nothing to compare
    # Two parts apart on two different ranks: both named, the rest the majority.
    c = {"parameters": "a", "optimizer": "x"}
    four = {0: a, 1: a, 2: b, 3: c}
    assert replica_drift(four) == ReplicaDrift(
        ranks=[2, 3], majority=[0, 1], parts={"optimizer": [3], "parameters": [2]}
    )


def test_two_ranks_that_differ_have_no_majority_and_nobody_is_named():
    drift = replica_drift({0: {"parameters": "a"}, 1: {"parameters": "b"}})
    assert drift == ReplicaDrift(ranks=[0, 1], majority=[], parts={"parameters": [0, 1]})
    half = replica_drift(
        {0: {"parameters": "a"}, 1: {"parameters": "a"}, 2: {"parameters": "b"}, 3: {"parameters": "b"}}
    )
    assert half is not None and half.majority == [] and half.ranks == [0, 1, 2, 3]


def _statement(rank: int, replicas: dict[str, str]) -> CommitStatement:
    return CommitStatement(rank=rank, step=4, generation=0, group="0", group_size=3, seq=10, replicas=replicas)


def test_the_commit_fails_the_drifted_rank_alone_the_same_outcome_for_every_rank():
    good, bad = {"parameters": "1" * 16}, {"parameters": "2" * 16}
    outcome = decide({0: _statement(0, good), 1: _statement(1, good), 2: _statement(2, bad)}, 3, 4, 10.0)
    assert not outcome.ok and sorted(outcome.failed) == [2]
    assert outcome.drift == ReplicaDrift(ranks=[2], majority=[0, 1], parts={"parameters": [2]})
    (reason,) = outcome.failed[2]
    assert reason.startswith("replica drifted: its parameters digest differs from ranks 0-1's")
    assert only_drift(outcome.failed, outcome.drift)
    # A rank that also failed otherwise: not the values alone (the world is rebuilt).
    failing = CommitStatement(**{**_statement(1, good).model_dump(), "problems": ["the caller reported: boom"]})
    mixed = decide({0: _statement(0, good), 1: failing, 2: _statement(2, bad)}, 3, 4, 10.0)
    assert not only_drift(mixed.failed, mixed.drift)
    # Nothing stated (not a check's step): nothing compared.
    assert decide({r: _statement(r, {}) for r in range(3)}, 3, 4, 10.0).ok


def test_a_drifted_rank_whose_gradient_the_drift_made_nan_is_healed_not_rebuilt():
    """A flipped exponent bit can make the drifted rank's own gradient NaN: its two reasons are still
    the values alone (heal it from the majority, redo), where a rebuild would copy rank 0's parameters
    to every rank, a drifted rank 0's too (found by benchmarks/nan_detection_drill.py)."""
    drift = ReplicaDrift(ranks=[0], majority=[1, 2], parts={"parameters": [0]})
    reason = "replica drifted: its parameters digest differs from ranks 1-2's before the step"
    both = {0: [reason, "NaN in bucket 1 (w)"]}
    assert only_drift(both, drift, {0: ["NaN"]})
    assert not only_drift(both, drift)  # a second reason that is not the rank's own NaN: not the values alone
    # A NaN on a rank that did not drift, beside the drifted one: not the drift alone.
    assert not only_drift({0: [reason], 1: ["NaN in bucket 0 (w)"]}, drift, {1: ["NaN"]})
    # Three reasons: something else failed too.
    assert not only_drift({0: [reason, "NaN in bucket 1 (w)", "the caller reported: boom"]}, drift, {0: ["NaN"]})


def test_a_statement_bounds_its_digests():
    with pytest.raises(ValueError):
        _statement(0, {f"p{i}": "0" * 16 for i in range(5)})
    with pytest.raises(ValueError):
        _statement(0, {"parameters": "0" * 65})


def test_a_statement_and_an_outcome_with_digests_at_their_bounds_fit_the_codec_limits():
    parts = {f"part-{i}".ljust(16, "x"): "f" * 64 for i in range(4)}
    full = CommitStatement(
        **{**_statement(0, parts).model_dump(), "problems": ["y" * 300] * MAX_PROBLEMS, "group": "g" * 255}
    )
    assert len(encode(full)) <= MAX_STATEMENT_BYTES
    size = 64
    said = {r: _statement(r, {p: f"{r:016x}" for p in parts}) for r in range(size)}  # every rank apart
    outcome = decide(said, size, 4, 10.0)
    assert outcome.drift is not None and outcome.drift.majority == [] and len(outcome.drift.ranks) == size
    assert decode(CommitOutcome, encode(outcome), "outcome", outcome_limit(size)) == outcome


def test_the_check_states_nothing_off_its_steps_or_without_a_process_group():
    module = torch.nn.Linear(2, 2)

    class Plain(Adapter):
        def get_module(self) -> torch.nn.Module:
            return module

        def rewrap(self, rebuilt: object) -> None:
            return None

    check = ReplicaCheck(4, Plain(), Suspects(10), 5.0, 1 << 20)
    assert check.install(module) is module and check.on
    assert not check.due(3) and not check.due(4)  # no process group: nobody to compare with
    assert not ReplicaCheck(None, Plain(), Suspects(10), 5.0, 1 << 20).due(0)
