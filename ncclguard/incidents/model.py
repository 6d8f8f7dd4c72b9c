"""The typed incident model: what the watchdog publishes, what an incident says, and its file format.

Every value the watchdog reads back (from the store or from disk) is parsed into one of these
pydantic models; nothing is unpickled. Kinds, findings and culprit reasons are enums whose
*values* are the words written since format version 1 ("hang", "desync", "behind", ...), so files
and tests read the same; their *names* say which meaning of a word is meant (the value ``lost`` is
three things: :attr:`IncidentKind.PEERS_LOST`, :attr:`FindingKind.RANKS_LOST`,
:attr:`CulpritReason.STOPPED_BEATING`).

File format version 2 (``format_version: 2``) is version 1 plus:

- ``format_version`` instead of ``version``;
- a rank that stopped beating keeps its per-group completion counters in
  ``last_completed_by_group`` (version 1 put that dict in ``last_completed``, an int everywhere else);
- heartbeats and statements may carry ``backend_seq``: the backend's sequence number per group;
  statements ``backend_ops``: the op torch's flight recorder holds at that number; findings
  ``backend``: the op is numbered by the backend (it may have been issued from C++);
- incident kind ``desync``: a group's ranks stand at different backend sequence numbers;
- incident kind ``stuck``: a group's ranks stand at one backend sequence number, the op open;
- backend ops may carry ``record`` (ncclguard's record of the Python call that issued them) and
  findings ``backend_seq``, ``backend_op``, ``record_seq`` (the op in the other numbering);
- ``outside_stacks``: the stacks of ranks that could not speak for themselves (py-spy);
- straggler windows may carry ``arrivals``, ``backend_op`` and ``arrivals_run_delay_s`` (torch's
  flight-recorder times of the world group's collectives), and their evidence ``source`` and
  ``common_ops``: optional fields, which a reader that does not know them drops;
- rank dumps may carry ``track`` (where the main thread was: its phase or function, as spans) and
  ``backend`` (the newest entries of torch's flight recorder, whoever issued them: DDP's bucket
  all_reduces, FSDP's all_gathers), which the incident's pictures draw; whereabouts may carry
  ``func``, the function of the main thread's call site;
- straggler windows may carry ``input_s``, ``clock_offset_s`` and ``links``, their evidence
  ``input_frac``, ``peers_input_frac``, ``clock_offset_s`` and ``links``, straggler reports cause
  ``input`` and a ``culprit`` (docs/stragglers.md).
- incident kind ``numerics`` and the incident's ``numerics``: a NaN or an infinity in a gradient, or a
  replica that drifted, as the recovery engine's commit named it (docs/numerics.md): optional.

The model is split by role: :mod:`~ncclguard.incidents.base` (the enums, a flight record),
:mod:`~ncclguard.incidents.beats` (what the watchdog publishes), :mod:`~ncclguard.incidents.findings`
(what the analysis finds), :mod:`~ncclguard.incidents.straggler_model` (a straggler's figures),
:mod:`~ncclguard.incidents.numerics_model` (a numerical fault), and
this module (the files, and every name above, importable from here).

:func:`upgrade_incident` and :func:`upgrade_rank_dump` read both versions. The JSON schemas are
``Incident.model_json_schema()`` and ``RankDump.model_json_schema()`` (``python -m ncclguard
report --schema`` prints them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ncclguard.incidents.base import (
    FORMAT_VERSION,
    INCIDENT_KIND,
    RANK_DUMP_KIND,
    CulpritReason,
    FindingKind,
    IncidentKind,
    OpRecord,
)
from ncclguard.incidents.base import Model as _Model
from ncclguard.incidents.beats import (
    ActionEntry,
    BackendOp,
    FenceNote,
    Heartbeat,
    IncidentDoc,
    MergedNote,
    PeerView,
    Statement,
)
from ncclguard.incidents.findings import (
    Analysis,
    Culprit,
    DesyncFinding,
    Finding,
    LostRank,
    LostRanksFinding,
    MismatchFinding,
    P2PFinding,
    SilentFinding,
    StoreFinding,
    Straggler,
    StuckFinding,
    Variant,
    Whereabouts,
)
from ncclguard.incidents.numerics_model import (
    DriftReport,
    FlaggedBucket,
    NamedRank,
    NonFiniteReport,
    NumericsReport,
)
from ncclguard.incidents.straggler_model import (
    MAX_ARRIVALS,
    Arrival,
    StragglerReport,
    StragglerWindow,
    WindowEvidence,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_ARRIVALS",
    "ActionEntry",
    "Arrival",
    "BackendOp",
    "Culprit",
    "CulpritReason",
    "DesyncFinding",
    "Finding",
    "FindingKind",
    "Heartbeat",
    "HeadView",
    "HeartbeatView",
    "Incident",
    "IncidentDoc",
    "IncidentKind",
    "LostRank",
    "LostRanksFinding",
    "MergedNote",
    "MismatchFinding",
    "NoView",
    "OpRecord",
    "OutsideStack",
    "P2PFinding",
    "PeerView",
    "RankDump",
    "RankView",
    "SilentFinding",
    "Statement",
    "StatementView",
    "StoreFinding",
    "Straggler",
    "StragglerReport",
    "StragglerWindow",
    "WindowEvidence",
    "StuckFinding",
    "Variant",
    "Whereabouts",
    "upgrade_incident",
    "upgrade_rank_dump",
]
__all__ += ["Analysis", "BackendEntry", "FenceNote", "INCIDENT_KIND", "RANK_DUMP_KIND", "TrackSpan"]
__all__ += ["DriftReport", "FlaggedBucket", "NamedRank", "NonFiniteReport", "NumericsReport"]


class StatementView(Statement):
    source: Literal["statement"] = "statement"


class HeadView(StatementView):
    """A rank's statement as its head (:meth:`Statement.head`): above 1,024 ranks the report holds the
    whole statements of the culprits and a few victims only; each rank's whole statement is in its
    host's ``rank<N>.json``."""

    source: Literal["head"] = "head"  # type: ignore[assignment]


