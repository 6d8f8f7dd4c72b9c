"""The watchdog's store protocol: its key schema, bounded calls, and validated values.

- :class:`~ncclguard.store.keys.Keys` (re-exported here) builds every key the watchdog reads or
  writes (nowhere else builds one), one namespace per world generation.
- :class:`~ncclguard.store.bounded_calls.BoundedCalls` bounds each store call by ``timeout``
  and tells a slow store from a refused request and a store that is gone.
- :class:`WatchdogStore` is the protocol itself: typed reads and writes of heartbeats, incidents,
  statements and the merge. Every value read is decoded by the store layer's codec
  (:func:`ncclguard.store.codec.decode`: a pydantic model under the size bound :data:`LIMITS`
  gives it, finite numbers only), checked against its key (``hb/3`` holds rank 3's; an incident id is a plain name,
  :data:`INCIDENT_ID`) and for finite numbers; a bad one is dropped with one log line per key
  (until it reads well again), never raised into the loop. Claims nobody wrote are taken over;
  counters that are not numbers are read before being counted on again (:class:`StoreRefused`).

Errors: :class:`~ncclguard.errors.StoreTimeout` for one call that did not answer in time (the next
tick retries); :class:`StoreRefused` (a StoreTimeout) for one request the server refused while it
still serves; :class:`~ncclguard.errors.StoreUnreachable` once the store is gone (a closed
connection that a new one cannot replace, or no answer for ``gone_after`` seconds).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar

from pydantic import BaseModel

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.incidents.model import FenceNote, Heartbeat, IncidentDoc, MergedNote, Statement
from ncclguard.store.bounded_calls import BoundedCalls, StoreRefused
from ncclguard.store.clients import connect, unprefixed
from ncclguard.store.codec import DEFAULT_LIMIT, check_finite, decode, encode
from ncclguard.store.keys import Keys, world_record_key
from ncclguard.store.rounds import read_present
from ncclguard.store.world_record import MAX_RECORD_BYTES, WorldRecord

__all__ = [
    "INCIDENT_ID",
    "LIMITS",
    "BoundedCalls",
    "Keys",
    "StoreExchange",
    "StoreRefused",
    "WatchdogStore",
    "check_finite",
]
__all__ += ["default_store_addr", "parse_value", "store_addr"]

M = TypeVar("M", bound=BaseModel)

# The largest value the watchdog accepts per model, in bytes of JSON. A statement carries a
# 40-frame stack, 20 recent records and every group's ranks: ~20 KB for 8 ranks, far below.
LIMITS: dict[type[BaseModel], int] = {
    Heartbeat: 256 * 1024,
    Statement: 1024 * 1024,
    IncidentDoc: 64 * 1024,
    MergedNote: 64 * 1024 + 8 * 65536,  # the note and its culprits' numbers
    FenceNote: 4 * 1024,
    WorldRecord: MAX_RECORD_BYTES,
}

# Above this many ranks a statement keeps its newest BRIEF_RECENT ops and innermost BRIEF_FRAMES
# frames: the merging rank parses every statement, and at 16,384 ranks their 20 ops and 30 frames
# each (11 KB) took it 7.4 s, over the two beats a report has (benchmarks/desk_scale.py).
BRIEF_FROM, BRIEF_RECENT, BRIEF_FRAMES = 1024, 4, 12

# Keys read in one call (one bound): a merge reads every rank's statement, and 4,096 statements in
# one multi_get (134 MB) outran the 5 s bound of a store call (benchmarks/desk_scale.py).
READ_CHUNK = 128

# An incident id names a directory under incident_dir: a plain name, never a path. The ids the
# watchdog makes (``20250101-120000-001``, ``20250101-120000-r3-store-1``) fit it.
INCIDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_CLAIM_TOKEN = re.compile(r"^[0-9]{1,9}:[0-9A-Za-z]{1,32}$")  # a rank's claim: "<rank>:<8 hex digits>"
_COUNTER = re.compile(rb"^-?[0-9]{1,18}$")  # what TCPStore's add writes


def parse_value(model: type[M], blob: bytes | str, what: str) -> M:
    """Decodes one value read from the store under its model's bound in :data:`LIMITS`.

    Args:
        model: the pydantic model it must fit.
        blob: the raw value.
        what: how to name it in the error (the key).

    Returns:
        The value.

    Raises:
        ValueError: over the model's size bound, not valid JSON for the model, or holding a
            non-finite number (a :class:`~ncclguard.store.codec.DecodeError`).
    """
    return decode(model, blob, what, LIMITS.get(model, DEFAULT_LIMIT))


def _of_rank(rank: int) -> Callable[[Heartbeat], str | None]:
    """A check that a heartbeat (or statement) read under ``rank``'s key says it is ``rank``'s."""
    return lambda value: None if value.rank == rank else f"says rank {value.rank}"


class StoreExchange:
    """What every read and write of the watchdog stands on: its calls bounded, its values parsed and
    checked, its counters and claims kept sound (:class:`WatchdogStore` is the protocol on it).

    Args:
        store: a c10d Store (a ``TCPStore`` client of its own; an in-memory ``HashStore`` in tests).
        keys: the key schema.
        timeout: the bound of each call (``WatchdogConfig.store_timeout``).
        gone_after: silence after which the store counts as gone (``peer_timeout``).
    """

    # store: Any, as a Store or a test double or proxy with its methods (tests' GoneStore,
    # benchmarks' CountingStore).
    def __init__(self, store: Any, keys: Keys, timeout: float, gone_after: float) -> None:
        self._keys = keys
        self.calls = BoundedCalls(store, timeout, gone_after)
        self._warned: set[str] = set()
        self._refused: set[str] = set()  # counters whose value the server would not count on
        self._beats: dict[str, tuple[bytes, Heartbeat]] = {}  # key -> the last value read there, parsed
        self._readings_cut = False  # a heartbeat was sent without its sensors' readings (said once)

    @property
    def keys(self) -> Keys:
        """The key schema in use."""
        return self._keys

    @keys.setter
    def keys(self, keys: Keys) -> None:
        """Moves to another namespace (a new world generation): what was learned about the old
        keys (parsed heartbeats, warned and refused keys) is forgotten."""
        self._keys = keys
        self._new_namespace()

    def _new_namespace(self) -> None:
        """Forgets what was learned about the keys of the namespace before."""
        self._warned.clear()
        self._refused.clear()
        self._beats.clear()

    def close(self) -> None:
        """Ends the helper thread of the calls (a later call starts a new one)."""
        self.calls.close()

    @property
    def store(self) -> Any:  # the Store given, or its test double (see __init__)
        """The client (a new one after the server closed the previous connection)."""
        return self.calls.store

    @classmethod
    def connect(cls, addr: str, keys: Keys, timeout: float, gone_after: float) -> Self:
        """A new TCPStore client of the server at ``addr`` (``host:port``).

        Raises:
            StoreTimeout, StoreUnreachable: the server did not answer.
        """
        host, _, port = addr.rpartition(":")
        client = BoundedCalls(addr, timeout, 0.0).run(connect, host, int(port), timeout)  # a failed connect is final
        return cls(client, keys, timeout, gone_after)

    def _call(self, method: str, *args: Any) -> Any:
        key = args[0] if args and isinstance(args[0], str) else ""
        # The method is looked up at call time: after a reconnect, ``store`` is a new client.
        return self.calls.run(lambda: getattr(self.store, method)(*args), what=f"{method} {key}".strip())

    def warn_once(self, key: str, text: str) -> None:
        """Logs ``text`` about the value under ``key``: once, until that key reads well again."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning("watchdog: ignored a value from the store: %s", text)

    def _read_well(self, key: str) -> None:
        self._warned.discard(key)

    def _counter(self, key: str, k: int) -> int:
        """``add(key, k)``; a key on which the server refused ``add`` is read first until it holds a
        number again (each refused ``add`` costs a connection). Raises StoreRefused meanwhile."""
        if key in self._refused:
            if self._call("check", [key]):
                raw = bytes(self._call("get", key))
                if not _COUNTER.match(raw):
                    raise StoreRefused(f"{key} holds {raw[:40]!r}, not a counter")
            self._refused.discard(key)
        try:
            value = int(self._call("add", key, k))
        except StoreRefused as exc:
            self._refused.add(key)
            self.warn_once(
                key,
                f"{key} is not a number that ncclguard counted ({exc}); it is left alone until it is deleted or "
                "holds a number again",
            )
            raise
        self._read_well(key)
        return value

    def _take(self, key: str, mine: str, valid: Callable[[str], bool]) -> bool:
        """compare-and-set of ``mine`` into an empty ``key``: True when this client holds it. A value
        there that ``valid`` refuses (ncclguard did not write it) is taken over, with one log line."""
        got = bytes(self._call("compare_set", key, "", mine))
        text = got.decode(errors="replace")
        if text == mine:
            return True
        if valid(text):
            return False
        self.warn_once(key, f"{key} held {got[:60]!r}, which no rank wrote; taking it over")
        return bytes(self._call("compare_set", key, got, mine)).decode(errors="replace") == mine

    def _read_present(self, keys: Sequence[str]) -> list[tuple[int, bytes]]:
        """(index, value) of each of ``keys`` that exists, read :data:`READ_CHUNK` keys a call, each
        call under its own bound. ``check`` of a chunk's keys is one request (true when all exist:
        the usual case, watched peers that beat); only when some are missing is each checked
        (``multi_get`` waits for a missing key instead of failing)."""
        out: list[tuple[int, bytes]] = []
        for lo in range(0, len(keys), READ_CHUNK):
            part = keys[lo : lo + READ_CHUNK]

            def read(part: Sequence[str] = part, lo: int = lo) -> list[tuple[int, bytes]]:
                found = read_present(self.store, part)
                return [(lo + i, found[k]) for i, k in enumerate(part) if k in found]

            out.extend(self.calls.run(read))
        return out

    def _parse(self, model: type[M], blob: bytes, key: str, check: Callable[[M], str | None] | None = None) -> M | None:
        """``blob`` parsed into ``model``, checked by ``check`` (a complaint, or None); None and one
        log line per bad key (until it reads well again) when it does not fit."""
        try:
            value = parse_value(model, blob, key)
            wrong = check(value) if check is not None else None
            if wrong is not None:
                raise ValueError(f"{key}: {wrong}")
        except ValueError as exc:
            self.warn_once(key, str(exc))
            return None
        self._read_well(key)
        return value

    @staticmethod
    def _encode(value: BaseModel) -> str:
        return encode(value)


