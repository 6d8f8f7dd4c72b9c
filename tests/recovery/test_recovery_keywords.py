"""The recovery keywords, declared once (``RecoveryKeywords``) and checked once (``RecoveryOptions``, a
frozen pydantic model): every adapter takes each keyword the same way, ``**recovery``, and each one
reaches the engine's options. In this process, no process group: the adapters that build without one
(``RecoveringStep``, ``guard_trainer``, Lightning's ``NcclGuardCallback``, ``recovering_step`` on a
CPU Accelerator) are built with every keyword set; the DeepSpeed ones need an engine made by
``deepspeed.initialize`` on a live world, so their signatures are read against the declaration and
``CommittedEngineStep``'s own options step is run (tests/integrations/test_deepspeed_commit_multirank.py and
tests/integrations/test_accelerate_deepspeed_multirank.py build them on real ranks)."""

from __future__ import annotations

import inspect
import logging
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from ncclguard.recovery import preempt
from ncclguard.recovery.options import RECOVERY_KEYWORDS, RecoveryKeywords, RecoveryOptions, recovery_options


@pytest.fixture
def given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every recovery keyword, each with a value other than its default."""
    monkeypatch.delenv(preempt.PREEMPT_DIR_VAR, raising=False)
    return {
        "collective_timeout": timedelta(seconds=41),
        "commit_timeout": 42,
        "rebuild_timeout": 43.5,
        "allow_shrink": True,
        "max_attempts": 5,
        "heal": True,
        "heal_timeout": timedelta(seconds=44),
        "heal_chunk_bytes": 1 << 20,
        "left_out": "raise",
        "snapshot_every": 7,
        "snapshot_keep": 2,
        "snapshot_spares": True,
        "snapshot_max_bytes": 1 << 30,
        "preempt_dir": tmp_path / "ck",
        "on_nonfinite": "skip",
        "nonfinite_suspect_steps": 7,
        "replica_check_every": 9,
    }


def _expected(given: dict[str, Any]) -> dict[str, Any]:
    """The options' fields the keywords should give (durations in seconds)."""
    seconds = {k: v.total_seconds() if isinstance(v, timedelta) else v for k, v in given.items()}
    return {name: seconds[field.alias or name] for name, field in RecoveryOptions.model_fields.items()}


def _assert_reached(options: RecoveryOptions, given: dict[str, Any]) -> None:
    assert options.model_dump() == _expected(given)


