"""Every exception ncclguard raises or reports. A failed call returns one in its result's ``error``.

Each result (:class:`~ncclguard.CollectiveResult`, :class:`~ncclguard.BarrierResult`,
:class:`~ncclguard.RebuildResult`, the guarded evaluation's
:class:`~ncclguard.evaluation.guard.EvalReport`) has ``ok``, ``error`` (one of these
exceptions, or None), is truthy when ``ok``, and has ``raise_for_error()``.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "NcclGuardError",
    "CollectiveError",
    "CollectiveTimeout",
    "CollectiveFailed",
    "CollectiveMismatch",
    "BarrierTimeout",
    "BarrierFailed",
    "GroupFailed",
    "StoreUnreachable",
    "StoreTimeout",
    "StoreRefused",
    "TorchCompatError",
    "DeadlineExceeded",
    "EvaluationFailed",
    "RebuildFailed",
    "CommitFailed",
    "LoopDiverged",
    "HealFailed",
    "GeneratorsApart",
    "UnjudgedAction",
    "RestartRefused",
    "BackendRuleError",
    "SnapshotRefused",
    "SnapshotDamaged",
    "NoRoute",
    "BadInterface",
    "MemoryRefused",
    "BenchCallFailed",
    "NonFiniteGradient",
    "NonFiniteInput",
    "ReplicasDiverged",
]


class NcclGuardError(Exception):
    """Base of every ncclguard error."""


class CollectiveError(NcclGuardError):
    """A collective that did not complete. Carries what is known about it.

    Attributes:
        op: the operation, e.g. ``"all_reduce(SUM)"``.
        numel: elements of the tensor.
        dtype: the tensor's dtype, as text.
        group: the process group's name.
        chunk: the chunk being waited on (0-based) and the number of chunks, or None.
        elapsed_s: seconds from entry to the failure.
        missing_ranks: global ranks that never arrived, where known (sorted), else None.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        numel: int = 0,
        dtype: str = "",
        group: str = "",
        chunk: tuple[int, int] | None = None,
        elapsed_s: float = 0.0,
        missing_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.op, self.numel, self.dtype, self.group = op, numel, dtype, group
        self.chunk, self.elapsed_s, self.missing_ranks = chunk, elapsed_s, missing_ranks

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields as plain JSON-able data."""
        return {
            "type": type(self).__name__,
            "message": str(self),
            "op": self.op,
            "numel": self.numel,
            "dtype": self.dtype,
            "group": self.group,
            "chunk": list(self.chunk) if self.chunk else None,
            "elapsed_s": round(self.elapsed_s, 4),
            "missing_ranks": self.missing_ranks,
        }


class CollectiveTimeout(CollectiveError, TimeoutError):
    """The deadline passed before every rank completed the collective."""


class CollectiveFailed(CollectiveError):
    """The backend reported an error (a peer closed its connection, a NCCL error)."""


class CollectiveMismatch(CollectiveError):
    """The ranks called the same collective with different tensors or ops; nothing moved.

    Attributes:
        fingerprints: each rank's fingerprint, keyed by global rank.
    """

    def __init__(self, message: str, *, fingerprints: dict[int, dict[str, Any]], **fields: Any) -> None:
        super().__init__(message, **fields)
        self.fingerprints = fingerprints

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "fingerprints": {str(k): v for k, v in self.fingerprints.items()}}


class NonFiniteInput(CollectiveError):
    """``safe_all_reduce(check_finite=...)`` found a NaN or an infinity in some rank's input: nothing
    was reduced on any rank, each tensor holds its own values, and the group stays usable.

    Attributes:
        ranks: the global ranks whose input was not finite (sorted; the same on every rank).
        kinds: by those ranks, ``"NaN"`` or ``"Inf"``.
    """

    def __init__(self, message: str, *, ranks: list[int], kinds: dict[int, str], **fields: Any) -> None:
        super().__init__(message, **fields)
        self.ranks, self.kinds = list(ranks), dict(kinds)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "ranks": self.ranks, "kinds": {str(k): v for k, v in self.kinds.items()}}


class BarrierTimeout(CollectiveTimeout):
    """``safe_barrier``'s deadline passed before every rank arrived, or this rank arrived after the
    others had given up. ``missing_ranks`` names the ranks that were not there; the group stays
    usable (the barrier never touches the communicator)."""


class BarrierFailed(CollectiveFailed):
    """``safe_barrier`` could not run its round: the group's store did not answer."""


