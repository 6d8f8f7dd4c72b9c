"""The typed incident model: what the watchdog publishes, what an incident says, and its file format.

Every value the watchdog reads back (from the store or from disk) is parsed into one of these
pydantic models; nothing is unpickled. Kinds, findings and culprit reasons are enums whose
*values* are the words written since format version 1 ("hang", "desync", "behind", ...), so files
and tests read the same; their *names* say which meaning of a word is meant (``lost`` used to mean
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
  ``common_ops``: optional fields, which a reader that does not know them drops; later also
  ``input_s``, ``clock_offset_s`` and ``links`` (windows), ``input_frac``, ``peers_input_frac``,
  ``clock_offset_s`` and ``links`` (evidence), cause ``input`` and ``culprit`` (straggler reports).

:func:`upgrade_incident` and :func:`upgrade_rank_dump` read both versions. The JSON schemas are
``Incident.model_json_schema()`` and ``RankDump.model_json_schema()`` (``python -m ncclguard
report --schema`` prints them).
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "FORMAT_VERSION",
    "MAX_ARRIVALS",
    "MAX_LINKS",
    "ActionEntry",
    "Arrival",
    "BackendOp",
    "Culprit",
    "CulpritReason",
    "DesyncFinding",
    "Finding",
    "FindingKind",
    "Heartbeat",
    "HeartbeatView",
    "Incident",
    "IncidentDoc",
    "IncidentKind",
    "LostRank",
    "LinkSample",
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

FORMAT_VERSION: Literal[2] = 2
INCIDENT_KIND: Literal["ncclguard-incident"] = "ncclguard-incident"
RANK_DUMP_KIND: Literal["ncclguard-rank-dump"] = "ncclguard-rank-dump"


class IncidentKind(str, Enum):
    """Why an incident was raised."""

    HANG = "hang"  # an op of the raising rank stayed in flight past hang_timeout_s
    BACKEND_DESYNC = "desync"  # a group's ranks stand at different backend sequence numbers, none moving
    PEERS_LOST = "lost"  # watched peers' heartbeats stopped changing for peer_timeout_s
    STORE_GONE = "store"  # the rendezvous store stopped answering (handled on each rank alone)
    BACKEND_STUCK = "stuck"  # a group's ranks stand at one backend sequence number, its op open past the timeout
    STRAGGLER = "straggler"  # a rank slower than its peers window after window (a report, never escalated)


class FindingKind(str, Enum):
    """What the analysis found in a group, or about the ranks."""

    DESYNC = "desync"  # some members wait in an op, others are elsewhere
    STUCK = "stuck"  # every member waits in the same op: the transport, not a desync
    MISMATCH = "mismatch"  # members wait at the same number in different ops, sizes or dtypes
    P2P = "p2p"  # a send/recv whose peer is not in the matching op
    RANKS_LOST = "lost"  # ranks whose heartbeat stopped, outside any desync
    SILENT = "silent"  # ranks that gave no statement (their watchdog thread did not run)
    STORE = "store"  # the store went away; a text only


class CulpritReason(str, Enum):
    """Why a rank is named a culprit."""

    BEHIND = "behind"  # a member that had not issued the op the others wait in
    MISMATCH = "mismatch"  # called a different op at the same number than the majority
    P2P = "p2p"  # has not posted the send/recv its peer waits for
    STOPPED_BEATING = "lost"  # its heartbeat stopped: died, or frozen holding the GIL


class _Model(BaseModel):
    # Unknown fields are dropped, not refused: a file or a peer from a newer release still reads.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        """The model as plain JSON data, with the on-disk field names."""
        return self.model_dump(mode="json", by_alias=True)


class OpRecord(_Model):
    """One flight record (see :class:`ncclguard.recording.flight.FlightRecord`) as plain data."""

    seq: int
    op: str
    group: str
    numel: int = 0
    dtype: str = ""
    start: float
    state: str = "started"
    end: float | None = None
    phase: str = ""
    site: str = ""
    error: str | None = None
    async_op: bool = False
    peer: int | None = None
    thread: int = 0
    # A chunked call's progress: chunks completed of ``chunks``, and bytes reduced (0: not chunked).
    chunks_done: int = 0
    chunks: int = 0
    bytes_done: int = 0


# A collective's backend number and the time.time() a rank reached it (torch's time_created_ns).
Arrival = tuple[Annotated[int, Field(ge=0)], Annotated[float, Field(allow_inf_nan=False)]]
MAX_ARRIVALS = 32  # arrivals a window carries: about 1 KB of the heartbeat
# A TCP connection's traffic over a window, from the sender's side (Linux TCP_INFO): its local and
# peer addresses, the bytes the peer acknowledged, and the seconds it had data in flight less the
# time the receiver's window held it back (docs/stragglers.md, "Links").
LinkSample = tuple[
    Annotated[str, Field(max_length=64)],
    Annotated[str, Field(max_length=64)],
    Annotated[float, Field(ge=0, allow_inf_nan=False)],
    Annotated[float, Field(ge=0, allow_inf_nan=False)],
]
MAX_LINKS = 8  # link samples a window carries, the busiest first


class StragglerWindow(_Model):
    """One rank's figures over one straggler window (published in its heartbeat).

    ``compute_s`` is the window's time outside collectives, ``wait_s`` the time its main thread spent
    inside synchronous collectives; ``op_wait_s`` the median time of one of them that moves 16,384
    elements or more (the transfer itself when this rank is the last to arrive)."""

    n: int = Field(ge=0)  # the window's number on this rank
    end: float  # time.time() when it closed
    length_s: float = Field(gt=0)  # the span covered (the records may not reach back the whole window)
    compute_s: float = Field(ge=0)
    wait_s: float = Field(ge=0)
    ops: int = Field(0, ge=0)  # collectives completed in the window
    op_wait_s: float = Field(0.0, ge=0)  # the median time of one op large enough to time the link
    transfer_ops: int = Field(0, ge=0)  # those ops (16,384 elements or more)
    steps: int | None = Field(None, ge=0)  # step marks in the window (ncclguard.mark_step)
    # The time its main thread was runnable but not running (waiting for a CPU: Linux's schedstat run
    # delay), None where the OS does not tell: compute the host took from it, not work it did.
    run_delay_s: float | None = Field(None, ge=0)
    phase: str = Field("", max_length=200)  # where most of the compute went
    op: str = Field("", max_length=80)  # where most of the wait went
    # When the main thread's records hold too few ops (a loop that only calls DDP: its bucket
    # all_reduce is issued from C++) and the backend ran more: the newest collectives of the world
    # group in the window as torch's flight recorder numbers and times them, (collective_seq_id,
    # time.time() when this rank reached the op), and torch's name of the op ("gloo:all_reduce").
    arrivals: list[Arrival] = Field(default_factory=list, max_length=MAX_ARRIVALS)
    backend_op: str = Field("", max_length=80)
    # The main thread's run delay between its first and last arrival (the span the arrivals judge),
    # from the watchdog's samples at each tick; None where not sampled.
    arrivals_run_delay_s: float | None = Field(None, ge=0)
    # The main thread's time in the input pipeline (a DataLoader's next batch), None where not timed;
    # this rank's wall clock less the reference rank's, as the store's notifications measure it;
    # its TCP connections' traffic (none where they are not TCP, or the OS does not tell).
    input_s: float | None = Field(None, ge=0)
    clock_offset_s: float | None = Field(None, allow_inf_nan=False)
    links: list[LinkSample] = Field(default_factory=list, max_length=MAX_LINKS)


class WindowEvidence(_Model):
    """One window of a straggler incident as the raising rank assessed it."""

    n: int
    end: float
    compute_frac: float  # the rank's share of the window spent computing
    wait_frac: float  # ... and waiting in collectives
    peers_compute_frac: float  # the median over its fresh watched peers
    peers_wait_frac: float
    slowdown: float  # work_frac / peers_work_frac where known, otherwise compute_frac / peers_compute_frac
    # Where every rank compared tells its run delay: the share it was runnable without a CPU, and the
    # compute share less it (what the rank itself took), its own and its peers' median.
    run_delay_frac: float | None = None
    work_frac: float | None = None
    peers_work_frac: float | None = None
    op_wait_s: float  # the transfer: the least median op time among the rank and its peers
    baseline_op_wait_s: float | None = None  # the least seen in earlier windows
    phase: str = Field("", max_length=200)
    op: str = Field("", max_length=80)
    # Where the compute and wait figures come from: "records", ncclguard's records of the main
    # thread's synchronous collectives; "backend", the arrivals torch's flight recorder timed (ops
    # issued from C++ included), over ``common_ops`` ops every rank compared holds.
    source: Literal["records", "backend"] = "records"
    common_ops: int | None = None
    # The shares of the window spent in the input pipeline, its own and its peers' median (None
    # where a rank compared does not time it); the clock offset taken out of its arrivals; for a link,
    # each link's rate (source, destination, bytes a second) and the bytes it moved.
    input_frac: float | None = None
    peers_input_frac: float | None = None
    clock_offset_s: float | None = None
    links: list[LinkSample] = Field(default_factory=list, max_length=64)


class StragglerReport(_Model):
    """What a ``straggler`` incident says: who, how much slower, where the time goes, and the evidence."""

    rank: int  # the slow rank (compute, input), or the rank that raised it (link)
    cause: Literal["compute", "link", "input"]
    slowdown: float  # compute: its compute over its peers'; link: the transfer over its baseline
    where: str  # one line: "compute in phase 'train step=3'", "the transfer itself in all_reduce"
    ranks: list[int] = Field(default_factory=list, max_length=1024)  # link: the ranks whose transfers slowed
    culprit: str = Field("", max_length=200)  # one line: "rank 2", "host 198.18.1.3's link", "the link a <-> b"
    windows: list[WindowEvidence] = Field(default_factory=list, max_length=100)


class Heartbeat(_Model):
    """What a rank publishes every ``heartbeat_s``."""

    rank: int
    host: str
    pid: int
    beat: int
    time: float
    phase: str
    site: str
    last_seq: dict[str, int]
    last_completed: dict[str, int]
    inflight: list[OpRecord]
    blocked_in: OpRecord | None = None
    backend_seq: dict[str, int] | None = None  # the backend's sequence number per group, where read
    backend_still: dict[str, float] | None = None  # seconds each of those numbers had stood still
    step: int | None = None  # the training step the rank is in, where its loop marks steps
    straggler_score: float | None = None  # 1.0: as fast as the fastest peer; lower is slower
    window: StragglerWindow | None = None  # the last straggler window closed (docs/stragglers.md)


class BackendOp(_Model):
    """An op as torch's own flight recorder saw it, whoever issued it (Python or C++)."""

    seq: int  # the rank's backend sequence number in the group when read
    name: str  # profiling_name, e.g. "gloo:all_reduce"
    sizes: list[list[int]] = Field(default_factory=list)
    dtypes: list[str] = Field(default_factory=list)  # torch's scalar type names, e.g. "Float"
    created: float = 0.0  # time.time() when the backend enqueued it
    state: str = ""  # gloo: always "scheduled"; NCCL: scheduled, started, completed
    completed: bool | None = None  # by the recorder's per-group status (gloo too); None: unknown
    record: OpRecord | None = None  # ncclguard's record of the Python call that issued it, if one did


