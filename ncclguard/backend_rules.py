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
  wakes nothing and the rebuild's reaper ends the wait);
- **NCCL's own error handling under recovery** (:func:`survivor_handling`): torch's default,
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, makes the group's watchdog end the process
  (``std::terminate``, exit -6) once NCCL reports a peer gone ("remote process exited"), within a
  second of the peer's death and before any recovery can act: seen on an H200 with two ranks, the
  survivor of a SIGKILLed peer torn down, both ranks restarted, nobody left to heal from
  (docs/nccl.md). Under recovery every NCCL group is made with 2 (CleanUpOnly: the watchdog aborts
  the communicator and the op fails in the step, which the engine redoes on a rebuilt world), and
  the watchdog's wait for its dump before it acts is bounded (the same run: the survivor's rebuild
  waited 60 s for it).

**The NCCL stand-in.** With ``NCCLGUARD_NCCL_STAND_IN=1`` a gloo world obeys NCCL's rules, so that
CI (no GPU) runs the kill, the stuck rank and the heal down the NCCL path at every commit:
ncclguard's own transports refuse a CPU tensor on the device group (:meth:`BackendRules.check_carry`),
no release shuts a socket, and a release or the step bound aborts the groups, which on the stand-in
also fails every op in flight, as NCCL's abort does (gloo's own abort does not). What the stand-in
cannot show (CUDA streams, NCCL's own error handling, its version's bugs) is in docs/nccl.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from ncclguard.errors import BackendRuleError

__all__ = [
    "DUMP_WAIT_VAR",
    "ERROR_HANDLING_VAR",
    "NCCL_ERROR_HANDLING",
    "RECOVERY_DUMP_WAIT_MS",
    "RECOVERY_ERROR_HANDLING",
    "STAND_IN_VAR",
    "BackendRules",
    "ReleaseBy",
    "StepBoundBy",
    "rules_for",
    "rules_of",
    "stand_in_on",
    "survivor_handling",
]

STAND_IN_VAR = "NCCLGUARD_NCCL_STAND_IN"
# NCCL's error handling as ncclguard sets it (``env/netenv.py``): torch's default, 3 (SkipCleanUp: a
# rank whose op NCCL's own watchdog timed out is torn down; 2, CleanUpOnly, would abort its
# communicators and let it run on). Recovery does not rely on either: the step bound's timer aborts
# the groups first, being shorter than the groups' timeout (``ncclguard doctor`` checks the
# hierarchy), so NCCL's own timeout is the last resort.
NCCL_ERROR_HANDLING = "3"
ERROR_HANDLING_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ERROR_HANDLING_ALIAS = "NCCL_ASYNC_ERROR_HANDLING"  # torch's deprecated name, still read
# Under recovery: 2, CleanUpOnly. torch's ProcessGroupNCCL tears the process down for 1 and 3
# (``SHOULD_TEAR_DOWN``) and aborts the communicator for 1 and 2 (``SHOULD_CLEAN_UP``): 2 is the one
# where a survivor of a peer's death lives on and its op fails instead.
RECOVERY_ERROR_HANDLING = "2"
DUMP_WAIT_VAR = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
# Under recovery, the dump wait. torch's watchdog sleeps four times this value for each failed op
# in its list before it aborts (torch 2.11: 15 s, so 60 s), and a rebuild that destroys the old
# group waits for that sleep. On an H200, 2000 cost 8.0 s per failed op and 16 s per kill. 250
# costs 1 s per failed op.
RECOVERY_DUMP_WAIT_MS = "250"


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


def survivor_handling(environ: Mapping[str, str], group_made: bool) -> tuple[dict[str, str], str | None]:
    """NCCL's error handling a survivor of a peer's death needs under recovery (pure).

    Two of torch's settings decide it, both read when a group is made. The first is the error
    handling: 3, torch's default, ends the process; 2 aborts the communicator and fails the op. The
    second is the dump wait (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 15 s in torch 2.11). For each
    failed op in its list, the watchdog sleeps four times that wait before it aborts, dump on or
    off. A rebuild that destroys the old group waits for those sleeps, so the wait is set to
    :data:`RECOVERY_DUMP_WAIT_MS`.

    Args:
        environ: the environment NCCL groups are (or were) made in.
        group_made: an NCCL group exists already, made with what ``environ`` said then.

    Returns:
        The variables to set for the groups made from now on (the dump wait where nothing set it;
        the error handling 2 unless it is 0 or 2 already: torchrun sets 1 for its workers), and a
        warning where a group already made tears a survivor down, or a setting is replaced (None
        where neither).
    """
    to_set = {} if DUMP_WAIT_VAR in environ else {DUMP_WAIT_VAR: RECOVERY_DUMP_WAIT_MS}
    raw = environ.get(ERROR_HANDLING_VAR, environ.get(_ERROR_HANDLING_ALIAS))
    value = None if raw is None else raw.strip()
    if value in ("0", RECOVERY_ERROR_HANDLING):  # 0: nothing acts on its own; recovery's abort does
        return to_set, None
    to_set[ERROR_HANDLING_VAR] = RECOVERY_ERROR_HANDLING
    given = "3, torch's default" if value is None else value
    ends = "torch's watchdog ends the process when a peer dies (exit -6), before recovery can act"
    if not group_made:
        if value is None:
            return to_set, None
        return to_set, (
            f"{ERROR_HANDLING_VAR}={value} is replaced by {RECOVERY_ERROR_HANDLING} for the ranks: with {value}, {ends}"
        )
    return to_set, (
        f"the world's NCCL group was made with {ERROR_HANDLING_VAR}={given} (torchrun sets 1 for its workers where "
        f"nothing is set): {ends}, until the first rebuild, whose groups are made with {RECOVERY_ERROR_HANDLING}; "
        f"set {ERROR_HANDLING_VAR}={RECOVERY_ERROR_HANDLING} in the job's environment, or launch with ncclguard run "
        "--ncclguard-restarts N, which does"
    )