class GroupFailed(NcclGuardError):
    """The group timed out or failed earlier; its communicator cannot be trusted any more.

    Make a new group (``torch.distributed.new_group`` over the same ranks) to go on.
    """


class StoreUnreachable(NcclGuardError, RuntimeError):
    """The group's store did not answer (its server, usually on rank 0, is gone)."""


class TorchCompatError(NcclGuardError, RuntimeError):
    """This torch lacks, or changed, a private torch.distributed API that ncclguard reads.

    The message names the API and the torch version; see :mod:`ncclguard._torch_compat`.
    """


class StoreTimeout(NcclGuardError, TimeoutError):
    """One store call did not answer within its bound; the store may only be slow.

    The watchdog retries on its next tick; once the store stays silent for the peer timeout it
    takes it as gone (:class:`StoreUnreachable`).
    """


class StoreRefused(StoreTimeout):
    """The store closed this client's connection on one request, and a new connection was made:
    the server refused that request but still serves. The libuv TCPStore server drops a client
    whose ``add`` meets a value that is not a number ("Error processing client message: stoll",
    torch 2.13), so a key that ncclguard counts on holds something it did not write."""


class DeadlineExceeded(NcclGuardError, TimeoutError):
    """Python code ran past the deadline of :func:`ncclguard.sigalrm_timeout`.

    Not a collective's timeout (that is :class:`CollectiveTimeout`): the guarded block may hold
    any code. A ``TimeoutError``, so ``except TimeoutError`` catches it.

    Attributes:
        seconds: the deadline, in seconds from the guard's entry.
        elapsed_s: seconds from the guard's entry to the moment it fired.
    """

    def __init__(self, message: str, *, seconds: float = 0.0, elapsed_s: float = 0.0) -> None:
        super().__init__(message)
        self.seconds, self.elapsed_s = seconds, elapsed_s


class EvaluationFailed(NcclGuardError):
    """Every attempt of a guarded evaluation failed; every rank skipped it.

    Attributes:
        reasons: why each attempt failed, as the ranks agreed (one entry per attempt).
        failed_ranks: global ranks that failed or were missing in the last attempt.
    """

    def __init__(
        self, message: str, *, reasons: list[str] | None = None, failed_ranks: list[int] | None = None
    ) -> None:
        super().__init__(message)
        self.reasons = list(reasons or [])
        self.failed_ranks = list(failed_ranks or [])


class RebuildFailed(NcclGuardError):
    """:func:`ncclguard.rebuild_world` built no new world with this rank in it.

    Attributes:
        missing_ranks: old ranks that had not arrived (sorted).
        late: this rank arrived after the others had settled without it.
    """

    def __init__(self, message: str, *, missing_ranks: list[int] | None = None, late: bool = False) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks or [])
        self.late = late


class CommitFailed(NcclGuardError):
    """:func:`ncclguard.should_commit` found that a step may not be applied on every rank.

    Attributes:
        step: the commit's number in its world.
        failed_ranks: group ranks that failed the step or did not arrive (sorted).
        reasons: why, by failed rank.
        late: this rank arrived after the outcome was settled.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int = 0,
        failed_ranks: list[int] | None = None,
        reasons: dict[int, list[str]] | None = None,
        late: bool = False,
    ) -> None:
        super().__init__(message)
        self.step, self.late = step, late
        self.failed_ranks = list(failed_ranks or [])
        self.reasons = dict(reasons or {})


class LoopDiverged(CommitFailed):
    """The ranks' loops are at different steps, which no rebuild can mend: typically a restore
    sent every rank back to a snapshot's step and a loop written ``for step in range(...)`` went
    on from where it was. Raised on every rank at the commit that shows it."""


class HealFailed(NcclGuardError):
    """:func:`ncclguard.heal_from_peer` did not give the restarted ranks their state: a refusal
    (shapes, dtypes or sizes that do not match), a chunk past the deadline, or a failed group.
    Nothing was copied into the receiver's module or optimizer.

    Attributes:
        refused_ranks: ranks that refused what the source announced (sorted; empty otherwise).
    """

    def __init__(self, message: str, *, refused_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.refused_ranks = list(refused_ranks or [])


class GeneratorsApart(NcclGuardError, ValueError):
    """The ranks' random generators differ (a seed per rank) where ``heal=True`` asked for a heal
    from a live peer, which hands a restarted rank its peer's generators: the healed run could not
    be the run without the fault. Raised on every rank at the first commit that shows it, before
    the step is applied; it says which generators and how to seed instead."""


class NonFiniteGradient(NcclGuardError):
    """A step's gradient held a NaN or an infinity on some rank before the reduction spread it (the
    recovery engine's check, docs/numerics.md): the step was not applied on any rank. Raised on every
    rank alike with ``on_nonfinite="raise"``; the ``error`` of a step skipped otherwise.

    Attributes:
        step: the loop's step number (the count of steps applied when the loop passes none).
        ranks: the ranks whose contribution was not finite (sorted; the world's numbering then).
        buckets: by those ranks, each flagged bucket as ``{"index", "kind", "params", "more_params"}``
            (``kind``: ``"NaN"`` or ``"Inf"``; ``params``: the first parameter names in it).
        finite_ranks: the ranks whose checked contribution was finite.
        action: what the engine did: ``"redo"``, ``"skip"`` or ``"raise"``.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        ranks: list[int],
        buckets: dict[int, list[dict[str, Any]]],
        finite_ranks: list[int],
        action: str,
    ) -> None:
        super().__init__(message)
        self.step, self.ranks, self.buckets = step, list(ranks), dict(buckets)
        self.finite_ranks, self.action = list(finite_ranks), action