class PeerView(_Model):
    """How a rank sees one of the peers it watches."""

    age_s: float
    stale: bool
    seen: bool


class Statement(Heartbeat):
    """What a rank says about itself when it handles an incident: a heartbeat and more."""

    world_size: int = 0
    stack: list[str] = Field(default_factory=list)
    recent: list[OpRecord] = Field(default_factory=list)
    groups: dict[str, list[int]] = Field(default_factory=dict)
    peers: dict[str, PeerView] = Field(default_factory=dict)
    backend_ops: dict[str, BackendOp] = Field(default_factory=dict)  # per group: the newest backend op


class IncidentDoc(_Model):
    """An incident as raised (the store's ``incident/<n>`` value, and ``incident`` in the files)."""

    kind: IncidentKind
    reason: str
    id: str
    by: int = -1
    created: float = 0.0
    n: int = 0  # its number in the store; negative for a rank's local incidents
    signature: str = ""  # what makes two ranks' detections the same incident ("hang/0/15")
    group: str | None = None  # hang: the op's group and number
    seq: int | None = None
    op: str | None = None
    ranks: list[int] | None = None  # lost: the ranks that stopped beating
    store_text: str | None = None  # store: what went wrong, for the report
    generation: int = 0  # the world's generation (0 until a rebuild); ranks are numbered in it
    # The rebuild that made this generation: previous generation's rank -> this one's ("2": 1);
    # None in generation 0.
    rank_map: dict[str, int] | None = None
    left_out: list[int] | None = None  # previous generation's ranks not in this one
    straggler: StragglerReport | None = None  # straggler: who, how much slower, the evidence

    @property
    def op_key(self) -> tuple[str, int] | None:
        """``(group, seq)`` of the op that raised a hang incident; None for other kinds."""
        if self.kind is IncidentKind.HANG and self.group is not None and self.seq is not None:
            return self.group, self.seq
        return None


