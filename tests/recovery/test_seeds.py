"""The check of the ranks' generators where a heal from a live peer hands them over, without
processes: the digests (ncclguard/recovery/_step/state.py), the outcome's comparison
(recovery/_commit/statements.py), the note (recovery/_commit/said.py) and the policy
(recovery/_step/seeds.py). The three ranks of tests/recovery/test_seeds_multirank.py run it whole."""

from __future__ import annotations

import logging
import random

import numpy
import pytest
import torch

from ncclguard.errors import GeneratorsApart
from ncclguard.recovery._commit.said import generators_noted, note_generators
from ncclguard.recovery._commit.statements import (
    MAX_GENERATORS,
    MAX_STATEMENT_BYTES,
    CommitStatement,
    decide,
    generators_apart,
)
from ncclguard.recovery._step.seeds import SeedCheck, apart_text
from ncclguard.recovery._step.state import StepState, drawn_generators, generator_digests
from ncclguard.recovery.commit import CommitResult
from ncclguard.store.codec import encode


def stmt(rank: int, gens: dict[str, str] | None = None, **kw) -> CommitStatement:
    base = {"rank": rank, "step": 0, "generation": 0, "group": "0", "group_size": 3, "seq": 4}
    return CommitStatement(**{**base, "generators": gens or {}, **kw})


def _digests_after(seed_torch: int, seed_py: int, seed_np: int) -> dict[str, str]:
    torch.manual_seed(seed_torch)
    random.seed(seed_py)
    numpy.random.seed(seed_np)
    return generator_digests(StepState.take(torch.nn.Linear(2, 2)))


def test_the_digests_are_equal_for_equal_seeds_and_name_the_generator_that_differs():
    a, b = _digests_after(7, 7, 7), _digests_after(7, 7, 7)
    assert a == b and set(a) == {"torch", "random", "numpy"}  # no CUDA here
    assert all(len(v) == 16 for v in a.values())
    assert {k for k, v in _digests_after(8, 7, 7).items() if v != a[k]} == {"torch"}
    assert {k for k, v in _digests_after(7, 8, 7).items() if v != a[k]} == {"random"}
    assert {k for k, v in _digests_after(7, 7, 8).items() if v != a[k]} == {"numpy"}
    torch.manual_seed(7)
    torch.rand(1)  # one draw moves it
    assert generator_digests(StepState.take(torch.nn.Linear(2, 2)))["torch"] != a["torch"]


def test_only_the_generators_a_step_drew_from_are_stated():
    kept = StepState.take(torch.nn.Linear(2, 2))
    assert drawn_generators(kept) == {}  # nothing drawn: an unseeded random or NumPy is no concern
    torch.nn.functional.dropout(torch.ones(8), 0.5)  # a forward with dropout draws from torch's
    assert drawn_generators(kept) == {"torch": generator_digests(kept)["torch"]}  # as the step found it
    numpy.random.rand()
    random.random()
    assert set(drawn_generators(kept)) == {"torch", "numpy", "random"}
    check = SeedCheck("x", states=True, explicit=True)
    check.state(kept)
    assert generators_noted() == drawn_generators(kept)
    SeedCheck("y", states=False, explicit=True).state(kept)  # a sharded engine states none
    assert generators_noted() == {}


def test_the_outcome_names_the_odd_rank_or_every_rank_and_never_fails_the_step():
    same = {"torch": "aa", "random": "bb"}
    assert decide({r: stmt(r, same) for r in range(3)}, 3, 0, 5.0).generators_apart == {}
    odd = decide({0: stmt(0, same), 1: stmt(1, same), 2: stmt(2, {"torch": "cc", "random": "bb"})}, 3, 0, 5.0)
    assert odd.ok and odd.generators_apart == {"torch": [2]}
    each = decide({r: stmt(r, {"torch": f"t{r}", "random": "bb"}) for r in range(3)}, 3, 0, 5.0)
    assert each.ok and each.generators_apart == {"torch": [0, 1, 2]}
    # Statements without digests (a plain should_commit) compare nothing; one alone neither.
    assert decide({r: stmt(r) for r in range(3)}, 3, 0, 5.0).generators_apart == {}
    assert generators_apart({0: stmt(0, {"torch": "x"}), 1: stmt(1)}) == {}
    # A failed step keeps its reasons; the comparison rides along.
    failed = decide({0: stmt(0, {"torch": "x"}, problems=["boom"]), 1: stmt(1, {"torch": "y"})}, 2, 0, 5.0)
    assert not failed.ok and failed.generators_apart == {"torch": [0, 1]}