@pytest.fixture
def fresh_accelerate():
    """Accelerate's state is one per process; an earlier Accelerator's settings would stay (as in
    tests/integrations/test_accelerate_accumulate_multirank.py). Reset before and after."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = torch.nn.Linear(3, 2)
    return module, torch.optim.SGD(module.parameters(), lr=0.1)


# --- the declaration ------------------------------------------------------------------------------------


def test_the_keywords_are_declared_once_as_the_options_aliases() -> None:
    aliases = tuple(field.alias or name for name, field in RecoveryOptions.model_fields.items())
    assert RECOVERY_KEYWORDS == aliases
    assert set(RecoveryKeywords.__optional_keys__) == set(aliases) and not RecoveryKeywords.__required_keys__
    assert recovery_options() == RecoveryOptions()


def test_each_given_value_differs_from_its_default(given: dict[str, Any]) -> None:
    default, expected = RecoveryOptions().model_dump(), _expected(given)
    assert [name for name in default if default[name] == expected[name]] == []


def test_the_options_are_a_frozen_model_validated_where_made(given: dict[str, Any]) -> None:
    options = RecoveryOptions(**given)
    _assert_reached(options, given)
    with pytest.raises(ValidationError, match="frozen"):
        options.max_attempts = 9  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        RecoveryOptions(rebuild_timeout_s=3)  # the attribute's name is not a keyword
    with pytest.raises(TypeError, match="unexpected keyword argument.*'rebuild_timout'.*rebuild_timeout"):
        recovery_options(rebuild_timout=3)  # type: ignore[call-arg]
    # The hand checks' sentences, each raised by the model; a wrong type stays a TypeError.
    for keywords, error, said in [
        ({"heal": "yes"}, TypeError, "heal must be True or False, got 'yes'"),
        ({"rebuild_timeout": "1m"}, TypeError, "rebuild_timeout must be seconds .* or a datetime.timedelta"),
        ({"heal_timeout": None}, TypeError, "heal_timeout must be seconds"),
        ({"commit_timeout": float("nan")}, ValueError, "commit_timeout must be a positive duration"),
        ({"collective_timeout": timedelta(0)}, ValueError, "collective_timeout must be a positive duration"),
        ({"heal_chunk_bytes": True}, ValueError, "heal_chunk_bytes must be a positive int, got True"),
        ({"max_attempts": 2.0}, ValueError, "max_attempts must be an int of at least 1, got 2.0"),
        ({"snapshot_every": 0}, ValueError, "snapshot_every must be None .* or an int of at least 1"),
        ({"snapshot_keep": 3}, ValueError, "snapshot_keep must be 1 or 2 .*, got 3"),
        ({"snapshot_spares": 1}, TypeError, "snapshot_spares must be True or False, got 1"),
        ({"left_out": "stay"}, ValueError, "left_out must be 'exit' or 'raise', got 'stay'"),
        (
            {"on_nonfinite": "retry"},
            ValueError,
            "on_nonfinite must be 'auto' or 'redo' or 'skip' or 'raise' or 'off', got 'retry'",
        ),
        ({"nonfinite_suspect_steps": 0}, ValueError, "nonfinite_suspect_steps must be an int of at least 1, got 0"),
        ({"replica_check_every": -1}, ValueError, r"replica_check_every must be None or 0 \(off\) .*, got -1"),
        ({"replica_check_every": 2.5}, ValueError, r"replica_check_every must be None or 0 \(off\) .*, got 2.5"),
    ]:
        with pytest.raises(error, match=said):
            recovery_options(**keywords)
    assert recovery_options(collective_timeout=None, commit_timeout=None).collective_timeout_s is None


# --- every adapter takes them the same way ---------------------------------------------------------------


def _adapters() -> list[tuple[str, Any]]:
    pytest.importorskip("deepspeed")
    from ncclguard.integrations.accelerate import AcceleratorRecoveringStep, recovering_step
    from ncclguard.integrations.accelerate.deepspeed import AcceleratorDeepSpeedStep
    from ncclguard.integrations.deepspeed.commit import CommittedEngineStep
    from ncclguard.integrations.hf import guard_trainer
    from ncclguard.integrations.lightning import NcclGuardCallback
    from ncclguard.recovery.recovering import RecoveringStep

    return [
        ("RecoveringStep", RecoveringStep.__init__),
        ("guard_trainer", guard_trainer),
        ("NcclGuardCallback", NcclGuardCallback.__init__),
        ("recovering_step", recovering_step),
        ("AcceleratorRecoveringStep", AcceleratorRecoveringStep.__init__),
        ("AcceleratorDeepSpeedStep", AcceleratorDeepSpeedStep.__init__),
        ("CommittedEngineStep", CommittedEngineStep.__init__),
    ]


def test_every_adapter_takes_the_keywords_as_one_unpacked_declaration() -> None:
    for name, function in _adapters():
        params = inspect.signature(function).parameters
        copies = sorted(set(params) & set(RECOVERY_KEYWORDS))
        assert not copies, f"{name} declares {copies} itself"
        (var_keyword,) = [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        hint = typing.get_type_hints(function)[var_keyword.name]
        assert typing.get_origin(hint) is typing.Unpack and typing.get_args(hint) == (RecoveryKeywords,), name


def test_recovering_step_passes_every_keyword_to_the_engine(given: dict[str, Any]) -> None:
    from ncclguard.recovery.recovering import RecoveringStep

    stepper = RecoveringStep(*_model_and_optimizer(), **given)
    _assert_reached(stepper.engine.options, given)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'heal_chunk'"):
        RecoveringStep(*_model_and_optimizer(), heal_chunk=1)  # type: ignore[call-arg]


def test_guard_trainer_passes_every_keyword_to_the_engine(tmp_path: Path, given: dict[str, Any], fresh_accelerate):
    from tiny_trainer import tiny_trainer

    from ncclguard.integrations.hf import find_guard, guard_trainer

    trainer = guard_trainer(tiny_trainer(tmp_path / "out"), recover=True, watchdog=False, **given)
    guard = find_guard(trainer)
    assert guard is not None and guard.recovery is not None
    _assert_reached(guard.recovery.engine.options, given)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'heal_chunk'"):
        guard_trainer(tiny_trainer(tmp_path / "typo"), heal_chunk=1)  # type: ignore[call-arg]


def test_the_lightning_callback_passes_every_keyword_to_the_engine(given: dict[str, Any]) -> None:
    from ncclguard.integrations.lightning import NcclGuardCallback

    callback = NcclGuardCallback(recover=True, watchdog=False, **given)
    assert callback.recovery is not None
    _assert_reached(callback.recovery.engine.options, given)
    # Without recover, what only recovery does is refused, as guard_trainer refuses it.
    with pytest.raises(ValueError, match="snapshot_every needs recover=True and heal=True"):
        NcclGuardCallback(watchdog=False, snapshot_every=3)
    with pytest.raises(ValueError, match="snapshot_max_bytes needs recover=True and heal=True"):
        NcclGuardCallback(watchdog=False, snapshot_max_bytes=1 << 30)
    assert NcclGuardCallback(watchdog=False, heal=False, max_attempts=4).recovery is None


def test_the_accelerate_stepper_passes_every_keyword_to_the_engine(given: dict[str, Any], fresh_accelerate) -> None:
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import AcceleratorRecoveringStep, recovering_step

    accelerator = Accelerator(cpu=True)
    stepper = recovering_step(accelerator, *accelerator.prepare(*_model_and_optimizer()), **given)
    assert isinstance(stepper, AcceleratorRecoveringStep)
    _assert_reached(stepper.engine.options, given)
    with pytest.raises(TypeError, match="rebuild= builds a DeepSpeed engine's module afresh"):
        recovering_step(accelerator, *accelerator.prepare(*_model_and_optimizer()), rebuild=_model_and_optimizer)


def test_the_deepspeed_engine_step_passes_every_keyword_but_a_shrink(given: dict[str, Any]) -> None:
    pytest.importorskip("deepspeed")
    from ncclguard.integrations.deepspeed.commit import _engine_options

    with pytest.raises(ValueError, match="allow_shrink=True cannot go on with DeepSpeed ZeRO"):
        _engine_options(given, redo=True)
    kept = {**given, "allow_shrink": False}
    _assert_reached(_engine_options(kept, redo=True), kept)
    # Without rebuild_engine a failed step ends in a checkpoint: one attempt, whatever was asked.
    assert _engine_options(kept, redo=False).max_attempts == 1
    assert _engine_options({}, redo=True).max_attempts == 2
    with pytest.raises(ValueError, match="max_attempts must be an int of at least 2 with rebuild_engine"):
        _engine_options({"max_attempts": 1}, redo=True)


# --- heal by default under a supervisor's restarts --------------------------------------------------------


def test_heal_is_on_by_default_only_under_a_supervisors_restarts_and_without_allow_shrink(
    monkeypatch: pytest.MonkeyPatch, fresh_accelerate, caplog: pytest.LogCaptureFixture
) -> None:
    """``heal`` left out: on where ``python -m ncclguard.supervise --restarts N`` (N > 0) runs the rank
    (it sets NCCLGUARD_SUPERVISED_RESTARTS) and allow_shrink is not asked for; what the user passes wins."""
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step
    from ncclguard.recovery._rebuild.restarts import SUPERVISED_RESTARTS_VAR

    monkeypatch.delenv(SUPERVISED_RESTARTS_VAR, raising=False)
    assert (recovery_options().heal, recovery_options().heal_auto) == (False, True)
    for value, heal in (("0", False), ("3", True), ("x", False)):
        monkeypatch.setenv(SUPERVISED_RESTARTS_VAR, value)
        assert recovery_options().heal is heal and recovery_options(heal=None).heal is heal
    monkeypatch.setenv(SUPERVISED_RESTARTS_VAR, "2")
    assert recovery_options(allow_shrink=True).heal is False  # go on without the lost rank: no wait for it
    assert (recovery_options(heal=False).heal, recovery_options(heal=False).heal_auto) == (False, False)
    assert recovery_options(heal=True, allow_shrink=True).heal is True
    assert _stepper_options().heal is True
    # An adapter that cannot heal its stack turns the default off; heal=True asked for is refused.
    with caplog.at_level(logging.INFO, logger="ncclguard"):
        assert recovery_options().without_auto_heal("it cannot").heal is False
    said = [(r.levelno, r.getMessage().split("] ", 1)[-1]) for r in caplog.records if "heal is off" in r.getMessage()]
    assert said == [(logging.WARNING, "recovery: heal is off (it is on by default under restarts, but it cannot)")]
    with pytest.raises(ValueError, match="^it cannot$"):
        recovery_options(heal=True).without_auto_heal("it cannot")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    stepper = recovering_step(accelerator, *accelerator.prepare(*_model_and_optimizer()))
    assert stepper.engine.options.heal is False
    with pytest.raises(ValueError, match="heal=True cannot go with gradient_accumulation_steps=2"):
        recovering_step(accelerator, *accelerator.prepare(*_model_and_optimizer()), heal=True)


def _stepper_options() -> RecoveryOptions:
    """The options RecoveringStep builds with no keyword (in this process: no group, no rank)."""
    from ncclguard import RecoveringStep

    return RecoveringStep(*_model_and_optimizer()).engine.options


def test_the_deepspeed_engine_step_without_rebuild_engine_turns_the_default_heal_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("deepspeed")
    from ncclguard.integrations.deepspeed.commit import CommittedEngineStep
    from ncclguard.recovery._rebuild.restarts import SUPERVISED_RESTARTS_VAR

    monkeypatch.setenv(SUPERVISED_RESTARTS_VAR, "1")
    with pytest.raises(ValueError, match="heal=True needs rebuild_engine"):
        CommittedEngineStep(object(), checkpoint_dir="unused", heal=True)
    # heal by default: off without rebuild_engine, so the next check (the engine) is what refuses here.
    with pytest.raises(TypeError, match="engine"):
        CommittedEngineStep(object(), checkpoint_dir="unused")


def test_a_scheduler_that_steps_the_optimizer_must_be_given_to_a_step_that_heals(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_accelerate
) -> None:
    """Seen on an Accelerate loop with a warm-up schedule: a rank healed from a peer got the model and
    the optimizer, not the schedule, and the ranks' parameters differed at the end. heal=True without
    the scheduler is refused before any communication; the default heal says so in the log."""
    from accelerate import Accelerator

    from ncclguard import RecoveringStep
    from ncclguard.integrations.accelerate import recovering_step
    from ncclguard.recovery._rebuild.restarts import SUPERVISED_RESTARTS_VAR
    from ncclguard.recovery.recovering import driven_by_a_scheduler

    module, opt = _model_and_optimizer()
    assert not driven_by_a_scheduler(opt)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    assert driven_by_a_scheduler(opt)
    with pytest.raises(ValueError, match=r"an LR scheduler steps this optimizer .* Pass scheduler=<your scheduler>"):
        RecoveringStep(module, opt, heal=True)
    assert RecoveringStep(module, opt, heal=True, scheduler=schedule).scheduler is schedule
    RecoveringStep(module, opt, heal=False)  # nothing to heal: nothing to say
    monkeypatch.setenv(SUPERVISED_RESTARTS_VAR, "1")  # heal on by default: said, not refused
    with caplog.at_level("WARNING", logger="ncclguard"):
        assert RecoveringStep(module, opt).engine.options.heal is True
    assert "RecoveringStep: an LR scheduler steps this optimizer" in caplog.text
    # Accelerate: the prepared optimizer wraps the one the scheduler steps.
    accelerator = Accelerator(cpu=True)
    module, opt = _model_and_optimizer()
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, prepared = accelerator.prepare(module, opt)
    assert driven_by_a_scheduler(prepared)
    with pytest.raises(ValueError, match="Pass scheduler="):
        recovering_step(accelerator, model, prepared, heal=True)
    assert recovering_step(accelerator, model, prepared, heal=True, scheduler=schedule).scheduler is schedule