class MergedNote(_Model):
    """What the merging rank leaves in the store: where the report is, and whom it names."""

    host: str
    dir: str
    summary: str
    culprits: list[int] = Field(default_factory=list, max_length=65536)  # the ``fence`` rung reads it


class FenceNote(_Model):
    """What a rank's ``fence`` rung leaves in the store before the rank exits 0."""

    rank: int
    host: str
    pid: int
    incident: str  # the incident's id
    time: float


class ActionEntry(_Model):
    """One rung of the action ladder as taken (``report``, ``raise``, ..., or ``resolved``)."""

    model_config = ConfigDict(extra="allow")  # an action's own details (exit code, groups aborted)

    rung: str
    time: float
    done: bool
    why: str | None = None


# ----------------------------------------------------------------------------- analysis results


class Whereabouts(_Model):
    """Where a rank is: its phase, its main thread's call site, and the op it is in."""

    rank: int
    phase: str = ""
    site: str = "?"
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


class _OpFinding(_Model):
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


class Variant(_Model):
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


class P2PFinding(_Model):
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
    peer_waits_back: OpRecord | None = None
    peer_where: Whereabouts


class LostRanksFinding(_Model):
    kind: Literal[FindingKind.RANKS_LOST] = FindingKind.RANKS_LOST
    ranks: list[LostRank]