class HeartbeatView(Heartbeat):
    source: Literal["heartbeat"] = "heartbeat"


class NoView(_Model):
    source: Literal["none"] = "none"


RankView = Annotated[StatementView | HeadView | HeartbeatView | NoView, Field(discriminator="source")]


class OutsideStack(_Model):
    """A rank's stacks taken from outside its process (py-spy), or why there are none."""

    rank: int
    host: str
    pid: int
    tool: str = "py-spy dump --native"
    text: str | None = None
    error: str | None = None
    how: str = ""  # what to run to get them by hand


class Incident(Analysis):
    """The merged incident: the content of ``incident.json``."""

    kind: Literal["ncclguard-incident"] = INCIDENT_KIND
    format_version: Literal[2] = FORMAT_VERSION
    incident: IncidentDoc
    written_at: float
    merged_by: int  # -1: merged by ``python -m ncclguard report`` from the rank dumps
    world_size: int
    statements_from: list[int]
    missing_statements: list[int]
    ranks: dict[str, RankView] = Field(default_factory=dict)
    # Ranks that could not speak for themselves (lost, silent): their stacks from outside.
    outside_stacks: dict[str, OutsideStack] = Field(default_factory=dict)


class TrackSpan(_Model):
    """A stretch of time the main thread spent in one place: one phase, or outside any phase, one
    function (the user's frame above the frameworks), as the watchdog saw it at each tick."""

    start: float  # time.time() of the first tick that saw it there
    end: float  # ... of the last one
    phase: str = Field("", max_length=400)
    func: str = Field("", max_length=200)  # the function of the user's frame ("evaluate", "<module>")
    site: str = Field("", max_length=1000)  # file:line of the user's frame at the first tick

    @property
    def label(self) -> str:
        """What the span is called in a picture: its phase, else its function."""
        return self.phase or (f"{self.func}()" if self.func and not self.func.startswith("<") else self.func) or "?"


