"""integrations/shared.py: the watchdog argument, the timeout order, skip records, and the note for doctor.

Pure functions, no ranks, no framework import.
"""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from ncclguard import WatchdogConfig
from ncclguard.integrations.deepspeed import EvalReport
from ncclguard.integrations.shared import (
    HF_DDP_TIMEOUT_DEFAULT_S,
    SkippedEvaluation,
    skip_record,
    timeout_problems,
    trainer_timeout_notes,
    watchdog_config,
)


def test_the_watchdog_argument_forms():
    assert watchdog_config(False) is None
    assert watchdog_config(None) == WatchdogConfig() == watchdog_config(True)
    given = WatchdogConfig(heartbeat_s=1, hang_timeout_s=4)
    assert watchdog_config(given) is given
    assert watchdog_config({"heartbeat_s": 1, "hang_timeout_s": 4}) == given
    with pytest.raises(TypeError, match="watchdog must be a WatchdogConfig.*got str"):
        watchdog_config("on")
    with pytest.raises(ValidationError):
        watchdog_config({"no_such_field": 1})


def test_timeout_problems_name_each_value_not_below_the_group_timeout():
    assert timeout_problems(1800, 600, 300) == []
    assert timeout_problems(None, 9999, 9999) == []  # group timeout unknown: nothing to check
    both = timeout_problems(60, 60, 90)
    assert [p.split(" (")[0] for p in both] == ["watchdog hang timeout", "evaluation deadline"]


def test_the_trainer_note_for_doctor_names_ddp_timeout_and_what_breaks_its_order():
    assert HF_DDP_TIMEOUT_DEFAULT_S == 1800.0
    (head,) = trainer_timeout_notes()
    assert head.startswith("Hugging Face Trainer: the process-group timeout is TrainingArguments.ddp_timeout (1800 s")
    assert trainer_timeout_notes(eval_timeout_s=600, hang_timeout_s=300)[1:] == []
    head, hang_problem, eval_problem = trainer_timeout_notes(ddp_timeout_s=300, eval_timeout_s=600, hang_timeout_s=300)
    assert "(300 s, given)" in head
    assert hang_problem.startswith("watchdog hang timeout (300 s) is not below the process-group timeout (300 s)")
    assert eval_problem.startswith("evaluation deadline (600 s) is not below the process-group timeout (300 s)")
    assert all(p.endswith("(TrainingArguments.ddp_timeout=300)") for p in (eval_problem, hang_problem))
    for bad in (0, -5, "1800", True):
        with pytest.raises(ValueError, match="ddp_timeout_s must be a positive number of seconds"):
            trainer_timeout_notes(ddp_timeout_s=bad)


def test_a_skip_record_carries_the_last_agreed_reason():
    report = EvalReport(ok=False, value=None, attempts=2, reasons=["attempt 1: a", "attempt 2: b"])
    assert skip_record(report, 7, 1.5) == SkippedEvaluation(step=7, elapsed_s=1.5, reason="attempt 2: b")
    assert dataclasses.asdict(skip_record(None, None, 0.1)) == {"step": None, "elapsed_s": 0.1, "reason": ""}


def test_settings_an_integration_cannot_use_are_named_at_warning(tmp_path, caplog):
    """One watchdog per rank: a callback given watchdog= settings while one already runs (ncclguard
    run's, or the script's) keeps the running one, and says at WARNING which of its settings are not
    used and how to pass them; with no settings of its own it says nothing above INFO."""
    import logging

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import ncclguard
    from ncclguard.integrations.hf import TrainerGuardCallback
    from ncclguard.integrations.shared import settings_not_used, watchdog_given

    assert watchdog_given({"hang_timeout_s": 1}) and watchdog_given(WatchdogConfig())
    assert not watchdog_given(None) and not watchdog_given(True)
    assert settings_not_used(WatchdogConfig(), WatchdogConfig(), "x") is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    running = ncclguard.start_watchdog(heartbeat_s=0.5, hang_timeout_s=60)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        given = TrainerGuardCallback(watchdog={"hang_timeout_s": 120, "heartbeat_s": 0.5})
        plain = TrainerGuardCallback()
        with caplog.at_level(logging.INFO, logger="ncclguard"):
            given.on_train_begin(args, TrainerState(), TrainerControl())
            warned = [
                r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "not used" in r.getMessage()
            ]
            caplog.clear()
            plain.on_train_begin(args, TrainerState(), TrainerControl())
            quiet = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "these settings of watchdog= are not used: hang_timeout_s=120.0 (running: 60.0)" in warned[0]
        assert "pass them as --ncclguard-hang-timeout-s" in warned[0]
        assert quiet == [] and given.watchdog is None and plain.watchdog is None
        assert ncclguard.current_watchdog() is running
    finally:
        running.stop()
        dist.destroy_process_group()
