"""What the watchdog publishes and exchanges: heartbeats, statements, incidents as raised, notes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator

from ncclguard.incidents.base import IncidentKind, Model, OpRecord
from ncclguard.incidents.numerics_model import NumericsReport
from ncclguard.incidents.straggler_model import StragglerReport, StragglerWindow

__all__ = [
    "ActionEntry",
    "BackendOp",
    "FenceNote",
    "Heartbeat",
    "IncidentDoc",
    "MergedNote",
    "PeerView",
    "Statement",
    "compact_ranks",
    "expand_ranks",
    "site_frames",
]


MAX_SENSORS = 16  # sensors whose figures a heartbeat carries
Reading = Annotated[dict[str, float | int | str | None], Field(max_length=64)]  # one sensor's figures


class Heartbeat(Model):
    """What a rank publishes every ``heartbeat_s``."""

    rank: int
    host: str
    pid: int
    beat: int
    address: str | None = None  # this host's address toward the master: tells apart hosts of one name
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
    # Its watchdog stopped on purpose (the script's end, stop(), a with block left without an error):
    # this is its last beat, and its silence from now on is not a loss.
    finished: bool = False
    straggler_score: float | None = None  # 1.0: as fast as the fastest peer; lower is slower
    window: StragglerWindow | None = None  # the last straggler window closed (docs/stragglers.md)
    main_cpu_s: float | None = None  # the main thread's CPU seconds (progress evidence: watching/sensors/progress.py)
    io_bytes: int | None = None  # the process's storage bytes read and written (progress evidence)
    # Read by the rank from its own /proc (watching/sensors/progress.beat_evidence), so that a peer on
    # another host sees its progress where it is: its process tree's CPU by process (DataLoader
    # workers, an upload's subprocess), its TCP sockets' bytes together, its read()/write() bytes.
    children_cpu: list[tuple[int, float]] | None = Field(None, max_length=64)
    net_bytes: int | None = None
    chars: int | None = None
    # The recovery engine's verdict on the ranks this one waits for: rank -> "stuck: ..." / "moving: ...".
    judged: dict[str, str] | None = Field(None, max_length=64)
    # The step those verdicts are about ("<generation>/<step>"): a peer counts them only for the same.
    judged_about: str | None = Field(None, max_length=64)
    # Its snapshot takes keep failing: how many in a row, the newest snapshot kept, why (status shows it).
    snapshots: str | None = Field(None, max_length=240)
    # The hang bound this rank's watchdog holds now (learned per phase unless set: watching/base/hang_bound.py).
    hang_bound_s: float | None = None
    # A registered sensor's figures under its name (watching/sensors/sensor.py): a sensor of yours
    # publishes here, so that its peers' sensors read them, without a field of its own in this model.
    readings: dict[str, Reading] | None = Field(None, max_length=MAX_SENSORS)


class BackendOp(Model):
    """An op as torch's own flight recorder saw it, whoever issued it (Python or C++)."""

    seq: int  # the rank's backend sequence number in the group when read
    name: str  # profiling_name, e.g. "gloo:all_reduce"
    sizes: list[list[int]] = Field(default_factory=list)
    dtypes: list[str] = Field(default_factory=list)  # torch's scalar type names, e.g. "Float"
    created: float = 0.0  # time.time() when the backend enqueued it
    state: str = ""  # gloo: always "scheduled"; NCCL: scheduled, started, completed
    completed: bool | None = None  # by the recorder's per-group status (gloo too); None: unknown
    record: OpRecord | None = None  # ncclguard's record of the Python call that issued it, if one did


class PeerView(Model):
    """How a rank sees one of the peers it watches."""

    age_s: float
    stale: bool
    seen: bool


# A group's ranks are kept as runs where long (``"start:stop:step"``, Python's range), in memory and
# in JSON: a statement carries each of its groups' ranks, and at 16,384 ranks the world's and a
# data-parallel group's made it ~100 KB of JSON, 1.6 GB for one incident's statements, and the
# merging rank that held them as lists of ints ran out of 24 GB (benchmarks/desk_scale.py).
COMPACT_FROM = 64  # a group of fewer ranks is written as a plain list
RUN_MIN = 4  # ranks in a run at one step, at least
MAX_GROUP_RANKS = 1 << 20  # the ranks a group's runs may stand for, read back
_RUN = re.compile(r"^([0-9]{1,9}):([0-9]{1,9}):([0-9]{1,9})$")


def compact_ranks(ranks: Sequence[int]) -> list[int | str]:
    """``ranks`` with each run of :data:`RUN_MIN` or more at one rising step written
    ``"start:stop:step"``; :func:`expand_ranks` gives them back."""
    out: list[int | str] = []
    i, n = 0, len(ranks)
    while i < n:
        j = i
        step = ranks[i + 1] - ranks[i] if i + 1 < n else 0
        while step > 0 and j + 1 < n and ranks[j + 1] - ranks[j] == step:
            j += 1
        if j - i + 1 >= RUN_MIN:
            out.append(f"{ranks[i]}:{ranks[j] + step}:{step}")
            i = j + 1
        else:
            out.append(ranks[i])
            i += 1
    return out


