"""The numerical check's pure parts, without processes: the scan (ncclguard/collectives/finite.py),
what a rank states and how it reads (recovery/_numerics/findings.py), the commit's outcome with it
(recovery/_commit/statements.py), the policy and the suspects (recovery/_numerics/policy.py), the
options; then, in a gloo world of one in this process, the hook on RecoveringStep's own wrapper,
where it is not put, and safe_all_reduce's check. The launch on real ranks:
tests/recovery/test_numerics_multirank.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ncclguard
from ncclguard.collectives.calls import CallPrint, compare_prints
from ncclguard.collectives.failures import nonfinite_ranks
from ncclguard.collectives.finite import extremes, kind_of, nonfinite_kind, unchecked_reason
from ncclguard.errors import NonFiniteGradient, NonFiniteInput
from ncclguard.recovery._commit.said import note_numerics
from ncclguard.recovery._commit.statements import (
    MAX_PROBLEMS,
    MAX_STATEMENT_BYTES,
    CommitOutcome,
    CommitStatement,
    decide,
    only_nonfinite,
    outcome_limit,
)
from ncclguard.recovery._numerics import param_check
from ncclguard.recovery._numerics.findings import (
    MAX_FLAGGED_BUCKETS,
    MAX_PARAM_NAME_CHARS,
    MAX_PARAM_NAMES,
    NumericsSaid,
    bucket_finding,
    describe,
    numerics_said,
    outcome_words,
)
from ncclguard.recovery._numerics.hook import GradCheck
from ncclguard.recovery._numerics.policy import NonFiniteWatch, Suspects, choose
from ncclguard.recovery.options import recovery_options
from ncclguard.recovery.recovering import RecoveringStep
from ncclguard.store.codec import decode, encode

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# --- the scan ---------------------------------------------------------------------------------------------


@settings(max_examples=150)
@given(
    n=st.integers(1, 3000),
    dtype=st.sampled_from(FLOATS),
    bad=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from(["nan", "inf", "-inf"])), max_size=3),
    scale=st.sampled_from([1e-30, 1.0, 6e4]),
)
def test_the_scan_flags_exactly_the_tensors_holding_a_nan_or_an_infinity(n, dtype, bad, scale):
    # 6e4 in fp16 is near its largest value: a sum would overflow to Inf, the scan must not flag it.
    t = (torch.rand(n, generator=torch.Generator().manual_seed(n)) * 2 - 1).mul(scale).to(dtype)
    for pos, v in bad:
        t[pos % n] = float(v)
    has_nan, has_inf = bool(t.isnan().any()), bool(t.isinf().any())
    expected = "NaN" if has_nan else "Inf" if has_inf else None
    assert nonfinite_kind(t) == expected
    assert kind_of(extremes(t).tolist()) == expected
    assert nonfinite_kind(t[::3]) == (None if t[::3].isfinite().all() else nonfinite_kind(t[::3].contiguous()))


def test_what_the_scan_passes_through_it_says_why_and_never_flags():
    assert unchecked_reason(torch.tensor([1, 2], dtype=torch.int64)) == "a int64 tensor (its values are always finite)"
    assert unchecked_reason(torch.tensor([True])) == "a bool tensor (its values are always finite)"
    assert unchecked_reason(torch.zeros(0)) == "an empty tensor (no values)"
    sparse = torch.sparse_coo_tensor([[0]], [float("nan")], (3,), check_invariants=True)
    assert unchecked_reason(sparse) == "a sparse_coo tensor (its values are not scanned)"
    for t in (torch.zeros(0), sparse, torch.tensor([7], dtype=torch.int32)):
        assert nonfinite_kind(t) is None
    assert nonfinite_kind(torch.tensor([1 + 1j, complex(0, float("inf"))])) == "Inf"
    assert kind_of((float("-inf"), 3.0)) == "Inf" and kind_of((float("nan"), float("nan"))) == "NaN"


# --- what a rank states, in words -------------------------------------------------------------------------


def test_a_finding_is_cut_to_its_bounds_and_keeps_the_end_of_a_long_name():
    names = [f"layer{i}.weight" for i in range(MAX_PARAM_NAMES + 3)]
    long = "encoder." * 20 + "q_proj.weight"
    b = bucket_finding(4, "NaN", [long, *names])
    assert b.params[0].endswith("q_proj.weight") and len(b.params[0]) == MAX_PARAM_NAME_CHARS
    assert b.params[0].startswith("...")
    assert len(b.params) == MAX_PARAM_NAMES and b.more_params == 4
    said = numerics_said(9, 1, [bucket_finding(i, "Inf", ["w"]) for i in (7, 2, 5, 3, 0, 1)])
    assert [x.index for x in said.nonfinite] == [0, 1, 2, 3][:MAX_FLAGGED_BUCKETS]
    assert (said.checked, said.passed, said.more_buckets) == (9, 1, 2)


def test_the_words_name_the_rank_the_step_the_buckets_the_parameters_and_the_finite_ranks():
    b0 = bucket_finding(0, "NaN", ["head.bias", "head.weight"])
    b2 = bucket_finding(2, "Inf", ["fc1.weight"] + [f"p{i}" for i in range(8)])
    assert describe([b0]) == "non-finite gradient: NaN in bucket 0 (head.bias, head.weight)"
    assert describe([b0, b2], 3).endswith(
        "Inf in bucket 2 (fc1.weight, p0, p1, p2, p3, p4, p5, p6 and 1 more); 3 more bucket(s)"
    )
    assert outcome_words(41, {1: [b0]}, [0, 2, 3]) == (
        "step 41: non-finite gradient on rank 1 (NaN in bucket 0 (head.bias, head.weight)); ranks 0,2-3 were finite"
    )
    two = outcome_words(5, {0: [b0], 3: [b2]}, [])
    assert two.startswith(
        "step 5: non-finite gradient on ranks 0,3 (rank 0: NaN in bucket 0 (head.bias, head.weight); rank 3: Inf"
    )
    assert two.endswith("no other rank's gradient was checked")


# --- the commit's outcome -----------------------------------------------------------------------------------


def stmt(rank: int, numerics: NumericsSaid | None = None, **kw) -> CommitStatement:
    base = {"rank": rank, "step": 3, "generation": 0, "group": "0", "group_size": 3, "seq": 10}
    return CommitStatement(**{**base, "numerics": numerics, **kw})


def finite(checked: int = 2) -> NumericsSaid:
    return NumericsSaid(checked=checked)


def test_a_non_finite_rank_fails_the_step_named_and_the_others_are_said_finite():
    bad = numerics_said(2, 0, [bucket_finding(1, "NaN", ["fc1.weight"])])
    v = decide({0: stmt(0, finite()), 1: stmt(1, bad), 2: stmt(2, finite())}, 3, 3, 5.0)
    assert not v.ok
    assert v.failed == {1: ["non-finite gradient: NaN in bucket 1 (fc1.weight)"]}
    assert v.nonfinite == {1: list(bad.nonfinite)} and v.finite == [0, 2]
    assert only_nonfinite(v.failed, v.nonfinite)
    # Another problem beside it: the world may be broken, the engine rebuilds.
    v = decide({0: stmt(0, finite(), problems=["all_reduce failed"]), 1: stmt(1, bad), 2: stmt(2)}, 3, 3, 5.0)
    assert not only_nonfinite(v.failed, v.nonfinite) and v.finite == [0]  # rank 2 stated nothing checked
    # A rank that checked nothing (it failed before its backward) is not called finite.
    v = decide({0: stmt(0, finite(0)), 1: stmt(1, finite()), 2: stmt(2, finite())}, 3, 3, 5.0)
    assert v.ok and v.finite == [1, 2] and v.nonfinite == {}


@settings(max_examples=200)
@given(
    st.lists(st.sampled_from(["none", "unchecked", "finite", "nan", "problem+nan", "problem"]), min_size=1, max_size=6)
)
def test_the_outcome_with_numerics_holds_its_invariants(kinds):
    said = {
        "none": None,
        "unchecked": finite(0),
        "finite": finite(),
        "nan": numerics_said(1, 0, [bucket_finding(0, "NaN", ["w"])]),
        "problem+nan": numerics_said(1, 0, [bucket_finding(0, "Inf", ["w"])]),
        "problem": finite(),
    }
    statements = {
        r: stmt(r, said[k], group_size=len(kinds), problems=["x failed"] if k.startswith("problem") else [])
        for r, k in enumerate(kinds)
    }
    v = decide(statements, len(kinds), 3, 5.0)
    flagged = {r for r, k in enumerate(kinds) if k in ("nan", "problem+nan")}
    assert set(v.nonfinite) == flagged and set(v.nonfinite) <= set(v.failed)
    assert set(v.finite) == {r for r, k in enumerate(kinds) if k in ("finite", "problem")}
    assert v.ok == (not flagged and "problem" not in kinds)
    assert only_nonfinite(v.failed, v.nonfinite) == (bool(flagged) and not any(k.startswith("problem") for k in kinds))


def test_a_statement_and_an_outcome_at_their_bounds_fit_the_codec_limits():
    names = ["n" * MAX_PARAM_NAME_CHARS] * (MAX_PARAM_NAMES + 5)
    full = numerics_said(10**6, 10**6, [bucket_finding(i, "NaN", names) for i in range(MAX_FLAGGED_BUCKETS + 3)])
    s = stmt(
        0,
        full,
        problems=["y" * 300] * MAX_PROBLEMS,
        group="g" * 255,
        other_seqs={f"{i:064d}": 10**9 for i in range(16)},
    )
    assert len(encode(s)) <= MAX_STATEMENT_BYTES
    size = 4
    v = decide(
        {r: stmt(r, full, group_size=size, problems=["y" * 300] * MAX_PROBLEMS) for r in range(size)}, size, 3, 5.0
    )
    assert decode(CommitOutcome, encode(v), "outcome", outcome_limit(size)) == v
    with pytest.raises(ValueError, match="at most 4 items"):
        NumericsSaid(checked=1, nonfinite=[bucket_finding(i, "NaN", []) for i in range(MAX_FLAGGED_BUCKETS + 1)])
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        NumericsSaid(checked=1, flagged=True)


# --- the policy, the suspects, the options -------------------------------------------------------------------


def test_the_policy_redoes_once_then_skips_and_raise_always_raises():
    assert choose("redo", redone=False, can_redo=True) == "redo"
    assert choose("auto", redone=False, can_redo=True) == "redo" and choose("auto", True, True) == "skip"
    assert choose("redo", redone=True, can_redo=True) == "skip"
    assert choose("redo", redone=False, can_redo=False) == "skip"  # no attempt left
    assert choose("skip", redone=False, can_redo=True) == "skip"
    assert [choose("raise", a, b) for a in (False, True) for b in (False, True)] == ["raise"] * 4


@settings(max_examples=200)
@given(
    within=st.integers(1, 20),
    events=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=30),
)
def test_a_rank_is_named_a_suspect_once_when_flagged_at_two_steps_within_the_bound(within, events):
    suspects = Suspects(within)
    named: list[int] = []
    for rank, step in events:
        named += suspects.seen([rank], step)
    last: dict[int, int] = {}
    expected: list[int] = []
    for rank, step in events:  # the model: each finding against the rank's one before
        if rank in last and last[rank] != step and abs(step - last[rank]) <= within and rank not in expected:
            expected.append(rank)
        last[rank] = step
    assert named == expected == suspects.named
    assert len(set(named)) == len(named)


def test_the_watch_says_what_it_did_and_names_a_suspect_device_once(caplog):
    watch = NonFiniteWatch("redo", 10, "Test")
    b = [bucket_finding(1, "NaN", ["fc1.weight"])]
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        action, error = watch.act(5, {1: b}, [0, 2], can_redo=True)
        assert action == "redo" and isinstance(error, NonFiniteGradient)
        assert watch.act(5, {1: b}, [0, 2], can_redo=True)[0] == "skip"  # the same step again
        watch.begin()
        action, error = watch.act(9, {1: b}, [0, 2], can_redo=True)
    assert action == "redo" and error.ranks == [1] and error.finite_ranks == [0, 2] and error.step == 9
    assert error.buckets == {1: [{"index": 1, "kind": "NaN", "params": ["fc1.weight"], "more_params": 0}]}
    assert str(error).startswith("step 9: non-finite gradient on rank 1 (NaN in bucket 1 (fc1.weight)); ranks 0,2")
    suspect = [r.getMessage() for r in caplog.records if "device is suspect" in r.getMessage()]
    assert len(suspect) == 1 and "rank 1 gave a non-finite gradient again at step 9" in suspect[0]
    assert [(s.step, s.action) for s in watch.seen] == [(5, "redo"), (5, "skip"), (9, "redo")]


def test_bad_options_are_refused_before_any_communication():
    with pytest.raises(
        ValueError, match="on_nonfinite must be 'auto' or 'redo' or 'skip' or 'raise' or 'off', got 'retry'"
    ):
        recovery_options(on_nonfinite="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nonfinite_suspect_steps must be an int of at least 1, got 0"):
        recovery_options(nonfinite_suspect_steps=0)
    with pytest.raises(ValueError, match="on_nonfinite must be"):
        RecoveringStep(
            torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), on_nonfinite=None
        )  # type: ignore[arg-type]
    assert recovery_options().on_nonfinite == "auto" and recovery_options().nonfinite_suspect_steps == 100
    with pytest.raises(ValueError, match="within must be an int of at least 1"):
        Suspects(0)


def test_the_hooks_check_passes_through_what_it_cannot_scan_and_names_the_rest():
    check = GradCheck()
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    check._names = {id(w): "fc.weight", id(b): "fc.bias"}
    check.note(0, torch.zeros(0), [w])
    check.note(1, torch.tensor([1, 2]), [w])
    check.note(2, torch.tensor([1.0, float("inf")]), [b, w])
    check.note(3, torch.tensor([0.5, 2.0]), [b])
    said = check.said()
    assert (said.checked, said.passed, said.more_buckets) == (2, 2, 0)
    assert [x.model_dump() for x in said.nonfinite] == [
        {"index": 2, "kind": "Inf", "params": ["fc.bias", "fc.weight"], "more_params": 0}
    ]
    check.clear()
    assert check.said() == NumericsSaid(checked=0, passed=0)


def test_a_parameter_hook_is_put_once_each_and_on_a_parameter_that_came_later():
    """DeepSpeed's path (param_check): the check hooks each parameter's gradient. A module whose
    parameters changed (a new engine after a redo) is hooked again, but only where a hook is missing:
    a second hook on a parameter would scan its gradient twice at every step."""
    check, module = GradCheck(), torch.nn.Linear(4, 3)
    assert param_check.install(check, module) == 2 and param_check.carries_every(check, module)
    module(torch.ones(2, 4)).sum().backward()
    assert sorted(i for i, _, _ in check._pending) == [0, 1]
    check.clear()
    module.scale = torch.nn.Parameter(torch.ones(3))  # a parameter the module did not have
    assert not param_check.carries_every(check, module)
    assert param_check.install(check, module) == 3 and param_check.carries_every(check, module)
    (module(torch.ones(2, 4)) * module.scale).sum().backward()
    assert sorted(i for i, _, _ in check._pending) == [0, 1, 2]  # each once: no second hook
    check.clear()
    module.scale = torch.nn.Parameter(
        torch.full((3,), float("nan"))
    )  # replaced: a new tensor, hooked anew; it turns the others NaN
    assert not param_check.carries_every(check, module)
    param_check.install(check, module)
    (module(torch.ones(2, 4)) * module.scale).sum().backward()
    said = check.said()
    assert (said.checked, [(f.index, f.params) for f in said.nonfinite]) == (3, [(0, ["weight"]), (1, ["bias"])])


# --- in a gloo world of one, in this process --------------------------------------------------------------


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _stepper(**kw) -> tuple[RecoveringStep, torch.nn.Module]:
    kw.setdefault("on_nonfinite", "redo")  # "auto", the default, leaves a model on the CPU unchecked
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1), collective_timeout=30, **kw), module


def _poisoned(module: torch.nn.Module, attempts: list[int], every: bool):
    def step_fn(model: torch.nn.Module) -> None:
        attempts.append(1)
        loss = model(torch.ones(3, 4)).sum()
        if every or len(attempts) == 1:
            loss = loss * float("nan")
        loss.backward()

    return step_fn


def test_a_bad_batch_is_redone_once_then_skipped_and_the_parameters_stay_as_they_were(world_of_one):
    stepper, module = _stepper()
    assert stepper.engine.numerics.check is not None and stepper.engine.numerics.check.installed
    before = [p.detach().clone() for p in module.parameters()]
    attempts: list[int] = []
    res = stepper(_poisoned(module, attempts, every=True), step=0)
    assert not res and res.skipped and res.attempts == 2 and res.rebuilds == 0 and len(attempts) == 2
    assert isinstance(res.error, NonFiniteGradient) and res.error.action == "skip" and res.error.ranks == [0]
    assert [c.only_nonfinite for c in res.commits] == [True, True]
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))
    attempts.clear()
    assert stepper(_poisoned(module, attempts, every=False), step=1).attempts == 2  # a transient: redone, applied
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert stepper.recoveries == []  # a redo for the values is no recovery of the world


def test_with_one_attempt_the_step_is_skipped_and_with_raise_it_raises(world_of_one):
    stepper, module = _stepper(max_attempts=1)
    attempts: list[int] = []
    res = stepper(_poisoned(module, attempts, every=False), step=0)
    assert res.skipped and res.attempts == 1 and len(attempts) == 1
    stepper, module = _stepper(on_nonfinite="raise")
    with pytest.raises(NonFiniteGradient, match="step 1: non-finite gradient on rank 0 .*NonFiniteGradient is raised"):
        stepper(_poisoned(module, [], every=False), step=1)  # the steps grow in a world
    assert stepper.engine._open is None  # the transaction was closed


def test_the_check_is_put_only_on_the_wrapper_ncclguard_builds(world_of_one, caplog):
    off, _ = _stepper(on_nonfinite="off")
    assert off.engine.numerics.check is None
    with caplog.at_level(logging.INFO, logger="ncclguard"):
        own, _ = _stepper(wrap=lambda m: torch.nn.parallel.DistributedDataParallel(m))
        scaled, _ = _stepper(scaler=torch.amp.GradScaler("cpu"))
    assert not own.engine.numerics.check.installed and not scaled.engine.numerics.check.installed
    said = [r.getMessage() for r in caplog.records if "not checked for NaN" in r.getMessage()]
    assert len(said) == 2
    assert "wrap= builds your own wrapper" in said[0] and "a GradScaler owns non-finite gradients" in said[1]
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    own.model.register_comm_hook(None, allreduce_hook)  # your wrapper's one hook slot is yours


def test_auto_the_default_leaves_a_model_on_the_cpu_unchecked_and_says_so_once(world_of_one, caplog):
    with caplog.at_level(logging.INFO, logger="ncclguard"):
        auto, module = _stepper(on_nonfinite="auto")
    assert auto.engine.options.on_nonfinite == "auto"
    assert auto.engine.numerics.check is not None and not auto.engine.numerics.check.installed
    said = [r.getMessage() for r in caplog.records if "not checked for NaN" in r.getMessage()]
    assert said == [
        "[rank 0] RecoveringStep: gradients are not checked for NaN or Inf: on_nonfinite='auto' leaves a model "
        "on the CPU unchecked; on_nonfinite='redo' checks it (docs/numerics.md)"
    ]
    attempts: list[int] = []
    res = auto(_poisoned(module, attempts, every=False), step=0)
    assert res and res.attempts == 1  # unchecked: the NaN is applied, as without ncclguard
    assert not all(torch.isfinite(p).all() for p in module.parameters())


def test_a_commit_in_a_world_of_one_carries_the_numerics():
    note_numerics(numerics_said(1, 0, [bucket_finding(0, "NaN", ["w"])]))
    res = ncclguard.should_commit()
    assert not res and res.only_nonfinite and res.failed_ranks == [0] and res.finite_ranks == []
    assert "redo the step or skip its batch" in str(res.error)
    note_numerics(finite())
    res = ncclguard.should_commit()
    assert res and res.finite_ranks == [0] and res.nonfinite == {}
    assert ncclguard.should_commit().finite_ranks == []  # a note is for one commit


def test_safe_all_reduce_checks_its_input_where_asked_and_refuses_a_bad_flag():
    t = torch.tensor([1.0, float("nan")])
    res = ncclguard.safe_all_reduce(t, check_finite=True)
    assert (
        not res and isinstance(res.error, NonFiniteInput) and res.error.ranks == [0] and res.error.kinds == {0: "NaN"}
    )
    assert ncclguard.safe_all_reduce(t) and ncclguard.safe_all_reduce(t, check_finite=False)
    with pytest.raises(TypeError, match="check_finite must be True, False or None, got 'yes'"):
        ncclguard.safe_all_reduce(t, check_finite="yes")  # type: ignore[arg-type]


def test_the_cross_rank_check_carries_the_flag_without_comparing_it():
    base = {"kind": "all_reduce", "site": "x.py:1", "numel": 4, "dtype": "float32"}
    prints = {0: CallPrint(**base, nonfinite=None), 1: CallPrint(**base, nonfinite="NaN")}
    assert compare_prints(prints) == (None, None)
    assert nonfinite_ranks({0: {**base, "nonfinite": None}, 1: {**base, "nonfinite": "NaN"}, 2: base}) == {1: "NaN"}
    assert compare_prints({0: CallPrint(**base), 1: CallPrint(**{**base, "numel": 5})})[0] is not None
