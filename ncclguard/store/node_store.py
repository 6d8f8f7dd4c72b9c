"""The node tier's own store (docs/scale.md): the ``TCPStore`` served to a node's ranks, and the few
exchanges made with it.

Under ``ncclguard run`` the launcher serves it (one process a node, which outlives its ranks) and
names it to them in :data:`LAUNCHER_VAR`; the node's agent is then whichever rank holds the lease
in it (:func:`claim_agent`). Without a launcher, the ``LOCAL_RANK`` 0 process serves it and runs the
agent. One server per process for the process's life: ``ncclguard run``'s watchdog gives way to the
script's, and the ranks linked to the store the first one served stay linked. Unbounded calls: make
them inside a bounded call (:class:`~ncclguard.store.bounded_calls.BoundedCalls`).

The node store this process's watchdog is linked to is noted here (:func:`note_linked`), so that
another thread's two-tier round (``should_commit``, :mod:`~ncclguard.store.tier_round`) connects
its own client to it (:func:`near_client`): a client runs one request at a time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import connect
from ncclguard.store.codec import decode, encode

__all__ = [
    "AGENT_KEY",
    "LAUNCHER_VAR",
    "AgentLease",
    "claim_agent",
    "claim_carry",
    "claim_window",
    "drop_near_client",
    "file_in_node",
    "get_present",
    "launcher_address",
    "linked_address",
    "near_client",
    "near_getter",
    "note_linked",
    "put",
    "put_all",
    "serve",
]

# The node's store that ``ncclguard run``'s launcher serves its node's ranks ("127.0.0.1:PORT").
LAUNCHER_VAR = "NCCLGUARD_NODE_STORE"
ADDR_MAX = 300  # bytes of a node store's "host:port"
# The lease on the node's agent, in the launcher's store. Not per world: the store outlives worlds
# and ranks, and a lease names a process.
AGENT_KEY = "ncclguard/node_agent"
LEASE_LIMIT = 512  # bytes of a lease
# A read through the node's store (store/deaths.py, relay_deaths): each call on the node's own host,
# a frozen store given up in time for the reader to read the job's store at its next look.
NEAR_TIMEOUT_S = 2.0


class AgentLease(BaseModel):
    """Which process runs the node's agent, and until when (``time.time()``: one host's clock)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    holder: str = Field(min_length=1, max_length=64)  # "pid/local_rank"
    until: float