class WatchdogStore(StoreExchange):
    """The watchdog's reads and writes, typed, bounded and validated (the arguments: :class:`StoreExchange`'s)."""

    # ----------------------------------------------------------------- heartbeats

    def publish_heartbeat(self, hb: Heartbeat) -> None:
        """Sets this rank's heartbeat, cut to its size bound (:meth:`heartbeat_text`)."""
        self._call("set", self.keys.heartbeat(hb.rank), self.heartbeat_text(hb))

    def heartbeat_text(self, hb: Heartbeat) -> str:
        """``hb`` as published, cut to its size bound: the oldest 16 ops in flight, then without the
        sensors' readings (a peer refuses a heartbeat over the bound, and a rank whose heartbeats
        are refused looks lost)."""
        text = self._encode(hb)
        if len(text) > LIMITS[Heartbeat]:
            text = self._encode(hb := hb.model_copy(update={"inflight": hb.inflight[:16]}))
        if len(text) > LIMITS[Heartbeat] and hb.readings:
            if not self._readings_cut:  # once: a sensor that publishes too much does so every heartbeat
                log.warning("watchdog: the sensors' readings make a heartbeat %d bytes; they are left out", len(text))
                self._readings_cut = True
            text = self._encode(hb.model_copy(update={"readings": None}))
        return text

    def read_heartbeats(self, ranks: Sequence[int]) -> dict[int, Heartbeat]:
        """The heartbeats of ``ranks`` that exist and parse, by rank. A value that has not changed
        since the last read is not parsed again (a peer beats every ``heartbeat_s``; this rank may
        read more often, and a parse and check cost ~100 us)."""
        keys = [self.keys.heartbeat(r) for r in ranks]
        return self.parse_heartbeats(ranks, keys, self._read_present(keys))

    def parse_heartbeats(
        self, ranks: Sequence[int], keys: Sequence[str], found: Sequence[tuple[int, bytes]]
    ) -> dict[int, Heartbeat]:
        """The heartbeats ``found`` (index into ``ranks`` and ``keys``, raw value) that parse, by rank;
        an unchanged value is not parsed again (:meth:`read_heartbeats`)."""
        out = {}
        for i, blob in found:
            key, raw = keys[i], bytes(blob)
            last = self._beats.get(key)
            if last is not None and last[0] == raw:
                out[ranks[i]] = last[1]
                continue
            hb = self._parse(Heartbeat, raw, key, _of_rank(ranks[i]))
            if hb is None:
                self._beats.pop(key, None)
            else:
                self._beats[key], out[ranks[i]] = (raw, hb), hb
        return out

    def put_index(self, key: str, index: BaseModel) -> None:
        """Sets the job's index under ``key`` (:func:`ncclguard.store.keys.index_key`): where a
        reader outside the job (``python -m ncclguard status``) finds this namespace."""
        self._call("set", key, self._encode(index))

    # ----------------------------------------------------------------- incidents

    def incident_count(self) -> int:
        """Incidents numbered so far in this namespace (with the node tier, possibly as its node's
        copy of a moment ago: :meth:`job_incident_count` reads the job's store itself).

        Raises:
            StoreRefused: the counter holds something that is not a number.
        """
        return self.job_incident_count()

    def job_incident_count(self) -> int:
        """Incidents numbered so far in this namespace, as the job's store counts them (StoreRefused:
        not a number there)."""
        return self._counter(self.keys.count, 0)

    def claim(self, signature: str, token: str) -> bool:
        """True when this rank is the first to raise the incident ``signature`` (``token``:
        ``"<rank>:<8 hex digits>"``; a claim of another shape is taken over)."""
        return self._take(self.keys.claim(signature), token, lambda v: _CLAIM_TOKEN.match(v) is not None)

    def number_incident(self) -> int:
        """The next incident number.

        Raises:
            StoreRefused: the counter holds something that is not a number.
        """
        return self._counter(self.keys.count, 1)

    def put_incident(self, doc: IncidentDoc) -> None:
        self._call("set", self.keys.incident(doc.n), self._encode(doc))

    def has_incident(self, n: int) -> bool:
        return bool(self._call("check", [self.keys.incident(n)]))

    def read_incident(self, n: int, blob: bytes | None = None) -> IncidentDoc | None:
        """Incident ``n`` as described by its creator (``blob``: as read already, a node's copy); None when
        it does not parse, names another number, or has an id that is no plain name (:data:`INCIDENT_ID`)."""
        key = self.keys.incident(n)

        def check(doc: IncidentDoc) -> str | None:
            if doc.n != n:
                return f"describes incident {doc.n}, not {n}"
            if not INCIDENT_ID.match(doc.id):
                return f"id {doc.id[:80]!r} is not a plain directory name (letters, digits, '_', '.', '-'; 128 at most)"
            return None

        return self._parse(IncidentDoc, self._call("get", key) if blob is None else blob, key, check)

    def statement_items(self, n: int, statement: Statement) -> list[tuple[str, str]]:
        """This rank's statement on incident ``n`` as stored, under its key: cut to its size bound if
        needed. In a world of more than :data:`BRIEF_FROM` ranks, with its newest :data:`BRIEF_RECENT`
        ops and innermost :data:`BRIEF_FRAMES` frames, and its head (:meth:`Statement.head`) beside
        it: the merge reads every rank's head, and whole statements of a few."""
        head = statement.head() if statement.world_size > BRIEF_FROM else None
        if head is not None:
            brief = {"recent": statement.recent[-BRIEF_RECENT:], "stack": statement.stack[-BRIEF_FRAMES:]}
            statement = statement.model_copy(update=brief)
        text = self._encode(statement)
        cuts: list[dict[str, Any]] = [
            {"recent": []},
            {"recent": [], "stack": statement.stack[-20:], "inflight": statement.inflight[:16]},
        ]
        for cut in cuts:
            if len(text) <= LIMITS[Statement]:
                break
            text = self._encode(statement.model_copy(update=cut))
        items = [(self.keys.statement(n, statement.rank), text)]
        return items if head is None else [*items, (self.keys.head(n, statement.rank), self._encode(head))]

    def put_statement(self, n: int, statement: Statement) -> None:
        """Publishes this rank's statement on incident ``n`` (:meth:`statement_items`), in one request."""
        self.put_items(self.statement_items(n, statement))

    def put_items(self, items: Sequence[tuple[str, str | bytes]]) -> None:
        """Sets each ``(key, value)`` of ``items`` in one request."""
        if len(items) == 1:
            self._call("set", *items[0])
        else:
            self._call("multi_set", [k for k, _ in items], [v for _, v in items])

    def file_statement(self, n: int, statement: Statement) -> bool | None:
        """Files this rank's statement on incident ``n``, counts it dumped, and asks to merge: whether
        this rank merges (:meth:`claim_merger`), or None while it waits in the node's store to be
        carried (the node tier's store; :meth:`file_later`)."""
        self.put_statement(n, statement)
        self.add_dumped(n)
        return self.claim_merger(n, statement.rank, statement.world_size)

    def file_later(self, n: int) -> bool | None:
        """Goes on with a filing :meth:`file_statement` left waiting (None: still; nothing here: False)."""
        return False

    def add_dumped(self, n: int, k: int = 1) -> int:
        """Counts ``k`` more ranks as having dumped incident ``n``; the count.

        Raises:
            StoreRefused: the counter holds something that is not a number.
        """
        return self._counter(self.keys.dumped(n), k)

    def claim_merger(self, n: int, rank: int, world_size: int = 1 << 30) -> bool:
        """True when ``rank`` is the first to ask to merge incident ``n`` (a value there that is
        not a rank below ``world_size`` is taken over)."""
        return self._take(self.keys.merger(n), str(rank), lambda v: v.isdigit() and int(v[:10]) < world_size)

    def read_statements(self, n: int, ranks: Sequence[int]) -> dict[int, Statement]:
        """The statements of ``ranks`` on incident ``n`` that exist and parse, by rank."""
        return self._read_statements([self.keys.statement(n, r) for r in ranks], ranks)

    def read_heads(self, n: int, ranks: Sequence[int]) -> dict[int, Statement]:
        """The heads (:meth:`Statement.head`) of ``ranks``' statements on incident ``n`` that exist and
        parse, by rank: put beside the statements in a world of more than :data:`BRIEF_FROM` ranks."""
        return self._read_statements([self.keys.head(n, r) for r in ranks], ranks)

    def _read_statements(self, keys: Sequence[str], ranks: Sequence[int]) -> dict[int, Statement]:
        out = {}
        for i, blob in self._read_present(keys):
            st = self._parse(Statement, blob, keys[i], _of_rank(ranks[i]))
            if st is not None:
                out[ranks[i]] = st
        return out

    def put_merged(self, n: int, note: MergedNote) -> None:
        self._call("set", self.keys.merged(n), self._encode(note))

    def read_merged(self, n: int) -> MergedNote | None:
        """The merged note of incident ``n``, or None (not merged yet, or unreadable: logged)."""
        key = self.keys.merged(n)
        got = self._read_present([key])
        return self._parse(MergedNote, got[0][1], key) if got else None

    def put_fenced(self, note: FenceNote) -> None:
        self._call("set", self.keys.fenced(note.rank), self._encode(note))

    def read_world_record(self) -> WorldRecord | None:
        """The job's current world (``ncclguard/world/current``, outside the watchdog's namespace),
        or None: no rebuild recorded one yet, or it is unreadable (logged once)."""
        key = world_record_key()
        got = self._read_present([key])
        return self._parse(WorldRecord, got[0][1], key) if got else None

    def put_value(self, key: str, text: str) -> None:
        """Sets ``text`` (encoded by its owner: a node's digest, its store's address) under ``key``."""
        self._call("set", key, text)

    def put_learned(self, key: str, blob: str) -> None:
        """Sets what this rank learned (:mod:`ncclguard.watching.base.hang_bound`) under ``key``, outside
        the watchdog's namespace: a restarted process of the same launch rank reads it."""
        self._call("set", key, blob)

    def read_learned(self, key: str) -> bytes | None:
        """The value under ``key``, or None; the caller parses it with its size bound."""
        got = self._read_present([key])
        return bytes(got[0][1]) if got else None

    def count_ending(self, k: int = 1) -> int:
        """Counts ``k`` more ranks that know the job is ending (0: reads it); StoreRefused when the
        counter holds no number (:mod:`~ncclguard.watching.ending`)."""
        return self._counter(self.keys.ending, k)

    def set_mark(self, key: str) -> None:
        """Sets the mark ``1`` under ``key``: an incident resolved, the store closing."""
        self._call("set", key, "1")

    def has_mark(self, key: str) -> bool:
        """True once the mark ``1`` is under ``key`` (another value is logged and does not count)."""
        if not self._call("check", [key]):
            return False
        raw = bytes(self._call("get", key))
        if raw != b"1":
            self.warn_once(key, f"{key} holds {raw[:40]!r}, not the mark '1' a rank sets; it does not count")
            return False
        self._read_well(key)
        return True


def default_store_addr() -> str | None:
    """``host:port`` of the default group's TCPStore (a group set up with ``store=``), or None."""
    import torch.distributed as dist

    try:
        store = unprefixed(compat.default_store())
        return f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) else None
    except (RuntimeError, ValueError, AttributeError):
        return None


def store_addr(configured: str | None) -> str | None:
    """Where the watchdog's store is: ``configured``, else ``MASTER_ADDR:MASTER_PORT``, else the
    default group's TCPStore; None when nothing says."""
    import torch.distributed as dist

    if configured is not None:
        return configured
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if dist.is_available() and dist.is_initialized():
        return default_store_addr()
    return None