class SilentFinding(_Model):
    kind: Literal[FindingKind.SILENT] = FindingKind.SILENT
    ranks: list[int]
    note: str


class StoreFinding(_Model):
    kind: Literal[FindingKind.STORE] = FindingKind.STORE
    text: str


Finding = Annotated[
    DesyncFinding | StuckFinding | MismatchFinding | P2PFinding | LostRanksFinding | SilentFinding | StoreFinding,
    Field(discriminator="kind"),
]


class StatementView(Statement):
    source: Literal["statement"] = "statement"


class HeartbeatView(Heartbeat):
    source: Literal["heartbeat"] = "heartbeat"


class NoView(_Model):
    source: Literal["none"] = "none"


RankView = Annotated[StatementView | HeartbeatView | NoView, Field(discriminator="source")]


class OutsideStack(_Model):
    """A rank's stacks taken from outside its process (py-spy), or why there are none."""

    rank: int
    host: str
    pid: int
    tool: str = "py-spy dump --native"
    text: str | None = None
    error: str | None = None
    how: str = ""  # what to run to get them by hand


class Analysis(_Model):
    """Culprits and victims, as :func:`ncclguard.incidents.analysis.analyse` finds them."""

    findings: list[Finding] = Field(default_factory=list)
    culprits: list[Culprit] = Field(default_factory=list)
    victims: list[int] = Field(default_factory=list)
    stale_ranks: list[int] = Field(default_factory=list, alias="lost")  # heartbeat stopped
    silent: list[int] = Field(default_factory=list)  # gave no statement
    summary: str = ""


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