def test_a_statement_with_every_generator_at_its_bounds_fits_and_more_are_refused():
    full = {f"g{i:015d}": "f" * 64 for i in range(MAX_GENERATORS)}
    s = stmt(0, full, problems=["y" * 300] * 8, group="g" * 255)
    assert len(encode(s)) <= MAX_STATEMENT_BYTES
    with pytest.raises(ValueError, match="at most 8 items"):
        stmt(0, {f"g{i}": "f" for i in range(MAX_GENERATORS + 1)})
    with pytest.raises(ValueError, match="at most 64 characters"):
        stmt(0, {"torch": "f" * 65})


def test_a_note_is_stated_in_one_commit_only_and_a_bad_one_is_refused():
    note_generators({"torch": "ab"})
    assert generators_noted() == {"torch": "ab"}
    assert generators_noted() == {}  # consumed: the next commit states nothing unless noted again
    with pytest.raises(ValueError, match="at most 8 short digests"):
        note_generators({f"g{i}": "x" for i in range(MAX_GENERATORS + 1)})
    with pytest.raises(ValueError, match="short digests"):
        note_generators({"torch": "x" * 65})


def _res(apart: dict[str, list[int]], generation: int = 0, step: int = 0) -> CommitResult:
    return CommitResult(ok=True, step=step, generation=generation, generators_apart=apart)


def test_heal_true_refuses_at_the_engines_first_commit_of_the_first_world(caplog):
    check = SeedCheck("RecoveringStep", states=True, explicit=True)
    error = check.judge(_res({"torch": [0, 1, 2], "numpy": [0, 1, 2]}), 5)
    assert isinstance(error, GeneratorsApart) and isinstance(error, ValueError)
    text = str(error)
    assert text.startswith(
        "RecoveringStep: the ranks' random generators are not alike at step 5 (numpy and torch differ"
    )
    assert "or pass heal=False" in text and "set_seed(seed) without device_specific=True" in text
    assert check.apart == {"torch": [0, 1, 2], "numpy": [0, 1, 2]}
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ncclguard"):
        assert check.judge(_res({"torch": [1]}, step=1), 6) is None  # said once: latched
        check.healed([2])
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "rank 2 was healed with a live peer's generators while the ranks' random generators are not" in (
        caplog.records[0].getMessage()
    )


def test_apart_later_or_under_the_default_heal_is_said_once_and_nothing_raised(caplog):
    with caplog.at_level(logging.ERROR, logger="ncclguard"):
        later = SeedCheck("x", states=True, explicit=True)
        assert later.judge(_res({}), 0) is None  # the first commit agreed
        assert later.judge(_res({"random": [0]}, step=1), 1) is None  # parted later: said, not raised
        assert later.judge(_res({"random": [0]}, step=2), 2) is None
        default = SeedCheck("y", states=True, explicit=False)
        assert default.judge(_res({"torch": [0, 1]}), 0) is None
        restarted = SeedCheck("z", states=True, explicit=True)  # a restarted process: a later world
        assert restarted.judge(_res({"torch": [0, 1]}, generation=1), 0) is None
        sharded = SeedCheck("w", states=False, explicit=True)  # own snapshots: its own generators back
        assert sharded.judge(_res({"torch": [0, 1]}), 0) is None and sharded.apart is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all("the run goes on, but not as it would have without the fault" in t for t in said)


def test_the_words_group_the_generators_by_their_ranks():
    assert apart_text({"torch": [2], "random": [2], "numpy": [0, 1]}, None) == (
        "the ranks' random generators are not alike (numpy differ on ranks 0-1; random and torch differ on "
        "rank 2: a seed per rank?)"
    )