def _runs(items: Sequence[Any]) -> list[range]:
    """Each item of a group's ranks as a range (a rank, or a run), checked and bounded.

    Raises:
        ValueError: an item that is neither a rank nor a run, a run that is empty or goes back, or
            more than :data:`MAX_GROUP_RANKS` ranks in all.
    """
    out: list[range] = []
    total = 0
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            run = range(item, item + 1)
        else:
            m = _RUN.match(item) if isinstance(item, str) else None
            if m is None:
                raise ValueError(f"{str(item)[:40]!r} is neither a rank nor a run 'start:stop:step'")
            start, stop, step = (int(g) for g in m.groups())
            if step < 1 or stop <= start:
                raise ValueError(f"{item!r} is not a run of ranks")
            run = range(start, stop, step)
        total += len(run)
        if total > MAX_GROUP_RANKS:
            raise ValueError(f"a group of more than {MAX_GROUP_RANKS} ranks")
        out.append(run)
    return out


def expand_ranks(items: Sequence[Any]) -> list[int]:
    """A group's ranks from what :func:`compact_ranks` wrote (or a plain list).

    Raises:
        ValueError: as :func:`_runs`.
    """
    return [r for run in _runs(items) for r in run]


class Statement(Heartbeat):
    """What a rank says about itself when it handles an incident: a heartbeat and more.

    ``groups`` holds a long group's ranks as runs (:func:`compact_ranks`); :meth:`members` gives
    a group's ranks as a list.
    """

    world_size: int = 0
    stack: list[str] = Field(default_factory=list)
    recent: list[OpRecord] = Field(default_factory=list)
    groups: dict[str, list[int | str]] = Field(default_factory=dict)
    peers: dict[str, PeerView] = Field(default_factory=dict)
    backend_ops: dict[str, BackendOp] = Field(default_factory=dict)  # per group: the newest backend op

    @field_validator("groups", mode="before")
    @classmethod
    def _as_runs(cls, value: Any) -> Any:
        """Checks each group's ranks (:func:`_runs`), and keeps a long plain list as runs."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        for name, ranks in value.items():
            if isinstance(ranks, list | tuple):
                _runs(ranks)
                plain = len(ranks) >= COMPACT_FROM and all(type(r) is int for r in ranks)
                ranks = compact_ranks(ranks) if plain else list(ranks)
            out[name] = ranks
        return out

    def members(self, group: str) -> list[int] | None:
        """The ranks of ``group`` as this rank said them; None where it named no such group."""
        ranks = self.groups.get(group)
        return None if ranks is None else expand_ranks(ranks)

    def head(self) -> Statement:
        """What a merge's analysis reads of this statement, and no more (~1.2 KB as stored, not
        4-11 KB): its heartbeat's whereabouts and counts, its ops in flight, its groups, its backend
        ops, the frames that name the function at its site (:func:`site_frames`) and the peers it
        found stale. No recent ops, sensors' readings or straggler window. Above 1,024 ranks the merging
        rank reads every rank's head and the whole statements of the culprits and a few victims
        only (``watching/desk/merging.py``): parsing 16,384 whole statements took it 3.6 s, their
        heads 0.35 s (``benchmarks/desk_scale.py``)."""
        return self.model_copy(
            update={
                "stack": site_frames(self.stack, self.site),
                "recent": [],
                "peers": {r: v for r, v in self.peers.items() if v.stale},
                "readings": None,
                "window": None,
                "children_cpu": None,
                "judged": None,
            }
        )


def site_frames(stack: Sequence[str], site: str) -> list[str]:
    """The frames of ``stack`` (``"file:line in func: code"``, innermost last) that name the function
    at ``site`` (``file:line``): the innermost frame at that line and the innermost in that file, as
    :func:`~ncclguard.incidents.analysis.site_function` looks them up, in the stack's order."""
    head, path = f"{site} in ", site.rpartition(":")[0]
    exact = same_file = -1
    for i, line in enumerate(stack):
        if line.startswith(head):
            exact = i
        where, sep, _ = line.partition(" in ")
        if sep and where.rpartition(":")[0] == path:
            same_file = i
    return [stack[i] for i in sorted({exact, same_file} - {-1})]


class IncidentDoc(Model):
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
    numerics: NumericsReport | None = None  # numerics: the ranks, step, buckets and names (docs/numerics.md)

    @property
    def op_key(self) -> tuple[str, int] | None:
        """``(group, seq)`` of the op that raised a hang incident; None for other kinds."""
        if self.kind is IncidentKind.HANG and self.group is not None and self.seq is not None:
            return self.group, self.seq
        return None


class MergedNote(Model):
    """What the merging rank leaves in the store: where the report is, and whom it names."""

    host: str
    dir: str
    summary: str
    rank: int | None = None  # the rank that merged
    address: str | None = None  # its host's address toward the master (hosts may share a name)
    culprits: list[int] = Field(default_factory=list, max_length=65536)  # the ``fence`` rung reads it


class FenceNote(Model):
    """What a rank's ``fence`` rung leaves in the store before the rank exits 0."""

    rank: int
    host: str
    pid: int
    incident: str  # the incident's id
    time: float


class ActionEntry(Model):
    """One rung of the action ladder as taken (``report``, ``raise``, ..., or ``resolved``)."""

    model_config = ConfigDict(extra="allow")  # an action's own details (exit code, groups aborted)

    rung: str
    time: float
    done: bool
    why: str | None = None
