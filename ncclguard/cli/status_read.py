"""The job's state as a reader outside it sees it: ``python -m ncclguard status``.

Rank 0's watchdog names its namespace under a fixed key (:func:`~ncclguard.store.keys.index_key`,
a :class:`WatchIndex`: run id, restart, session, generation, world size, its timeouts), once per
world on its first beat. A reader that knows only the store's address reads that index, then every
rank's heartbeat and the newest incidents of that namespace, and groups the ranks that agree
(:func:`group_rows`) so that a thousand ranks fit on one screen.

Reading is read-only (``check``, ``get``, ``multi_get``; never ``add``, which would create a key)
and bounded: keys are checked :data:`CHUNK` a request (a chunk with missing keys is split in halves
until the missing ones are found) and read by ``multi_get`` in chunks sized to about
:data:`READ_BYTES` of values each (the first :data:`FIRST_READ` keys, then as many as the values read
so far say fit, at most :data:`CHUNK`), and only the newest :data:`MAX_INCIDENTS` incidents are read:
16,384 ranks in 56 requests (``tests/watching/test_views.py``). Every value goes through the store
codec under a size bound into a pydantic model; a value that does not fit is shown as ``bad``,
never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from ncclguard._naming import rank_ranges
from ncclguard.cli.status_reader import CHUNK, FIRST_READ, READ_BYTES, StatusReader
from ncclguard.incidents.model import Heartbeat, IncidentDoc, IncidentKind, MergedNote
from ncclguard.store.codec import decode
from ncclguard.store.keys import Keys, index_key
from ncclguard.watching.base.index import INDEX_LIMIT, WatchIndex
from ncclguard.watching.base.node_layout import DIGEST_LIMIT, Digest
from ncclguard.watching.base.watchdog_store import LIMITS

__all__ = [
    "CHUNK",
    "FIRST_READ",
    "MAX_INCIDENTS",
    "READ_BYTES",
    "SLOW_SCORE",
    "Health",
    "IncidentRow",
    "JobStatus",
    "RankGroup",
    "RankRow",
    "StatusReader",
    "group_rows",
    "mark_waits",
    "read_status",
]

MAX_INCIDENTS = 16  # the newest incidents read
SLOW_SCORE = 0.8  # a straggler score below this makes a rank suspect
Health = Literal["healthy", "suspect", "incident"]
RankState = Literal["ok", "late", "stale", "missing", "bad", "fenced", "waiting", "culprit", "finished"]
WAIT_BEATS = 2.0  # a rank in one op this many heartbeat periods waits (a healthy step's skew is less)


class RankRow(BaseModel):
    """One rank as its heartbeat shows it."""

    rank: int
    state: RankState
    age_s: float | None = None
    phase: str = ""
    site: str = ""  # the main thread's file:line (shown where no phase is set)
    step: int | None = None
    straggler_score: float | None = None
    last_seq: dict[str, int] = Field(default_factory=dict)
    backend_seq: dict[str, int] | None = None
    inflight: str | None = None  # the oldest op in flight: "all_reduce(SUM) #12 on 0"
    inflight_s: float | None = None
    host: str = ""
    pid: int | None = None
    problem: str | None = None  # why a value under its key did not parse
    incidents: list[int] = Field(default_factory=list)  # open incidents that name it (raised by it, or lost)
    judged: dict[str, str] = Field(default_factory=dict)  # the recovery engine's verdict on ranks it waits for
    hang_bound_s: float | None = None  # the hang bound its watchdog holds now (learned per phase unless set)
    backend_still: dict[str, float] | None = None  # seconds each backend number had stood still (at its beat)
    op_key: tuple[str, int] | None = None  # the op in flight's (group, number) in ncclguard's numbering
    waits_for: list[int] = Field(default_factory=list)  # the ranks that have not reached the op it waits in
    waited_by: list[int] = Field(default_factory=list)  # the ranks waiting for it
    judgment: str | None = None  # a waiting rank's verdict on it ("stuck: ..." / "moving: ...")
    snapshots: str | None = None  # its snapshot takes keep failing: what its keeper says


class RankGroup(BaseModel):
    """Ranks whose rows agree (all but heartbeat age, score and time in the op, shown as ranges)."""

    ranks: str  # "0-511,513-1023"
    count: int
    state: RankState
    phase: str
    step: int | None
    slow: bool
    site: str = ""  # where no phase is set: the main thread's file:line (its members agree on it)
    last_seq: dict[str, int]
    backend_seq: dict[str, int] | None
    inflight: str | None
    age_s: tuple[float, float] | None
    score: tuple[float, float] | None
    inflight_s: float | None  # the longest
    incidents: list[int] = Field(default_factory=list)
    judged: str | None = None  # a culprit's verdict, in a word ("stuck", "moving")


class IncidentRow(BaseModel):
    """One incident of the namespace."""

    n: int
    id: str = "?"
    kind: str = "?"
    reason: str = ""
    by: int = -1
    created: float = 0.0
    open: bool = True
    report: str | None = None  # host:dir of the merged report
    ranks: list[int] | None = None  # a lost incident: the ranks that stopped beating
    ranks_back: bool = False  # a lost incident whose ranks all beat again since: no longer open
    suspects: list[int] = Field(default_factory=list)  # a numerical finding: the ranks it named suspect devices
    problem: str | None = None


class JobStatus(BaseModel):
    """What ``python -m ncclguard status --json`` prints."""

    store: str
    health: Health
    reasons: list[str]
    read_at: float
    requests: int
    index: WatchIndex
    groups: list[RankGroup]
    ranks: list[RankRow]
    incident_count: int
    incidents: list[IncidentRow]


def _parse(model: Any, blob: bytes, key: str, limit: int) -> tuple[Any, str | None]:
    try:
        return decode(model, blob, key, limit), None
    except ValueError as exc:
        return None, str(exc).splitlines()[0][:200]


def _row(rank: int, blob: bytes | None, key: str, index: WatchIndex, now: float) -> RankRow:
    if blob is None:
        return RankRow(rank=rank, state="missing")
    hb, problem = _parse(Heartbeat, blob, key, LIMITS[Heartbeat])
    if hb is None or hb.rank != rank:
        return RankRow(rank=rank, state="bad", problem=problem or f"says rank {hb.rank if hb else '?'}")
    age = max(0.0, now - hb.time)
    state: RankState = "ok" if age <= 3 * index.heartbeat_s else "late" if age <= index.peer_timeout_s else "stale"
    if hb.finished:
        state = "finished"  # its watchdog stopped on purpose: its last heartbeat (watching/ending.py)
    oldest = min(hb.inflight, key=lambda r: r.start, default=None)
    return RankRow(
        rank=rank,
        state=state,
        age_s=round(age, 3),
        phase=hb.phase,
        site="" if hb.phase else hb.site,
        step=hb.step,
        straggler_score=hb.straggler_score,
        last_seq=hb.last_seq,
        backend_seq=hb.backend_seq,
        inflight=None if oldest is None else f"{oldest.op} #{oldest.seq} on {oldest.group}",
        inflight_s=None if oldest is None else round(max(0.0, now - oldest.start), 3),
        host=hb.host,
        pid=hb.pid,
        judged=hb.judged or {},
        hang_bound_s=hb.hang_bound_s,
        backend_still=hb.backend_still,
        op_key=None if oldest is None else (oldest.group, oldest.seq),
        snapshots=hb.snapshots,
    )


def mark_waits(rows: Sequence[RankRow], heartbeat_s: float) -> None:
    """Marks, in place, the ranks that wait in an op and the ranks they wait for, as the watchdog
    sees them: a rank in a recorded op (its heartbeat's ``inflight``) for :data:`WAIT_BEATS`
    heartbeat periods waits for the members whose last op number in that group is lower; a rank whose
    backend number in a group stood still that long waits (in "backend op #n") for the members
    whose number there is lower (the op DDP's reducer or a framework issued from C++). A waiting
    rank's state becomes ``waiting``; a rank waited for becomes ``culprit``, with the verdict a
    waiting rank published on it (its heartbeat's ``judged``). A late, stale or fenced rank keeps
    its state.

    Args:
        rows: one row per rank (as :func:`read_status` reads them).
        heartbeat_s: the watchdog's heartbeat period.
    """
    bound = WAIT_BEATS * heartbeat_s
    beating = [r for r in rows if r.state in ("ok", "late")]
    for r in beating:
        waits: set[int] = set()
        if r.op_key is not None and (r.inflight_s or 0.0) >= bound:
            group, seq = r.op_key
            waits |= {p.rank for p in beating if p is not r and p.last_seq.get(group, seq) < seq}
        for group, seq in sorted((r.backend_seq or {}).items()):
            still = (r.backend_still or {}).get(group)
            if still is None or still + (r.age_s or 0.0) < bound:
                continue
            lower = {p.rank for p in beating if p is not r and (p.backend_seq or {}).get(group, seq) < seq}
            if lower and not waits and r.inflight is None:
                r.inflight, r.inflight_s = f"backend op #{seq} on {group}", round(still + (r.age_s or 0.0), 3)
            waits |= lower
        if waits:
            r.waits_for = sorted(waits)
            r.state = "waiting" if r.state == "ok" else r.state
    by_rank = {r.rank: r for r in rows}
    for r in beating:
        for c in r.waits_for:
            culprit = by_rank[c]
            culprit.waited_by.append(r.rank)
            said = r.judged.get(str(c))
            culprit.judgment = culprit.judgment or said
            culprit.state = "culprit" if culprit.state in ("ok", "waiting") else culprit.state


def _span(values: list[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if values else None


def group_rows(rows: Sequence[RankRow]) -> list[RankGroup]:
    """Groups ranks whose state, phase (or, without one, main-thread site), step, numbers per group,
    op in flight and slowness agree;
    heartbeat ages, scores and times in the op become ranges. Groups come in order of their first rank.

    Args:
        rows: one row per rank.

    Returns:
        The groups.
    """

    def key(r: RankRow) -> tuple[Any, ...]:
        slow = r.straggler_score is not None and r.straggler_score < SLOW_SCORE
        backend = tuple(sorted(r.backend_seq.items())) if r.backend_seq is not None else None
        seqs = tuple(sorted(r.last_seq.items()))
        said = r.judgment.split(":", 1)[0] if r.judgment else None
        return (r.state, r.phase, r.site, r.step, slow, seqs, backend, r.inflight, tuple(r.incidents), said)

    buckets: dict[tuple[Any, ...], list[RankRow]] = {}
    for r in sorted(rows, key=lambda r: r.rank):
        buckets.setdefault(key(r), []).append(r)
    out = []
    for (state, phase, site, step, slow, _, _, inflight, incidents, said), members in buckets.items():
        first = members[0]
        times = [m.inflight_s for m in members if m.inflight_s is not None]
        out.append(
            RankGroup(
                ranks=rank_ranges(m.rank for m in members),
                count=len(members),
                state=state,
                phase=phase,
                site=site,
                step=step,
                slow=slow,
                last_seq=first.last_seq,
                backend_seq=first.backend_seq,
                inflight=inflight,
                age_s=_span([m.age_s for m in members if m.age_s is not None]),
                score=_span([m.straggler_score for m in members if m.straggler_score is not None]),
                inflight_s=max(times) if times else None,
                incidents=list(incidents),
                judged=said,
            )
        )
    return out


def _incidents(reader: StatusReader, keys: Keys) -> tuple[int, list[IncidentRow]]:
    got = reader.read([keys.count])
    raw = got.get(0, b"0")
    count = int(raw) if raw.strip().lstrip(b"-").isdigit() and len(raw) < 19 else 0
    numbers = list(range(max(1, count - MAX_INCIDENTS + 1), count + 1))
    docs = reader.read([keys.incident(n) for n in numbers])
    resolved = reader.read([keys.resolved(n) for n in numbers])
    merged = reader.read([keys.merged(n) for n in numbers])
    rows = []
    for i, n in enumerate(numbers):
        if i not in docs:
            continue
        doc, problem = _parse(IncidentDoc, docs[i], keys.incident(n), LIMITS[IncidentDoc])
        if doc is None:
            rows.append(IncidentRow(n=n, problem=problem))
            continue
        note, _ = _parse(MergedNote, merged[i], keys.merged(n), LIMITS[MergedNote]) if i in merged else (None, None)
        rows.append(
            IncidentRow(
                n=n,
                id=doc.id[:128],
                kind=doc.kind.value,
                reason=doc.reason[:500],
                by=doc.by,
                created=doc.created,
                open=resolved.get(i) != b"1",
                report=f"{note.host}:{note.dir}" if note is not None else None,
                ranks=doc.ranks,
                suspects=list(doc.numerics.suspects) if doc.numerics is not None else [],
            )
        )
    return count, rows


def _health(rows: Sequence[RankRow], incidents: Sequence[IncidentRow], index: WatchIndex) -> tuple[Health, list[str]]:
    reasons = []
    opened = [i for i in incidents if i.open and i.problem is None]
    if opened:
        reasons.append("open incident(s): " + ", ".join(f"{i.id} ({i.kind})" for i in opened))
    for state, words in (
        ("missing", "no heartbeat"),
        ("stale", "heartbeat stopped"),
        ("bad", "unreadable heartbeat"),
        ("fenced", "fenced by the watchdog (exited; the others rebuild without it)"),
    ):
        ranks = [r.rank for r in rows if r.state == state]
        if ranks:
            reasons.append(f"{words}: ranks {rank_ranges(ranks)}")
    long = [r for r in rows if r.inflight_s is not None and r.inflight_s > (r.hang_bound_s or index.hang_timeout_s) / 2]
    if long:
        bounds = sorted({r.hang_bound_s or index.hang_timeout_s for r in long})
        span = f"{bounds[0]:g} s" if len(bounds) == 1 else f"{bounds[0]:g}-{bounds[-1]:g} s"
        reasons.append(
            f"in one op for over half of its hang bound ({span}): ranks {rank_ranges([r.rank for r in long])}"
        )
    waiting = [r for r in rows if r.waits_for]
    for op in sorted({r.inflight or "?" for r in waiting}):
        who = [r for r in waiting if (r.inflight or "?") == op]
        culprits = sorted({c for r in who for c in r.waits_for})
        longest = max((r.inflight_s or 0.0) for r in who)
        reasons.append(
            f"ranks {rank_ranges(r.rank for r in who)} wait in {op} (up to {longest:.0f} s) "
            f"for ranks {rank_ranges(culprits)}, which have not reached it"
        )
    said: dict[str, tuple[int, str]] = {}
    for r in rows:  # the recovery engine's verdict, once per rank judged (the first rank that says it)
        for peer, text in sorted(r.judged.items()):
            said.setdefault(peer, (r.rank, text))
    for peer, (by, text) in sorted(said.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1):
        reasons.append(f"rank {peer} is {text} (judged by rank {by}, which waits for it)")
    lost = [r for r in rows if r.snapshots]
    if lost:  # the first rank's words: the ranks of one world lose their takes together (one agreement)
        reasons.append(f"snapshots not committed: ranks {rank_ranges(r.rank for r in lost)}: {lost[0].snapshots}")
    slow = [r.rank for r in rows if r.straggler_score is not None and r.straggler_score < SLOW_SCORE]
    if slow:
        reasons.append(f"straggler score below {SLOW_SCORE}: ranks {rank_ranges(slow)}")
    # A suspect device stays a reason after its incident was handled: the step was dealt with, the
    # device was not (the numerical check names a rank flagged again soon after an earlier finding).
    named = [i for i in incidents if i.suspects]
    if named:
        ranks = sorted({r for i in named for r in i.suspects})
        reasons.append(
            f"suspect device named by the numerical check: ranks {rank_ranges(ranks)} "
            f"(incident {', '.join(i.id for i in named)}); consider taking it out of the job"
        )
    health: Health = "incident" if opened else "suspect" if reasons else "healthy"
    return health, reasons


def read_index(reader: StatusReader, session: str) -> WatchIndex | str:
    """The session's index, or why there is none (a sentence)."""
    key = index_key(session)
    got = reader.read([key])
    if 0 not in got:
        return f"no ncclguard watchdog has named a session {session!r} in this store (no key {key})"
    index, problem = _parse(WatchIndex, got[0], key, INDEX_LIMIT)
    return index if index is not None else f"the value under {key} is not a watchdog index: {problem}"


def _rank_rows(reader: StatusReader, index: WatchIndex, t: float) -> list[RankRow]:
    """Every rank's row, from its heartbeat: in the job's store, or with the node tier
    (``index.nodes``) in its node's digest; a rank a digest does not hold, or holds late, is
    looked up in the job's store too (its node's store was gone), and the fresher one is shown."""
    keys = index.keys
    hb_keys = [keys.heartbeat(r) for r in range(index.world_size)]
    if not index.nodes:
        blobs = reader.read(hb_keys)
        return [_row(r, blobs.get(r), hb_keys[r], index, t) for r in range(index.world_size)]
    blobs = {}
    digest_keys = [keys.digest(n) for n in range(index.nodes)]
    for i, blob in reader.read(digest_keys).items():
        digest, _ = _parse(Digest, blob, digest_keys[i], DIGEST_LIMIT)
        if digest is not None and digest.node == i and digest.generation == index.generation:
            blobs.update({r: text.encode() for r, text in digest.beats.items() if 0 <= r < index.world_size})
    rows = [_row(r, blobs.get(r), hb_keys[r], index, t) for r in range(index.world_size)]
    behind = [row.rank for row in rows if row.state in ("missing", "late", "stale")]
    for i, blob in reader.read([hb_keys[r] for r in behind]).items():
        row, old = _row(behind[i], blob, hb_keys[behind[i]], index, t), rows[behind[i]]
        if row.age_s is not None and (old.age_s is None or row.age_s < old.age_s):
            rows[behind[i]] = row
    return rows


def read_status(reader: StatusReader, index: WatchIndex, store: str, now: Callable[[], float] = time.time) -> JobStatus:
    """Reads every rank's heartbeat and the newest incidents of ``index``'s namespace.

    Args:
        reader: the bounded reader.
        index: the namespace (:func:`read_index`).
        store: ``host:port``, for the output.
        now: the clock heartbeat ages are taken against (ranks' ``time.time()``).

    Returns:
        The status.

    Raises:
        StoreTimeout, StoreUnreachable: the store did not answer.
    """
    keys = index.keys
    t = now()
    rows = _rank_rows(reader, index, t)
    # A fenced rank exited: its heartbeat ages. Only such ranks are looked up (none in a healthy job).
    aging = [r.rank for r in rows if r.state in ("late", "stale")]
    for i in reader.read([keys.fenced(r) for r in aging]):
        rows[aging[i]].state = "fenced"  # its fence rung marked it before it exited
    count, incidents = _incidents(reader, keys)
    for inc in incidents:
        if inc.open and inc.problem is None and inc.kind == IncidentKind.PEERS_LOST.value and inc.ranks:
            # Nobody marks a lost incident resolved (no op of it completes), so status would read
            # "incident" for the rest of the world's life. Once every rank it names beats again, on
            # time, with a heartbeat newer than the incident, the loss is over: it is not open.
            back = all(
                0 <= r < len(rows) and rows[r].state == "ok" and t - (rows[r].age_s or 0.0) > inc.created
                for r in inc.ranks
            )
            inc.open, inc.ranks_back = not back, back
        if inc.open and inc.problem is None:
            for r in {inc.by, *(inc.ranks or [])} & set(range(index.world_size)):
                rows[r].incidents.append(inc.n)
    mark_waits(rows, index.heartbeat_s)
    health, reasons = _health(rows, incidents, index)
    return JobStatus(
        store=store,
        health=health,
        reasons=reasons,
        read_at=t,
        requests=reader.requests,
        index=index,
        groups=group_rows(rows),
        ranks=rows,
        incident_count=count,
        incidents=incidents,
    )
