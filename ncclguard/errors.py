"""The exceptions ncclguard reports. A failed safe_* call returns one in its result's ``error``."""

from __future__ import annotations

from typing import Any

__all__ = [
    "NcclGuardError",
    "CollectiveError",
    "CollectiveTimeout",
    "CollectiveFailed",
    "CollectiveMismatch",
    "GroupFailed",
    "TorchCompatError",
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


class GroupFailed(NcclGuardError):
    """The group timed out or failed earlier; its communicator cannot be trusted any more.

    Make a new group (``torch.distributed.new_group`` over the same ranks) to go on.
    """


class TorchCompatError(NcclGuardError, RuntimeError):
    """This torch lacks, or changed, a private torch.distributed API that ncclguard reads.

    The message names the API and the torch version; see :mod:`ncclguard._torch_compat`.
    """
