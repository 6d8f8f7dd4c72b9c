"""The package's face: at most twenty names a user calls; every name it exported before still
imports from ``ncclguard`` for one release, with a DeprecationWarning naming its module, and from
that module without one; one result base shared by every result class."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import warnings

import pytest

import ncclguard
from ncclguard.results import Result

# The face before it shrank (0.1.0, 55 names): each one must still import, from here or its module.
OLD_FACE = (
    "BarrierFailed BarrierResult BarrierTimeout BenchCallFailed CollectiveError CollectiveFailed "
    "CollectiveMismatch CollectiveResult CollectiveTimeout CommitFailed CommitResult Config DeadlineExceeded "
    "DecodeError EvaluationFailed FSDP2 FlightRecord GroupFailed HealFailed HealResult MemoryRefused "
    "NcclGuardError NoRoute ProcessGroupInit RebuildFailed RebuildResult RecoveringStep StepResult StoreRefused "
    "StoreTimeout StoreUnreachable TimeoutHierarchy TorchCompatError Watchdog WatchdogConfig configure "
    "current_phase current_watchdog get_config heal_from_peer init_process_group instrument mark_step phase "
    "rebuild_world record_ddp recorder rejoin_world restart_count safe_all_reduce safe_barrier should_commit "
    "sigalrm_timeout start_watchdog uninstrument"
).split()


def test_the_face_is_twenty_names_a_user_calls() -> None:
    assert ncclguard.__all__ == [
        "FSDP2",
        "NcclGuardError",
        "RecoveringStep",
        "Result",
        "WatchdogConfig",
        "configure",
        "current_watchdog",
        "guarded_evaluate",
        "heal_from_peer",
        "init_process_group",
        "mark_step",
        "phase",
        "rebuild_world",
        "rejoin_world",
        "restart_count",
        "safe_all_reduce",
        "safe_barrier",
        "should_commit",
        "sigalrm_timeout",
        "start_watchdog",
    ]
    from ncclguard.evaluation.guard import guarded_evaluate

    assert ncclguard.guarded_evaluate is guarded_evaluate  # the evaluation guard is in the face
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace: dict[str, object] = {}
        exec("from ncclguard import *", namespace)  # no name of the face warns
    assert sorted(k for k in namespace if not k.startswith("__")) == sorted(ncclguard.__all__)


@pytest.mark.parametrize("name", OLD_FACE)
def test_every_old_name_imports_from_the_face_or_with_a_warning_from_its_module(name: str) -> None:
    if name in ncclguard.__all__:
        return
    module = ncclguard.DEPRECATED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        home = getattr(importlib.import_module(module), name)  # its module: no warning
    with pytest.warns(
        DeprecationWarning, match=rf"ncclguard\.{name} leaves the package's face.*from {module} import {name}"
    ):
        old = getattr(ncclguard, name)
    assert old is home
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec(f"from ncclguard import {name}", namespace)
    assert namespace[name] is home


def test_every_old_name_is_kept_and_nothing_else_is_deprecated() -> None:
    assert sorted(set(OLD_FACE) - set(ncclguard.__all__)) == sorted(ncclguard.DEPRECATED)
    with pytest.raises(AttributeError, match="module 'ncclguard' has no attribute 'nope'"):
        ncclguard.nope  # noqa: B018


def test_every_result_class_shares_the_base() -> None:
    from ncclguard.collectives.all_reduce import CollectiveResult
    from ncclguard.collectives.barrier import BarrierResult
    from ncclguard.errors import BarrierTimeout
    from ncclguard.evaluation.guard import EvalReport
    from ncclguard.recovery.commit import CommitResult
    from ncclguard.recovery.heal import HealResult
    from ncclguard.recovery.rebuild import RebuildResult
    from ncclguard.recovery.records import StepResult

    classes = [CollectiveResult, BarrierResult, CommitResult, StepResult, EvalReport, HealResult, RebuildResult]
    for cls in classes:
        assert issubclass(cls, Result), cls
        names = {f.name for f in dataclasses.fields(cls)}
        assert {"ok", "error", "elapsed_s"} <= names, cls
        assert "__bool__" not in vars(cls), f"{cls.__name__} repeats the base's __bool__"
    # Only StepResult adds to raise_for_error (a step not applied without an error still raises).
    assert [c.__name__ for c in classes if "raise_for_error" in vars(c)] == ["StepResult"]
    bad = BarrierResult(ok=False, missing_ranks=[1], elapsed_s=0.5, error=BarrierTimeout("rank 1 never came"))
    assert not bad and bad.elapsed_s == 0.5
    with pytest.raises(BarrierTimeout, match="rank 1 never came"):
        bad.raise_for_error()
    good = BarrierResult(ok=True, missing_ranks=[], elapsed_s=0.1)
    assert good and good.raise_for_error() is good
    assert not hasattr(CollectiveResult(True, "all_reduce(SUM)", 1, 4, 1, 1, 0.1), "__dict__")  # still slotted


def test_importing_the_face_imports_nothing_heavy() -> None:
    """A name is imported when first used: ``import ncclguard`` alone imports neither torch nor
    pydantic (a rank under ``ncclguard run`` imports only the watchdog's modules); a restarted
    rank's import still makes init_process_group its stand-in (recovery/_rebuild/stand_in.py)."""
    code = (
        "import sys, ncclguard\n"
        "print(sorted(m for m in ('torch', 'pydantic', 'ncclguard.recovery') if m in sys.modules))\n"
        "ncclguard.NcclGuardError\n"
        "print('torch' in sys.modules, 'ncclguard.errors' in sys.modules, ncclguard.results.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NCCLGUARD_AUTO", "NCCLGUARD_RESTART_COUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == ["[]", "False True ncclguard.results"], out.stderr
    code = "import ncclguard, torch.distributed as d\nprint(d.init_process_group.__module__)\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "NCCLGUARD_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "ncclguard.recovery._rebuild.stand_in"
