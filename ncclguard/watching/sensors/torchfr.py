"""torch's own flight recorder, read as data: its entries, whether each is open, and which of
ncclguard's records issued it.

torch records every op its backend ran (``_dump_fr_trace_json``, through
:mod:`ncclguard._torch_compat`), from Python or from C++ (DDP's reducer, functional collectives),
with the issuing thread and the time it was enqueued; ncclguard's recorder
(:mod:`ncclguard.recording.flight`) records the Python calls with their call site and phase.
:func:`join` pairs them: an entry belongs to the record of the same group and thread whose call
was running when the entry was created. The join runs on what both recorders already hold, when an
incident is dumped: nothing is added to a collective's path.

Pure functions of parsed data; the dump is read in :mod:`ncclguard.watching.sensors.rank_state`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ncclguard.incidents.model import OpRecord
from ncclguard.recording.flight import seq_key

__all__ = [
    "MAX_DUMP_CHARS",
    "FREntry",
    "Dump",
    "entry_open",
    "join",
    "newest",
    "parse_dump",
    "parse_newest",
    "parse_window",
]

# torch keeps TORCH_FR_BUFFER_SIZE entries (2000 by default, about 1.2 MB of JSON); a dump far
# beyond that is not read (the watchdog thread must not spend seconds parsing).
MAX_DUMP_CHARS = 64 * 2**20
# Clock slack between a record's time.time() and torch's system-clock time_created_ns.
_SLACK_S = 1e-4


class FREntry(BaseModel):
    """One entry of torch's flight recorder (the fields ncclguard reads)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    record_id: int = -1
    group: str = ""  # process_group[0]: the group's name, as in ncclguard's records
    collective_seq: int = Field(0, alias="collective_seq_id")
    p2p_seq: int = Field(0, alias="p2p_seq_id")
    is_p2p: bool = False
    name: str = Field("", alias="profiling_name")  # "gloo:all_reduce", "nccl:all_reduce"
    sizes: list[list[int]] = Field(default_factory=list, alias="input_sizes")
    dtypes: list[str] = Field(default_factory=list, alias="input_dtypes")
    created: float = 0.0  # time.time() seconds (time_created_ns / 1e9)
    state: str = ""  # gloo: always "scheduled"; NCCL: scheduled, started, completed
    retired: bool | None = None  # torch retired the entry: its work completed
    thread: int | None = None  # the issuing thread's ident (threading.get_ident())

    @property
    def counter(self) -> str:
        """The counter it is numbered in, as ncclguard names it (``"<group>:p2p"`` for send/recv)."""
        return seq_key(self.group, self.is_p2p)

    @property
    def numel(self) -> int:
        """Elements of its inputs."""
        return sum(math.prod(size) for size in self.sizes)


class Dump(BaseModel):
    """A parsed dump: its entries (oldest first) and torch's per-group status."""

    entries: list[FREntry] = Field(default_factory=list)
    status: dict[str, dict[str, Any]] = Field(default_factory=dict)


def _entry(raw: Any) -> FREntry | None:
    if not isinstance(raw, dict):
        return None
    pg = raw.get("process_group")
    thread = raw.get("thread_id")
    fields = {
        **raw,
        "group": str(pg[0]) if isinstance(pg, list) and pg else "",
        "created": float(raw.get("time_created_ns") or 0) / 1e9,
        "thread": int(thread) if isinstance(thread, (int, str)) and str(thread).isdigit() else None,
    }
    try:
        return FREntry.model_validate(fields)
    except (ValidationError, TypeError, ValueError):
        return None  # an entry of another shape (a newer torch): skipped, the others still read


def _load(text: str | bytes) -> dict[str, Any]:
    if len(text) > MAX_DUMP_CHARS:
        raise ValueError(f"flight-recorder dump of {len(text)} characters is over {MAX_DUMP_CHARS}; not read")
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"flight-recorder dump is a {type(raw).__name__}, not an object")
    return raw


