"""The evaluation keywords, declared once (``EvalKeywords``) and checked once (``GuardOptions``): the
deadline has one name, ``eval_timeout_s``, at every entry point; its old names (``timeout_s`` of the
guard and ``patch_trainer``, ``Config.eval_deadline_s`` and ``NCCLGUARD_EVAL_DEADLINE_S``) still
work, each with a DeprecationWarning that names the new one. One process, no process group."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from ncclguard.config import Config
from ncclguard.evaluation.guard import guarded_evaluate
from ncclguard.evaluation.options import EVAL_KEYWORDS, EvalKeywords, GuardOptions, eval_options
from ncclguard.integrations.deepspeed import patch_trainer


def test_the_keywords_are_declared_once_as_the_options_fields() -> None:
    assert EVAL_KEYWORDS == tuple(GuardOptions.model_fields)
    assert set(EvalKeywords.__optional_keys__) == set(EVAL_KEYWORDS) and not EvalKeywords.__required_keys__


def test_the_entry_points_take_the_keywords_one_way() -> None:
    # Each takes **evaluation: Unpack[EvalKeywords], as the adapters take **recovery.
    for fn in (guarded_evaluate, patch_trainer):
        var = [p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        hints = typing.get_type_hints(fn)
        assert len(var) == 1 and hints[var[0].name] == typing.Unpack[EvalKeywords], fn


def test_the_deadline_has_one_name_and_its_old_one_still_works() -> None:
    assert eval_options(eval_timeout_s=3).eval_timeout_s == 3.0
    with pytest.deprecated_call(match="timeout_s is deprecated: the evaluation deadline is eval_timeout_s"):
        assert eval_options(timeout_s=3).eval_timeout_s == 3.0  # type: ignore[call-arg]
    with pytest.deprecated_call(match="eval_timeout_s"):
        assert GuardOptions(timeout_s=4).eval_timeout_s == 4.0  # type: ignore[call-arg]
    with pytest.deprecated_call(match="GuardOptions.timeout_s is deprecated"):
        assert GuardOptions(eval_timeout_s=5).timeout_s == 5.0
    with pytest.raises(TypeError, match="pass eval_timeout_s alone"):
        eval_options(eval_timeout_s=3, timeout_s=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing the evaluation deadline: pass eval_timeout_s"):
        eval_options(retries=1)


def test_the_guard_and_patch_trainer_take_the_old_name_with_a_warning() -> None:
    with pytest.deprecated_call(match="eval_timeout_s"):
        assert guarded_evaluate(torch.nn.Linear(1, 1), lambda: 2.0, timeout_s=30) == 2.0  # type: ignore[call-arg]

    class Trainer:
        model = torch.nn.Linear(1, 1)

        def evaluate(self, step: int | None = None) -> tuple[float, float]:
            return (0.25, 0.5)

    trainer = Trainer()
    with pytest.deprecated_call(match="eval_timeout_s"):
        patch_trainer(trainer, timeout_s=30)  # type: ignore[call-arg]
    assert trainer.evaluate(step=1) == (0.25, 0.5)


def test_the_configurations_old_name_and_variable_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCLGUARD_EVAL_TIMEOUT_S", raising=False)
    monkeypatch.delenv("NCCLGUARD_EVAL_DEADLINE_S", raising=False)
    assert Config(eval_timeout_s=250).eval_timeout_s == 250.0
    with pytest.deprecated_call(match="eval_deadline_s .* is deprecated: use eval_timeout_s"):
        assert Config(eval_deadline_s=250).eval_timeout_s == 250.0  # type: ignore[call-arg]
    monkeypatch.setenv("NCCLGUARD_EVAL_DEADLINE_S", "120")
    with pytest.deprecated_call(match="NCCLGUARD_EVAL_TIMEOUT_S"):
        assert Config().eval_timeout_s == 120.0
    monkeypatch.setenv("NCCLGUARD_EVAL_TIMEOUT_S", "90")  # the new variable wins
    assert Config().eval_timeout_s == 90.0
