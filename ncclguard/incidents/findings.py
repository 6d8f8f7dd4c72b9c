"""What the analysis finds: where ranks are, culprits, findings, and the analysis as a whole."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ncclguard.incidents.base import CulpritReason, FindingKind, Model, OpRecord

__all__ = [
    "Analysis",
    "Culprit",
    "DesyncFinding",
    "Finding",
    "LostRank",
    "LostRanksFinding",
    "MismatchFinding",
    "P2PFinding",
    "SilentFinding",
    "StoreFinding",
    "Straggler",
    "StuckFinding",
    "Variant",
    "Whereabouts",
]


class Whereabouts(Model):
    """Where a rank is: its phase, its main thread's call site, and the op it is in."""

    rank: int
    phase: str = ""
    site: str = "?"
    func: str = ""  # the function at ``site`` (from the rank's stack), where its statement has one
    inflight: OpRecord | None = None
    host: str | None = None
    pid: int | None = None


class Straggler(Whereabouts):
    """A member of a group that is not in the op the others wait in."""

    last_seq: int = 0
    last_completed: int = 0
    stale_s: float | None = None  # set when its heartbeat stopped


class LostRank(Whereabouts):
    """A rank whose heartbeat stopped, outside any desync."""

    stale_s: float
    last_completed_by_group: dict[str, int] = Field(default_factory=dict)


class Culprit(Whereabouts):
    """A rank that is not where the others are."""

    why: CulpritReason
    group: str | None = None
    seq: int | None = None
    last_seq: int | None = None
    last_completed: int | None = None
    last_completed_by_group: dict[str, int] | None = None
    stale_s: float | None = None
    waiter: int | None = None  # p2p: the rank waiting for it
    waiter_op: str | None = None


class _OpFinding(Model):
    group: str
    seq: int
    op: str
    numel: int
    dtype: str
    phase: str = ""
    site: str = ""
    waiting_s: float
    # Numbered by the backend (torch's sequence number), not by ncclguard's records: the op may have
    # been issued from C++ (DDP's reducer, a functional collective), and ``site`` says so.
    backend: bool = False
    # The same op in the other numbering, where torch's flight recorder and ncclguard's records were
    # joined (Python issued it): the backend's number and name, and ncclguard's number.
    backend_seq: int | None = None
    backend_op: str = ""
    record_seq: int | None = None


class DesyncFinding(_OpFinding):
    kind: Literal[FindingKind.DESYNC] = FindingKind.DESYNC
    waiting: list[int]
    behind: list[Straggler] = Field(default_factory=list)
    stale_members: list[Straggler] = Field(default_factory=list, alias="lost")


class StuckFinding(_OpFinding):
    kind: Literal[FindingKind.STUCK] = FindingKind.STUCK
    waiting: list[int]


class Variant(Model):
    """The ranks that called one op/size/dtype at a mismatched number."""

    ranks: list[int]
    op: str
    numel: int
    dtype: str
    site: str = ""
    phase: str = ""


class MismatchFinding(_OpFinding):
    kind: Literal[FindingKind.MISMATCH] = FindingKind.MISMATCH
    variants: list[Variant]
    suspects: list[int]


class P2PFinding(Model):
    kind: Literal[FindingKind.P2P] = FindingKind.P2P
    rank: int
    op: str
    group: str
    seq: int
    peer: int
    numel: int
    dtype: str
    phase: str = ""
    site: str = ""
    waiting_s: float
    peer_waits_back: OpRecord | None = None  # the peer's op toward this rank in the same direction: a deadlock
    peer_matched: OpRecord | None = None  # the peer's op the other way: the transfer is under way
    peer_where: Whereabouts


class LostRanksFinding(Model):
    kind: Literal[FindingKind.RANKS_LOST] = FindingKind.RANKS_LOST
    ranks: list[LostRank]


class SilentFinding(Model):
    kind: Literal[FindingKind.SILENT] = FindingKind.SILENT
    ranks: list[int]
    note: str


class StoreFinding(Model):
    kind: Literal[FindingKind.STORE] = FindingKind.STORE
    text: str


Finding = Annotated[
    DesyncFinding | StuckFinding | MismatchFinding | P2PFinding | LostRanksFinding | SilentFinding | StoreFinding,
    Field(discriminator="kind"),
]


class Analysis(Model):
    """Culprits and victims, as :func:`ncclguard.incidents.analysis.analyse` finds them."""

    findings: list[Finding] = Field(default_factory=list)
    culprits: list[Culprit] = Field(default_factory=list)
    victims: list[int] = Field(default_factory=list)
    stale_ranks: list[int] = Field(default_factory=list, alias="lost")  # heartbeat stopped
    silent: list[int] = Field(default_factory=list)  # gave no statement
    summary: str = ""