class ReplicasDiverged(NcclGuardError):
    """The recovery engine's replica check (docs/numerics.md, "Replicas checked") found the ranks'
    replicas apart with no digest held by a majority (two ranks that differ): which one drifted
    cannot be told, so none is healed. Raised on every rank alike, the step not applied.

    Attributes:
        step: the loop's step number.
        ranks: the ranks whose digests differ (sorted).
        parts: the parts that differ (``"parameters"``, ``"optimizer"``).
    """

    def __init__(self, message: str, *, step: int, ranks: list[int], parts: list[str]) -> None:
        super().__init__(message)
        self.step, self.ranks, self.parts = step, list(ranks), list(parts)


class UnjudgedAction(NcclGuardError, RuntimeError):
    """A lever that acts on a rank (a death notice, an ask to end it, a cut of its connections, a
    SIGKILL, an exit) was reached without the one judge's ruling that it may act
    (:mod:`ncclguard.watching.judge.rules`): a bug in ncclguard, refused before anything was done."""


class SnapshotRefused(HealFailed):
    """A snapshot's receiver refused its manifest (it does not fit the state held there): the
    sender was told and sent no payload; nothing was kept."""


class SnapshotDamaged(HealFailed):
    """A snapshot's bytes do not match their digest (damaged in memory or on the way)."""


class RestartRefused(NcclGuardError):
    """A supervisor did not restart its rank: a restarted process of the rank's command could not make
    the stand-in world (its interpreter loads neither ncclguard's start-up hook nor ncclguard), so it
    would make the job's first world again and wait there for ranks that are in a later one."""


class BackendRuleError(NcclGuardError, ValueError):
    """A transfer broke its group's backend rule (a CPU tensor on a group that carries device tensors
    only: NCCL, or the NCCL stand-in, :mod:`ncclguard.backend_rules`); raised before any communication."""


class NoRoute(NcclGuardError, LookupError):
    """The kernel has no route to the address (``Network is unreachable``)."""


class BadInterface(NcclGuardError, ValueError):
    """A socket interface the user named (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) does not exist
    on this host or has no route to ``MASTER_ADDR``; the message lists the routes that do exist."""


class MemoryRefused(NcclGuardError, ValueError):
    """The benchmark's sizes do not fit in memory; the message says what would."""


class BenchCallFailed(NcclGuardError, RuntimeError):
    """A guarded call in the benchmark returned an error; the group cannot be used any more."""


class DecodeError(NcclGuardError, ValueError):
    """A value read from the store that does not decode.

    Attributes:
        what: the value's name, as the caller gave it (a key, "rank 3's arrival").
        model: the name of the model it had to fit.
        reason: ``"size"`` (over the bound), ``"invalid"`` (not JSON, or not the model's shape) or
            ``"non-finite"`` (a NaN or infinite float).
        size: its length in bytes.
        limit: the bound it was read under.
        detail: the first complaint, in pydantic's words (``"Field required"``) or the bad float.
    """

    def __init__(
        self,
        text: str,
        *,
        what: str,
        model: str,
        reason: Literal["size", "invalid", "non-finite"],
        size: int,
        limit: int,
        detail: str,
    ) -> None:
        super().__init__(text)
        self.what, self.model, self.reason = what, model, reason
        self.size, self.limit, self.detail = size, limit, detail


__all__ += ["DecodeError"]
