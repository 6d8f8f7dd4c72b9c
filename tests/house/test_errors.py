"""One error model: every exception in ncclguard/errors.py, the hierarchy under NcclGuardError; every result alike."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import ncclguard
from ncclguard import errors
from ncclguard.errors import CollectiveTimeout, DeadlineExceeded, EvaluationFailed, RebuildFailed
from ncclguard.evaluation.guard import EvalReport, guarded_evaluate, last_report

ROOT = Path(__file__).resolve().parents[2]


def test_every_error_is_in_errors_all_and_derives_from_the_base():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert {c.__name__ for c in classes} == set(errors.__all__)
    for cls in classes:
        assert issubclass(cls, ncclguard.NcclGuardError), cls
    # The face carries the base only; tests/house/test_face.py checks the old names' deprecation.
    assert [n for n in ncclguard.__all__ if n in errors.__all__] == ["NcclGuardError"]


def test_no_exception_class_is_defined_outside_errors_py():
    # Internal signals that never reach a user: the collectives' DeadlinePassed becomes a
    # CollectiveTimeout; the adapter protocol's Reenter unwinds a framework's loop and its adapter catches it.
    allowed = {("ncclguard/collectives/completion.py", "DeadlinePassed"), ("ncclguard/recovery/adapter.py", "Reenter")}
    found = set()
    for path in [*ROOT.glob("ncclguard/**/*.py"), *ROOT.glob("integrations/*.py")]:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and rel != "ncclguard/errors.py":
                bases = {ast.unparse(b) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Timeout", "Refused", "Failed")) for b in bases):
                    found.add((rel, node.name))
    assert found <= allowed


def test_deadline_exceeded_and_rebuild_failed():
    e = DeadlineExceeded("late", seconds=1.0, elapsed_s=1.01)
    assert isinstance(e, TimeoutError) and not isinstance(e, CollectiveTimeout)
    assert (e.seconds, e.elapsed_s) == (1.0, 1.01)
    r = RebuildFailed("ranks [3] never came", missing_ranks=[3], late=False)
    assert (str(r), r.missing_ranks, r.late) == ("ranks [3] never came", [3], False)


def test_eval_report_is_a_result():
    ok = EvalReport(ok=True, value=1.0, attempts=1)
    assert ok and ok.error is None and ok.raise_for_error() is ok
    failed = EvaluationFailed("skipped", reasons=["attempt 1: x"], failed_ranks=[1])
    bad = EvalReport(ok=False, value=None, attempts=1, reasons=["attempt 1: x"], failed_ranks=[1], error=failed)
    assert not bad
    with pytest.raises(EvaluationFailed) as info:
        bad.raise_for_error()
    assert info.value.failed_ranks == [1] and info.value.reasons == ["attempt 1: x"]


def test_single_process_guard_reports_its_error_as_an_exception():
    import torch

    def boom() -> float:
        raise ValueError("bad batch")

    # Hang guards: the ValueError, not the deadline, must end the first call, and the second must
    # succeed, however slow a loaded machine runs them.
    assert guarded_evaluate(torch.nn.Linear(1, 1), boom, eval_timeout_s=30, fallback="skipped") == "skipped"
    report = last_report()
    assert report is not None and not report and isinstance(report.error, EvaluationFailed)
    assert "ValueError: bad batch" in str(report.error) and report.error.reasons == report.reasons
    assert guarded_evaluate(torch.nn.Linear(1, 1), lambda: 2.0, eval_timeout_s=30) == 2.0
    assert last_report().raise_for_error().value == 2.0