class BackendEntry(_Model):
    """One op of torch's own flight recorder, whoever issued it (Python, DDP's reducer, FSDP)."""

    group: str
    seq: int  # collective_seq_id, or p2p_seq_id for a send/recv
    p2p: bool = False
    name: str  # profiling_name, e.g. "gloo:all_reduce"
    numel: int = 0
    created: float  # time.time() when this rank's backend enqueued it
    open: bool | None = None  # not completed on this rank when read; None where nothing tells


class RankDump(_Model):
    """One rank's dump of an incident: ``rank<r>.json``."""

    kind: Literal["ncclguard-rank-dump"] = RANK_DUMP_KIND
    format_version: Literal[2] = FORMAT_VERSION
    incident: IncidentDoc
    statement: Statement
    threads: dict[str, list[str]] = Field(default_factory=dict)
    records: list[OpRecord] = Field(default_factory=list)
    heartbeats: dict[str, Heartbeat] = Field(default_factory=dict)
    waiting_after_s: float = 0.0
    watchdog: dict[str, Any] | None = None  # the WatchdogConfig in force
    ladder: list[str] | None = None  # the rungs configured
    actions: list[ActionEntry] = Field(default_factory=list)
    track: list[TrackSpan] = Field(default_factory=list)  # where the main thread was, oldest first
    backend: list[BackendEntry] = Field(default_factory=list)  # torch's flight recorder, oldest first


# ----------------------------------------------------------------------------- version 1


def _move_dict_completed(entry: dict[str, Any]) -> dict[str, Any]:
    if isinstance(entry.get("last_completed"), dict):
        entry = {**entry, "last_completed_by_group": entry["last_completed"]}
        entry.pop("last_completed")
    return entry


_KIND_NAMES = {INCIDENT_KIND: "an ncclguard incident", RANK_DUMP_KIND: "an ncclguard rank dump"}


def _check_kind(raw: Any, kind: str, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        found = raw.get("kind") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{what} is not {_KIND_NAMES[kind]} (kind={found!r})")
    return raw


def upgrade_incident(raw: Any, what: str = "the file") -> Incident:
    """Parses a merged incident of format version 1 or 2.

    Args:
        raw: the JSON data of ``incident.json``.
        what: how to name it in an error.

    Raises:
        ValueError: not an ncclguard incident, an unknown version, or a value that does not fit
            (``pydantic.ValidationError`` is a ``ValueError``).
    """
    raw = _check_kind(raw, INCIDENT_KIND, what)
    version = raw.get("format_version", raw.get("version"))
    if version == 1:
        raw = {k: v for k, v in raw.items() if k != "version"}
        raw["format_version"] = FORMAT_VERSION
        raw["culprits"] = [_move_dict_completed(c) for c in raw.get("culprits") or []]
        raw["findings"] = [
            {**f, "ranks": [_move_dict_completed(e) for e in f.get("ranks") or []]}
            if f.get("kind") == FindingKind.RANKS_LOST.value
            else f
            for f in raw.get("findings") or []
        ]
    elif version != FORMAT_VERSION:
        raise ValueError(f"{what} has format version {version!r}; this ncclguard reads versions 1 and 2")
    return Incident.model_validate(raw)


def upgrade_rank_dump(raw: Any, what: str = "the file") -> RankDump:
    """Parses a rank dump of format version 1 or 2 (see :func:`upgrade_incident`).

    Raises:
        ValueError: not an ncclguard rank dump, an unknown version, or a value that does not fit.
    """
    raw = _check_kind(raw, RANK_DUMP_KIND, what)
    version = raw.get("format_version", raw.get("version"))
    if version == 1:
        raw = {k: v for k, v in raw.items() if k != "version"}
        raw["format_version"] = FORMAT_VERSION
    elif version != FORMAT_VERSION:
        raise ValueError(f"{what} has format version {version!r}; this ncclguard reads versions 1 and 2")
    return RankDump.model_validate(raw)
