"""What differs by backend, named in one place: the rules a world's default group obeys.

Recovery does four things that depend on the backend, and each asks this module instead of testing
the backend's name where it acts:

- **what the device group carries**: gloo carries CPU tensors; NCCL carries CUDA tensors only (torch
  raises ``No backend type associated with device type cpu`` for a CPU tensor on a plain ``"nccl"``
  group). ncclguard's own transfers of CPU state (the heal, the snapshots) go over a side gloo group
  where the device group refuses CPU tensors (:attr:`BackendRules.carries_cpu`);
- **how survivors held in a collective are released** once a member is known dead: gloo's op ends
  only when a connection fails, so the release shuts this process's sockets to the live peers;
  NCCL's op is not woken by a socket (its data moves over NVLink or InfiniBand, and an error on one
  of its own sockets tears the process down under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), so the
  release aborts the communicators (``ProcessGroup.abort()``, as torch's ``_abort_process_group``
  and torchft's failed step do) (:attr:`BackendRules.release`);
- **how a step is bounded**: a gloo group's timeout can be lowered for the step and given back; an
  NCCL group's timeout ends in its watchdog tearing the process down, so a timer aborts the groups
  at the bound instead (:attr:`BackendRules.step_bound`);
- **the rebuild**: every old group is aborted, then destroyed (both backends; on gloo the abort
  wakes nothing and the rebuild's reaper ends the wait).

**The NCCL stand-in.** With ``NCCLGUARD_NCCL_STAND_IN=1`` a gloo world obeys NCCL's rules, so that
CI (no GPU) runs the kill, the stuck rank and the heal down the NCCL path at every commit:
ncclguard's own transports refuse a CPU tensor on the device group (:meth:`BackendRules.check_carry`),
no release shuts a socket, and a release or the step bound aborts the groups, which on the stand-in
also fails every op in flight, as NCCL's abort does (gloo's own abort does not). What the stand-in
cannot show (CUDA streams, NCCL's own error handling, its version's bugs) is in docs/nccl.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from ncclguard.errors import BackendRuleError

__all__ = [
    "NCCL_ERROR_HANDLING",
    "STAND_IN_VAR",
    "BackendRules",
    "ReleaseBy",
    "StepBoundBy",
    "rules_for",
    "rules_of",
    "stand_in_on",
]

STAND_IN_VAR = "NCCLGUARD_NCCL_STAND_IN"
# NCCL's error handling as ncclguard sets it (``env/netenv.py``): torch's default, 3 (SkipCleanUp: a
# rank whose op NCCL's own watchdog timed out is torn down; 2, CleanUpOnly, would abort its
# communicators and let it run on). Recovery does not rely on either: the step bound's timer aborts
# the groups first, being shorter than the groups' timeout (``ncclguard doctor`` checks the
# hierarchy), so NCCL's own timeout is the last resort.
NCCL_ERROR_HANDLING = "3"


class ReleaseBy(str, Enum):
    """How survivors held in a collective of a dead member are released."""

    SOCKETS = "sockets"  # shut this process's connections to the live peers (gloo)
    ABORT = "abort"  # abort the communicators (NCCL, and the stand-in)


class StepBoundBy(str, Enum):
    """How a step's collectives are bounded."""

    TIMEOUT = "timeout"  # the groups' own timeout, lowered for the step (gloo)
    ABORT_TIMER = "abort-timer"  # a timer that aborts the groups at the bound (NCCL, and the stand-in)


@dataclass(frozen=True)
class BackendRules:
    """The rules a world's default group obeys.

    Attributes:
        backend: what torch says of the group (``dist.get_backend``), e.g. ``"gloo"``, ``"nccl"``.
        stand_in: a gloo group obeying NCCL's rules (``NCCLGUARD_NCCL_STAND_IN``).
        carries_cpu: the group carries CPU tensors.
        release: how survivors are released.
        step_bound: how a step is bounded.
    """

    backend: str
    stand_in: bool
    carries_cpu: bool
    release: ReleaseBy
    step_bound: StepBoundBy

    @property
    def nccl(self) -> bool:
        """True where NCCL's rules hold (real NCCL, or the stand-in)."""
        return not self.carries_cpu

    def check_carry(self, tensor: torch.Tensor, what: str) -> None:
        """Refuses a CPU tensor on a group that carries none, before any communication.

        Real NCCL refuses it too, with torch's own error; the stand-in's gloo group would carry it,
        so this is where the stand-in enforces the rule on ncclguard's transports.

        Args:
            tensor: what is about to go on the group.
            what: the transfer, for the message.

        Raises:
            BackendRuleError: ``tensor`` is on the CPU and the group carries no CPU tensor.
        """
        if not self.carries_cpu and tensor.device.type == "cpu":
            where = "the NCCL stand-in's default group (NCCLGUARD_NCCL_STAND_IN)" if self.stand_in else "an NCCL group"
            raise BackendRuleError(
                f"{what}: a CPU tensor on {where}, which carries device tensors only; "
                "send CPU state over a side gloo group (dist.new_group(backend='gloo')) or move it to the device"
            )


def stand_in_on() -> bool:
    """True when ``NCCLGUARD_NCCL_STAND_IN`` asks a gloo world to obey NCCL's rules.

    Raises:
        ValueError: the variable holds something other than ``0``/``1`` (or empty).
    """
    raw = os.environ.get(STAND_IN_VAR, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{STAND_IN_VAR} must be 1 (obey NCCL's rules on gloo) or 0/unset, got {raw!r}")
    return raw == "1"


def rules_of(backend: str, stand_in: bool = False) -> BackendRules:
    """The rules of a group whose backend torch names ``backend``.

    A mixed group (``"cpu:gloo,cuda:nccl"``) carries CPU tensors over its gloo part but its device
    ops are NCCL's: released and bounded by an abort. Any backend but gloo (NCCL, UCC, MPI, XCCL) is
    released and bounded by an abort: a socket wakes none of them. The stand-in applies to a group
    on gloo alone.

    Args:
        backend: ``str(dist.get_backend(group))``.
        stand_in: obey NCCL's rules on a gloo group.
    """
    parts = {p.split(":")[-1] for p in backend.lower().split(",")}
    if parts == {"gloo"}:
        if stand_in:
            return BackendRules(backend, True, False, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER)
        return BackendRules(backend, False, True, ReleaseBy.SOCKETS, StepBoundBy.TIMEOUT)
    carries_cpu = bool(parts & {"gloo", "mpi"})
    return BackendRules(backend, False, carries_cpu, ReleaseBy.ABORT, StepBoundBy.ABORT_TIMER)


def rules_for(group: dist.ProcessGroup | None = None) -> BackendRules:
    """The rules of ``group`` (default: the default group) as it runs now.

    Raises:
        ValueError: no process group, or ``NCCLGUARD_NCCL_STAND_IN`` holds a bad value.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("no process group: the backend's rules are asked after init_process_group")
    return rules_of(str(dist.get_backend(group)), stand_in_on())
