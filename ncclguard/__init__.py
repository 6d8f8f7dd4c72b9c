"""ncclguard: distributed PyTorch jobs that stop dying in silent hangs.

Without a line of code: ``ncclguard run --nproc-per-node 8 train.py`` (torchrun with the watchdog on
in every rank), or ``NCCLGUARD_AUTO=1`` under a plain ``torchrun`` or ``srun``. In code, the face is
twenty names, by what they are for:

- watch and name the culprit: :func:`start_watchdog`, :class:`WatchdogConfig`, :func:`current_watchdog`,
  :func:`phase`, :func:`mark_step`;
- collectives that return by a deadline: :func:`safe_all_reduce`, :func:`safe_barrier`,
  :func:`sigalrm_timeout`, :func:`configure`, :func:`init_process_group`;
- an evaluation that cannot hang the job: :func:`guarded_evaluate`;
- recovery: :func:`should_commit`, :class:`RecoveringStep`, :class:`FSDP2`, :func:`rebuild_world`,
  :func:`rejoin_world`, :func:`heal_from_peer`, :func:`restart_count`;
- what calls return and raise: :class:`Result` (every result: ``ok``, ``error``, ``elapsed_s``,
  truthy when ok, ``raise_for_error()``), :class:`NcclGuardError` (every error; the hierarchy is in
  :mod:`ncclguard.errors`).

Names this package exported before (the other errors, the result classes, the recorder, ...) still
import from here for one release, with a ``DeprecationWarning`` that names their module.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names are imported when first used (see _FACE below)
    from ncclguard.collectives.all_reduce import safe_all_reduce
    from ncclguard.collectives.barrier import safe_barrier
    from ncclguard.config import configure
    from ncclguard.env.pginit import init_process_group
    from ncclguard.errors import NcclGuardError
    from ncclguard.evaluation.guard import guarded_evaluate
    from ncclguard.recording.phase import phase
    from ncclguard.recording.steps import mark_step
    from ncclguard.recovery import (
        FSDP2,
        RecoveringStep,
        heal_from_peer,
        rebuild_world,
        rejoin_world,
        restart_count,
        should_commit,
    )
    from ncclguard.results import Result
    from ncclguard.sigalrm import sigalrm_timeout
    from ncclguard.watching.base.settings import WatchdogConfig
    from ncclguard.watching.watchdog import current_watchdog, start_watchdog

__version__ = "0.1.0"

__all__ = [
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

# Each name of the face and its module, imported when the name is first used: ``import ncclguard``
# imports nothing heavy, so that a rank that only needs the watchdog (``ncclguard run``) does not
# import the recovery engine and the collectives (1.5 of 2.8 s on a loaded 2-core machine).
_FACE: dict[str, str] = {
    "FSDP2": "ncclguard.recovery",
    "NcclGuardError": "ncclguard.errors",
    "RecoveringStep": "ncclguard.recovery",
    "Result": "ncclguard.results",
    "WatchdogConfig": "ncclguard.watching.base.settings",
    "configure": "ncclguard.config",
    "current_watchdog": "ncclguard.watching.watchdog",
    "guarded_evaluate": "ncclguard.evaluation.guard",
    "heal_from_peer": "ncclguard.recovery",
    "init_process_group": "ncclguard.env.pginit",
    "mark_step": "ncclguard.recording.steps",
    "phase": "ncclguard.recording.phase",
    "rebuild_world": "ncclguard.recovery",
    "rejoin_world": "ncclguard.recovery",
    "restart_count": "ncclguard.recovery",
    "safe_all_reduce": "ncclguard.collectives.all_reduce",
    "safe_barrier": "ncclguard.collectives.barrier",
    "should_commit": "ncclguard.recovery",
    "sigalrm_timeout": "ncclguard.sigalrm",
    "start_watchdog": "ncclguard.watching.watchdog",
}

# A rank restarted alone by its supervisor must not make the job's first world again: importing
# ncclguard makes its init_process_group a stand-in (recovery/_rebuild/stand_in.py, which reads the same
# variable, recovery/_rebuild/restarts.py's RESTART_COUNT_VAR). Everywhere else nothing is imported here.
if os.environ.get("NCCLGUARD_RESTART_COUNT", "0").strip() not in ("", "0"):
    importlib.import_module("ncclguard.recovery._rebuild.stand_in")

_ERRORS = "ncclguard.errors"
# Names exported before the face shrank, each with its module: importable from here for one
# release (0.1.x), with a DeprecationWarning; import them from their module.
DEPRECATED: dict[str, str] = {
    **dict.fromkeys(
        (
            "BarrierFailed",
            "BarrierTimeout",
            "BenchCallFailed",
            "CollectiveError",
            "CollectiveFailed",
            "CollectiveMismatch",
            "CollectiveTimeout",
            "CommitFailed",
            "DeadlineExceeded",
            "DecodeError",
            "EvaluationFailed",
            "GroupFailed",
            "HealFailed",
            "MemoryRefused",
            "NoRoute",
            "RebuildFailed",
            "StoreRefused",
            "StoreTimeout",
            "StoreUnreachable",
            "TorchCompatError",
        ),
        _ERRORS,
    ),
    "BarrierResult": "ncclguard.collectives.barrier",
    "CollectiveResult": "ncclguard.collectives.all_reduce",
    "CommitResult": "ncclguard.recovery.commit",
    "Config": "ncclguard.config",
    "FlightRecord": "ncclguard.recording.flight",
    "HealResult": "ncclguard.recovery.heal",
    "ProcessGroupInit": "ncclguard.env.pginit",
    "RebuildResult": "ncclguard.recovery.rebuild",
    "StepResult": "ncclguard.recovery.records",
    "TimeoutHierarchy": "ncclguard.env.hierarchy",
    "Watchdog": "ncclguard.watching.watchdog",
    "current_phase": "ncclguard.recording.phase",
    "get_config": "ncclguard.config",
    "instrument": "ncclguard.recording.instrument",
    "record_ddp": "ncclguard.recording.ddp",
    "recorder": "ncclguard.recording.flight",
    "uninstrument": "ncclguard.recording.instrument",
}


def __getattr__(name: str) -> Any:
    """A name of the face, imported on first use; an old name, with a DeprecationWarning that says
    where it lives now; or a submodule (``ncclguard.recovery`` after a plain ``import ncclguard``)."""
    module = _FACE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next use is a plain attribute
        return value
    module = DEPRECATED.get(name)
    if module is not None:
        warnings.warn(
            f"ncclguard.{name} leaves the package's face in the next release: import it from {module} "
            f"(from {module} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'ncclguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