def _status(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {str(k): v for k, v in (raw.get("pg_status") or {}).items() if isinstance(v, dict)}


def parse_dump(text: str | bytes) -> Dump:
    """Parses the JSON text of ``_dump_fr_trace_json``; malformed entries are skipped.

    Raises:
        ValueError: not JSON, not an object, or longer than :data:`MAX_DUMP_CHARS`.
    """
    raw = _load(text)
    entries = [e for e in (_entry(x) for x in raw.get("entries") or []) if e is not None]
    return Dump(entries=sorted(entries, key=lambda e: e.record_id), status=_status(raw))


def parse_newest(text: str | bytes, groups: Iterable[str]) -> Dump:
    """Like :func:`parse_dump`, keeping only the newest entry of each of ``groups``: the watchdog's
    read when it suspects a hang, which parses two entries rather than 2000 (benchmarks/investigations/backend_read_cost.py).

    Raises:
        ValueError: as :func:`parse_dump`.
    """
    raw = _load(text)
    wanted = set(groups)
    candidates: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for x in raw.get("entries") or []:
        if not isinstance(x, dict):
            continue
        pg, rid = x.get("process_group"), x.get("record_id")
        name = str(pg[0]) if isinstance(pg, list) and pg else ""
        if name in wanted and isinstance(rid, int):
            candidates.setdefault(name, []).append((rid, x))
    entries = []
    for found in candidates.values():
        for _, x in sorted(found, key=lambda c: c[0], reverse=True):  # the newest that parses
            e = _entry(x)
            if e is not None:
                entries.append(e)
                break
    return Dump(entries=sorted(entries, key=lambda e: e.record_id), status=_status(raw))


def parse_window(text: str | bytes, group: str, start: float, end: float, last: int) -> list[FREntry]:
    """Like :func:`parse_dump`, keeping only the newest ``last`` collectives (not send/recv) of
    ``group`` created in ``[start, end)`` (``time.time()`` seconds), oldest first: the straggler
    window's read of the backend's arrivals. Entries outside it are skipped before they are parsed.

    Raises:
        ValueError: as :func:`parse_dump`.
    """
    raw = _load(text)
    lo, hi = start * 1e9, end * 1e9
    found: list[tuple[int, dict[str, Any]]] = []
    for x in raw.get("entries") or []:
        if not isinstance(x, dict) or x.get("is_p2p"):
            continue
        pg, rid, created = x.get("process_group"), x.get("record_id"), x.get("time_created_ns")
        name = str(pg[0]) if isinstance(pg, list) and pg else ""
        if name == group and isinstance(rid, int) and isinstance(created, (int, float)) and lo <= created < hi:
            found.append((rid, x))
    found.sort(key=lambda c: c[0])
    entries = [e for e in (_entry(x) for _, x in found[-last:] if last > 0) if e is not None]
    return [e for e in entries if not e.is_p2p]


def entry_open(entry: FREntry, status: Mapping[str, Mapping[str, Any]]) -> bool | None:
    """Whether ``entry``'s work is still open on this rank: by its state where the backend tracks
    it (NCCL), by ``retired`` (torch retires an entry when its work completes, gloo too), else by
    the group's ``last_completed_collective``; None when nothing tells."""
    if entry.state == "completed":
        return False
    if entry.retired is not None:
        return not entry.retired
    st = status.get(entry.group)
    if entry.is_p2p or not isinstance(st, Mapping):
        return None
    try:
        return int(st["last_completed_collective"]) < entry.collective_seq
    except (KeyError, TypeError, ValueError):
        return None


def newest(entries: Iterable[FREntry], groups: Iterable[str]) -> dict[str, FREntry]:
    """The newest entry of each of ``groups`` that has one."""
    wanted = set(groups)
    out: dict[str, FREntry] = {}
    for e in entries:
        if e.group in wanted and e.record_id >= out.get(e.group, e).record_id:
            out[e.group] = e
    return out


def join(records: Sequence[OpRecord], entries: Sequence[FREntry]) -> dict[int, OpRecord]:
    """Which of ncclguard's records issued each backend entry, by ``record_id`` of the entry.

    An entry belongs to the record of the same counter (group, or its send/recv counter) and thread
    whose call was running when torch created the entry: started before it, and ended after it (or
    not ended yet). A synchronous call may issue several entries (the chunks of
    ``safe_all_reduce``); an asynchronous one issues one, the first (its record ends only when the
    watchdog notices completion, so a later entry of the same thread is not its own). Entries no
    record claims were issued from C++ (DDP's reducer, functional collectives) or by calls that were
    not instrumented. The names are not compared: backends implement one op with another (gloo
    runs ``reduce_scatter_tensor`` as ``gloo:all_reduce``).

    Args:
        records: ncclguard's flight records (any order).
        entries: torch's flight-recorder entries.

    Returns:
        ``{entry.record_id: record}`` for the entries joined.
    """
    by_lane: dict[tuple[int, str], list[OpRecord]] = {}
    for rec in records:
        by_lane.setdefault((rec.thread, seq_key(rec.group, rec.peer is not None)), []).append(rec)
    for lane in by_lane.values():
        lane.sort(key=lambda r: r.start)
    out: dict[int, OpRecord] = {}
    taken: set[tuple[str, int]] = set()  # async records already joined: (counter, seq)
    for e in sorted(entries, key=lambda x: (x.created, x.record_id)):
        if e.thread is None:
            continue
        lane = by_lane.get((e.thread, e.counter), [])
        owner = None
        for rec in lane:  # the latest call started before the entry was created
            if rec.start - _SLACK_S > e.created:
                break
            owner = rec
        if owner is None or (owner.end is not None and owner.end + _SLACK_S < e.created):
            continue
        key = (e.counter, owner.seq)
        if owner.async_op:
            if key in taken:
                continue
            taken.add(key)
        out[e.record_id] = owner
    return out
