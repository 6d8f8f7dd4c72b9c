"""The watchdog's store protocol: its key schema, bounded calls, and validated values.

- :class:`Keys` builds every key the watchdog reads or writes (nowhere else builds one).
- :class:`BoundedCalls` bounds each store call by ``timeout`` (on a helper thread, through
  :mod:`ncclguard._bounded`): a c10d ``TCPStore`` client's own timeout does not bound every call
  (``check`` on a server frozen by SIGSTOP blocked until the server resumed, measured on torch
  2.13), and the watchdog thread must never wait on a dead peer.
- :class:`WatchdogStore` is the protocol itself: typed reads and writes of heartbeats, incidents,
  statements and the merge. Every value read is parsed by a pydantic model under a size bound;
  an oversized or malformed value is dropped with one log line (per key, until it reads well
  again), never raised into the watchdog's loop.

Errors: :class:`~ncclguard.errors.StoreTimeout` for one call that did not answer in time (the
store may be slow; the next tick retries), :class:`~ncclguard.errors.StoreUnreachable` once the
store is gone (a refused or reset connection, or no answer for ``gone_after`` seconds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ncclguard import _torch_compat as compat
from ncclguard._bounded import bounded_store_call
from ncclguard._log import log
from ncclguard.diagnosis.model import Heartbeat, IncidentDoc, MergedNote, Statement
from ncclguard.errors import StoreTimeout, StoreUnreachable

__all__ = ["LIMITS", "BoundedCalls", "Keys", "WatchdogStore", "default_store_addr", "parse_value", "store_addr"]

M = TypeVar("M", bound=BaseModel)

# The largest value the watchdog accepts per model, in bytes of JSON. A statement carries a
# 40-frame stack, 20 recent records and every group's ranks: ~20 KB for 8 ranks, far below.
LIMITS: dict[type[BaseModel], int] = {
    Heartbeat: 256 * 1024,
    Statement: 1024 * 1024,
    IncidentDoc: 64 * 1024,
    MergedNote: 64 * 1024,
}


class Keys:
    """The watchdog's key schema: one namespace per job run, restart and session.

    Args:
        session: the watchdog session (``WatchdogConfig.session``).
        run_id: the job's run id (``TORCHELASTIC_RUN_ID``; ``"run"`` without one).
        restart: the restart count (``TORCHELASTIC_RESTART_COUNT``; a restarted job starts afresh).
    """

    def __init__(self, session: str, run_id: str = "run", restart: str = "0") -> None:
        self.ns = f"ncclguard/wd/{run_id}/{restart}/{session}"

    @classmethod
    def from_env(cls, session: str) -> Keys:
        """The keys of ``session`` in this job, from torchrun's environment."""
        return cls(
            session, os.environ.get("TORCHELASTIC_RUN_ID", "run"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )

    @property
    def count(self) -> str:
        """The incident counter (``add`` numbers incidents from 1)."""
        return f"{self.ns}/count"

    def heartbeat(self, rank: int) -> str:
        return f"{self.ns}/hb/{rank}"

    def claim(self, signature: str) -> str:
        """Taken by the first rank that detects the incident ``signature`` (``hang/0/15``)."""
        return f"{self.ns}/claim/{signature}"

    def incident(self, n: int) -> str:
        return f"{self.ns}/incident/{n}"

    def statement(self, n: int, rank: int) -> str:
        return f"{self.ns}/incident/{n}/st/{rank}"

    def dumped(self, n: int) -> str:
        """Counts the ranks that dumped incident ``n``."""
        return f"{self.ns}/incident/{n}/dumped"

    def merger(self, n: int) -> str:
        """Taken by the rank that merges incident ``n``."""
        return f"{self.ns}/incident/{n}/merger"

    def merged(self, n: int) -> str:
        return f"{self.ns}/incident/{n}/merged"

    def resolved(self, n: int) -> str:
        """Set once the op of hang incident ``n`` completed on some rank."""
        return f"{self.ns}/incident/{n}/resolved"


def parse_value(model: type[M], blob: bytes | str, what: str) -> M:
    """Parses one value read from the store.

    Args:
        model: the pydantic model it must fit.
        blob: the raw value.
        what: how to name it in the error (the key).

    Raises:
        ValueError: over the model's size bound (:data:`LIMITS`), or not valid JSON for the model.
    """
    limit = LIMITS.get(model, 64 * 1024)
    if len(blob) > limit:
        raise ValueError(f"{what}: {len(blob)} bytes, over the {limit}-byte bound of a {model.__name__}")
    try:
        return model.model_validate_json(blob)
    except ValidationError as exc:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        msg = errors[0]["msg"] if errors else str(exc)
        raise ValueError(
            f"{what}: not a valid {model.__name__} ({where or 'value'}: {msg}; {exc.error_count()} error(s))"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class BoundedCalls:
    """Store calls bounded by ``timeout`` each (:func:`ncclguard._bounded.bounded_store_call`: a
    helper thread per call; while a call that missed its deadline is still blocked, later calls
    fail at once), classified for the watchdog: torch's ``DistNetworkError`` (refused, reset)
    means the store is gone; a missed deadline or torch's other errors mean slow, until the store
    has failed for ``gone_after`` seconds in a row.

    Args:
        store: the store the calls talk to.
        timeout: the bound of each call.
        gone_after: seconds of failed calls after which the store counts as gone.
    """

    def __init__(self, store: Any, timeout: float, gone_after: float) -> None:
        self.store, self.timeout, self.gone_after = store, timeout, gone_after
        self._failing_since: float | None = None

    def _fail(self, text: str) -> StoreTimeout | StoreUnreachable:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        silent = now - self._failing_since
        if silent >= self.gone_after:
            return StoreUnreachable(f"no answer for {silent:.1f} s: {text}")
        return StoreTimeout(text)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a call on the store, within ``timeout``; its value.

        Raises:
            StoreTimeout: no answer within ``timeout`` (or an earlier call is still blocked).
            StoreUnreachable: the store is gone.
        """
        from torch.distributed import DistNetworkError

        try:
            value = bounded_store_call(self.store, lambda: fn(*args), self.timeout, "watchdog store call")
        except DistNetworkError as exc:  # broken pipe, connection reset/refused: the server is gone
            raise StoreUnreachable(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        except StoreUnreachable as exc:  # missed its deadline: slow, or gone once it lasts
            raise self._fail(_first_line(exc)) from exc
        except RuntimeError as exc:  # torch's own timeout: slow or gone
            raise self._fail(_first_line(exc)) from exc
        self._failing_since = None
        return value


class WatchdogStore:
    """The watchdog's reads and writes, typed, bounded and validated.

    Args:
        store: a c10d Store (a ``TCPStore`` client of its own; an in-memory ``HashStore`` in tests).
        keys: the key schema.
        timeout: the bound of each call (``WatchdogConfig.store_timeout``).
        gone_after: silence after which the store counts as gone (``peer_timeout``).
    """

    def __init__(self, store: Any, keys: Keys, timeout: float, gone_after: float) -> None:
        self.store, self.keys = store, keys
        self.calls = BoundedCalls(store, timeout, gone_after)
        self._warned: set[str] = set()

    @classmethod
    def connect(cls, addr: str, keys: Keys, timeout: float, gone_after: float) -> WatchdogStore:
        """A new TCPStore client of the server at ``addr`` (``host:port``).

        Raises:
            StoreTimeout, StoreUnreachable: the server did not answer.
        """
        import torch.distributed as dist

        host, _, port = addr.rpartition(":")
        client = BoundedCalls(addr, timeout, 0.0).run(  # a failed connect is final
            lambda: dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
        )
        return cls(client, keys, timeout, gone_after)

    def _call(self, method: str, *args: Any) -> Any:
        return self.calls.run(getattr(self.store, method), *args)

    def _read_present(self, keys: Sequence[str]) -> list[tuple[int, bytes]]:
        """(index, value) of each of ``keys`` that exists: checked one by one, then read in one call."""

        def read() -> list[tuple[int, bytes]]:
            present = [i for i, k in enumerate(keys) if self.store.check([k])]
            return list(zip(present, self.store.multi_get([keys[i] for i in present]), strict=True)) if present else []

        return list(self.calls.run(read))

    def _parse(self, model: type[M], blob: bytes, key: str) -> M | None:
        try:
            value = parse_value(model, blob, key)
        except ValueError as exc:
            if key not in self._warned:  # one line per bad key, until it reads well again
                self._warned.add(key)
                log.warning("watchdog: ignored a value from the store: %s", exc)
            return None
        self._warned.discard(key)
        return value

    @staticmethod
    def _encode(value: BaseModel) -> str:
        return value.model_dump_json(by_alias=True)

    # ----------------------------------------------------------------- heartbeats

    def publish_heartbeat(self, hb: Heartbeat) -> None:
        """Sets this rank's heartbeat (cut to its size bound: the oldest 16 ops in flight)."""
        text = self._encode(hb)
        if len(text) > LIMITS[Heartbeat]:
            text = self._encode(hb.model_copy(update={"inflight": hb.inflight[:16]}))
        self._call("set", self.keys.heartbeat(hb.rank), text)

    def read_heartbeats(self, ranks: Sequence[int]) -> dict[int, Heartbeat]:
        """The heartbeats of ``ranks`` that exist and parse, by rank."""
        keys = [self.keys.heartbeat(r) for r in ranks]
        out = {}
        for i, blob in self._read_present(keys):
            hb = self._parse(Heartbeat, blob, keys[i])
            if hb is not None:
                out[ranks[i]] = hb
        return out

    # ----------------------------------------------------------------- incidents

    def incident_count(self) -> int:
        """Incidents numbered so far in this namespace."""
        return int(self._call("add", self.keys.count, 0))

    def claim(self, signature: str, token: str) -> bool:
        """True when this rank is the first to raise the incident ``signature``."""
        got = self._call("compare_set", self.keys.claim(signature), "", token)
        return bytes(got).decode(errors="replace") == token

    def number_incident(self) -> int:
        """The next incident number."""
        return int(self._call("add", self.keys.count, 1))

    def put_incident(self, doc: IncidentDoc) -> None:
        self._call("set", self.keys.incident(doc.n), self._encode(doc))

    def has_incident(self, n: int) -> bool:
        return bool(self._call("check", [self.keys.incident(n)]))

    def read_incident(self, n: int) -> IncidentDoc | None:
        """Incident ``n`` as described by its creator; None when its value does not parse."""
        key = self.keys.incident(n)
        return self._parse(IncidentDoc, self._call("get", key), key)

    def put_statement(self, n: int, statement: Statement) -> None:
        """Publishes this rank's statement on incident ``n`` (cut to its size bound if needed)."""
        text = self._encode(statement)
        cuts: list[dict[str, Any]] = [
            {"recent": []},
            {"recent": [], "stack": statement.stack[-20:], "inflight": statement.inflight[:16]},
        ]
        for cut in cuts:
            if len(text) <= LIMITS[Statement]:
                break
            text = self._encode(statement.model_copy(update=cut))
        self._call("set", self.keys.statement(n, statement.rank), text)

    def add_dumped(self, n: int, k: int = 1) -> int:
        """Counts ``k`` more ranks as having dumped incident ``n``; the count."""
        return int(self._call("add", self.keys.dumped(n), k))

    def claim_merger(self, n: int, rank: int) -> bool:
        """True when ``rank`` is the first to ask to merge incident ``n``."""
        mine = str(rank)
        return bytes(self._call("compare_set", self.keys.merger(n), "", mine)).decode(errors="replace") == mine

    def read_statements(self, n: int, ranks: Sequence[int]) -> dict[int, Statement]:
        """The statements of ``ranks`` on incident ``n`` that exist and parse, by rank."""
        keys = [self.keys.statement(n, r) for r in ranks]
        out = {}
        for i, blob in self._read_present(keys):
            st = self._parse(Statement, blob, keys[i])
            if st is not None:
                out[ranks[i]] = st
        return out

    def put_merged(self, n: int, note: MergedNote) -> None:
        self._call("set", self.keys.merged(n), self._encode(note))

    def mark_resolved(self, n: int) -> None:
        self._call("set", self.keys.resolved(n), "1")

    def is_resolved(self, n: int) -> bool:
        return bool(self._call("check", [self.keys.resolved(n)]))


def default_store_addr() -> str | None:
    """``host:port`` of the default group's TCPStore (a group set up with ``store=``), or None."""
    import torch.distributed as dist

    try:
        store = compat.default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
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
