"""ncclguard: collectives that never hang, and reports that name the rank that stalled."""

from ncclguard.collectives.all_reduce import CollectiveResult, safe_all_reduce
from ncclguard.collectives.barrier import BarrierResult, safe_barrier
from ncclguard.config import Config, configure, get_config
from ncclguard.env.hierarchy import TimeoutHierarchy
from ncclguard.env.pginit import ProcessGroupInit, init_process_group
from ncclguard.errors import (
    BarrierFailed,
    BarrierTimeout,
    BenchCallFailed,
    CollectiveError,
    CollectiveFailed,
    CollectiveMismatch,
    CollectiveTimeout,
    CommitFailed,
    DeadlineExceeded,
    DecodeError,
    EvaluationFailed,
    GroupFailed,
    HealFailed,
    MemoryRefused,
    NcclGuardError,
    NoRoute,
    RebuildFailed,
    StoreRefused,
    StoreTimeout,
    StoreUnreachable,
    TorchCompatError,
)
from ncclguard.recording.ddp import record_ddp
from ncclguard.recording.flight import FlightRecord, recorder
from ncclguard.recording.instrument import instrument, uninstrument
from ncclguard.recording.phase import current_phase, phase
from ncclguard.recording.steps import mark_step
from ncclguard.recovery import (
    FSDP2,
    CommitResult,
    HealResult,
    RebuildResult,
    RecoveringStep,
    StepResult,
    heal_from_peer,
    rebuild_world,
    rejoin_world,
    restart_count,
    should_commit,
)
from ncclguard.sigalrm import sigalrm_timeout
from ncclguard.watching.watchdog import Watchdog, WatchdogConfig, current_watchdog, start_watchdog

__version__ = "0.1.0"

__all__ = [
    "BarrierFailed",
    "BarrierResult",
    "BarrierTimeout",
    "BenchCallFailed",
    "CollectiveError",
    "CollectiveFailed",
    "CollectiveMismatch",
    "CollectiveResult",
    "CollectiveTimeout",
    "CommitFailed",
    "CommitResult",
    "Config",
    "DeadlineExceeded",
    "DecodeError",
    "EvaluationFailed",
    "FSDP2",
    "FlightRecord",
    "GroupFailed",
    "HealFailed",
    "HealResult",
    "MemoryRefused",
    "NcclGuardError",
    "NoRoute",
    "ProcessGroupInit",
    "RebuildFailed",
    "RebuildResult",
    "RecoveringStep",
    "StepResult",
    "StoreRefused",
    "StoreTimeout",
    "StoreUnreachable",
    "TimeoutHierarchy",
    "TorchCompatError",
    "Watchdog",
    "WatchdogConfig",
    "configure",
    "current_phase",
    "current_watchdog",
    "get_config",
    "heal_from_peer",
    "init_process_group",
    "instrument",
    "mark_step",
    "phase",
    "rebuild_world",
    "record_ddp",
    "recorder",
    "rejoin_world",
    "restart_count",
    "safe_all_reduce",
    "safe_barrier",
    "should_commit",
    "sigalrm_timeout",
    "start_watchdog",
    "uninstrument",
]