class _Served:
    """The node's store this process serves (made at the first :func:`serve`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Any = None  # a c10d TCPStore server


_served = _Served()


def serve(timeout_s: float, fresh: bool = False) -> Any:
    """The ``TCPStore`` server this process serves its node's ranks, on a free port of this host's
    loopback.

    Args:
        timeout_s: the server's own clients' timeout.
        fresh: a new server, not the process's (tests that play several nodes in one process).

    Returns:
        The server (a c10d Store; its ``port`` is where the node's ranks connect).

    Raises:
        RuntimeError, DistStoreError: no port could be served.
    """
    with _served.lock:
        if _served.store is None or fresh:
            store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
            if fresh:
                return store
            _served.store = store
        return _served.store


def launcher_address(env: Mapping[str, str] | None = None) -> str:
    """The ``host:port`` of the node's store the launcher serves (:data:`LAUNCHER_VAR`), or ``""``
    where none is named or the value is not a ``host:port``.

    Args:
        env: the environment to read; default ``os.environ``.
    """
    raw = (os.environ if env is None else env).get(LAUNCHER_VAR, "").strip()
    host, _, port = raw.rpartition(":")
    if not host or len(raw) > ADDR_MAX or not port.isdecimal() or not 0 < int(port) < 65536:
        return ""
    return raw


def claim_agent(store: Any, me: str, now: float, span_s: float) -> bool:
    """Takes or renews the lease on the node's agent for ``me`` (a compare-and-set, so two ranks that
    claim together do not both win).

    Args:
        store: a client of the node's store.
        me: this process (``"pid/local_rank"``).
        now: ``time.time()``.
        span_s: how long the lease holds unless renewed.

    Returns:
        True when ``me`` holds the lease now: it was free, lapsed, unreadable, or already ``me``'s.
    """
    raw = get_present(store, AGENT_KEY)
    if raw is not None:
        try:
            held = decode(AgentLease, raw, AGENT_KEY, LEASE_LIMIT)
            if held.holder != me and held.until > now:
                return False
        except ValueError:
            pass  # not a lease (junk, or too big): taken over, by a compare-and-set on what is there
    new = encode(AgentLease(holder=me, until=now + span_s))
    got = store.compare_set(AGENT_KEY, b"" if raw is None else raw, new)
    return bytes(got) == new.encode()


def put(store: Any, key: str, value: str) -> None:
    """Sets ``value`` under ``key``."""
    store.set(key, value)


def put_all(store: Any, keys: Sequence[str], values: Sequence[str]) -> None:
    """Sets each of ``values`` under its key, in one request."""
    store.multi_set(list(keys), list(values))


def get_present(store: Any, key: str) -> bytes | None:
    """The value under ``key``, or None when there is none (a ``check``, then a ``get``)."""
    return bytes(store.get(key)) if store.check([key]) else None


def claim_window(store: Any, relay: str, slot: int) -> bool:
    """True for the first caller in window ``slot`` under ``relay`` (an ``add``): the one rank of
    the node that reads the job's store for the others in that window. It deletes the key of the
    window claimed before (named under ``<relay>/at``), so that one is left.

    Args:
        store: the node's store.
        relay: the windows' prefix.
        slot: the window's number (the time over its length).
    """
    if int(store.add(f"{relay}/{slot}", 1)) != 1:
        return False
    at = f"{relay}/at"
    if store.check([at]):
        last = bytes(store.get(at)).decode(errors="replace")
        if last.isdecimal() and int(last) != slot:
            store.delete_key(f"{relay}/{int(last)}")
    store.set(at, str(slot))
    return True


def file_in_node(store: Any, items: Sequence[tuple[str, str]], filed: str, count: str, rank: int) -> int:
    """Sets ``items`` (a rank's statement on an incident) in the node's store, appends ``rank`` to
    the list under ``filed`` and counts it under ``count``, in that order; the count.

    Args:
        store: the node's store.
        items: ``(key, value)`` pairs, set in one request.
        filed: the node's list of the ranks that filed (``"r,"`` each).
        count: the node's count of them.
        rank: this rank.
    """
    store.multi_set([k for k, _ in items], [v for _, v in items])
    store.append(filed, f"{rank},")
    return int(store.add(count, 1))


def claim_carry(store: Any, claim: str, filed: str, carried: str, max_bytes: int) -> bytes | None:
    """Claims the carrying of what a node's ranks filed (:func:`file_in_node`): the first ``add``
    under ``claim`` takes it. The claimer reads the list under ``filed`` (at most ``max_bytes``) and
    sets it under ``carried`` before it carries: a rank whose name is not there files by itself.

    Returns:
        The list as read (raw: the caller parses it), for the claimer; None for the others.
    """
    if int(store.add(claim, 1)) != 1:
        return None
    raw = bytes(store.get(filed))[:max_bytes] if store.check([filed]) else b""
    store.set(carried, raw)
    return raw


class _Linked:
    """The node store this process's watchdog reads and writes (``""``: none), and each thread's
    client of it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.addr = ""
        self.local = threading.local()  # .clients: {addr: client}


_linked = _Linked()


def note_linked(addr: str) -> None:
    """Notes the ``host:port`` of the node store this process's watchdog is linked to (``""``: it
    dropped it)."""
    with _linked.lock:
        _linked.addr = addr


def linked_address() -> str:
    """The ``host:port`` of the node store this process's watchdog is linked to, or ``""``."""
    with _linked.lock:
        return _linked.addr


def near_client(timeout_s: float, deadline: Deadline) -> Any | None:
    """The calling thread's client of the node store the watchdog is linked to, connected once per
    thread and address.

    Args:
        timeout_s: the client's own timeout.
        deadline: when its connection must be made.

    Returns:
        The client; None when the watchdog is linked to none, or the connection failed (one log line).
    """
    addr = linked_address()
    if not addr:
        return None
    clients: dict[str, Any] | None = getattr(_linked.local, "clients", None)
    if clients is None:
        clients = _linked.local.clients = {}
    if addr not in clients:
        host, _, port = addr.rpartition(":")
        try:
            clients[addr] = bounded_store_call(
                _linked, lambda: connect(host, int(port), timeout_s), deadline, f"connect to the node's store at {addr}"
            )
        except (StoreUnreachable, RuntimeError, dist.DistStoreError, ValueError) as exc:
            log.info("node tier: no client of the node's store at %s (%s)", addr, exc)
            return None
    return clients[addr]


def near_getter(timeout_s: float = NEAR_TIMEOUT_S) -> Callable[[], Any | None]:
    """A getter of the calling thread's client of the node's store (:func:`near_client`), for the
    reads that go through the node tier where it is on (``DeathWatch(near=...)``).

    Args:
        timeout_s: the client's own timeout, and the bound on connecting it.

    Returns:
        A function returning the client, or None where the watchdog is linked to no node's store.
    """
    return lambda: near_client(timeout_s, Deadline.within(timeout_s))


def drop_near_client(client: Any) -> None:
    """Forgets the calling thread's ``client`` (its store failed): the next round connects anew."""
    clients: dict[str, Any] = getattr(_linked.local, "clients", {})
    for addr in [a for a, c in clients.items() if c is client]:
        del clients[addr]
