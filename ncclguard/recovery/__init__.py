"""Recovery in process: a failed world group rebuilt from the live ranks, and training goes on."""

from ncclguard.recovery._rebuild.reaper import reaper
from ncclguard.recovery.commit import CommitResult, committed_step, should_commit
from ncclguard.recovery.engine import Adapter, Recovery
from ncclguard.recovery.fsdp2 import FSDP2
from ncclguard.recovery.heal import HealResult, heal_from_peer
from ncclguard.recovery.options import recovery_options
from ncclguard.recovery.rebuild import RebuildResult, generation, rebuild_world
from ncclguard.recovery.records import Recovered, StepResult
from ncclguard.recovery.recovering import RecoveringStep
from ncclguard.recovery.rejoin import rejoin_world, restart_count

__all__ = [
    "Adapter",
    "Recovered",
    "Recovery",
    "recovery_options",
    "CommitResult",
    "committed_step",
    "should_commit",
    "FSDP2",
    "RecoveringStep",
    "StepResult",
    "RebuildResult",
    "generation",
    "rebuild_world",
    "reaper",
    "HealResult",
    "heal_from_peer",
    "rejoin_world",
    "restart_count",
]
