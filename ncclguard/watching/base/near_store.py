"""A rank's side of the node tier: its heartbeats go to its node's store, not the job's.

:class:`TieredWatchdogStore` is the watchdog's store (:class:`WatchdogStore`) of a rank whose job
runs the node tier (docs/scale.md). Its heartbeat, its reads of the watched peers' heartbeats and
its look at the ``closing`` mark go to its node's store: the one ``ncclguard run``'s launcher serves
(named in ``NCCLGUARD_NODE_STORE``), else the one its node's agent serves
(:mod:`~ncclguard.watching.base.node_agent`). That store holds the node's ranks' heartbeats and the
copies of the watched nodes' digests. An incident's statements are filed there too, one carrier a
node taking them to the job's store, and the incident counter and new incidents' descriptions are
read there, one rank a node a window copying them in (:mod:`~ncclguard.watching.base.near_filing`);
the merge and everything else go to the job's store as before.

Nothing waits on the node's store: a call to it that fails drops it (one log line), and the rank
talks to the job's store directly until the agent names a store again. A watched peer that the
node's store does not hold, or holds unchanged for :data:`FROZEN_BEATS` heartbeats (its node's
agent stopped, or this node's), is read from the job's store too, where a rank without its node's
store publishes; the newer heartbeat wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.model import Heartbeat, IncidentDoc, Statement
from ncclguard.store import node_store
from ncclguard.store.bounded_calls import BoundedCalls
from ncclguard.store.clients import connect
from ncclguard.store.codec import decode
from ncclguard.store.keys import Keys
from ncclguard.store.rounds import read_present
from ncclguard.watching.base.near_filing import NodeFiling, RelayedCount
from ncclguard.watching.base.node_layout import DIGEST_LIMIT, Digest, NodeLayout, watched_nodes
from ncclguard.watching.base.watchdog_store import WatchdogStore

if TYPE_CHECKING:
    from ncclguard.watching.base.node_agent import LeasedAgent, NodeAgent

__all__ = ["FROZEN_BEATS", "TieredWatchdogStore", "read_digests"]

T = TypeVar("T")
FROZEN_BEATS = 3  # a copy unchanged this many heartbeats is also read from the job's store
RETRY_BEATS = 10  # heartbeats before a node's store that failed is tried again at the same address
ADDR_MAX = node_store.ADDR_MAX


class TieredWatchdogStore(WatchdogStore):
    """The watchdog's store with the node tier on (see the module doc).

    Args:
        store: the client of the job's store.
        keys: the key schema.
        timeout: the bound of each call, on either store.
        gone_after: silence after which a store counts as gone.
        layout: where this process stands among the nodes.
        heartbeat_s: the watchdog's heartbeat (how often the node's store is looked for, and what
            "frozen" counts in).
        launcher: the ``host:port`` of the node's store the launcher serves; default: the one
            ``NCCLGUARD_NODE_STORE`` names, ``""`` for none (the node's agent names its own).
        carry_wait_s: how long a node's ranks wait for all of its statements on an incident
            before one carries what came (:mod:`~ncclguard.watching.base.near_filing`); default
            half a heartbeat.
    """

    def __init__(
        self,
        store: Any,
        keys: Keys,
        timeout: float,
        gone_after: float,
        layout: NodeLayout,
        heartbeat_s: float,
        launcher: str | None = None,
        carry_wait_s: float | None = None,
    ):
        super().__init__(store, keys, timeout, gone_after)
        self.filing = NodeFiling(self, heartbeat_s / 2 if carry_wait_s is None else carry_wait_s)
        self.counter = RelayedCount(self, min(heartbeat_s / 2, 1.0))
        self._docs: dict[int, bytes] = {}  # incidents' descriptions read in the node's store, not yet parsed
        self.layout, self.heartbeat_s = layout, heartbeat_s
        self.launcher = node_store.launcher_address() if launcher is None else launcher
        self.near: BoundedCalls | None = None  # the node's store, while it answers
        self.near_addr = ""
        self._next_look = 0.0  # monotonic time of the next look for the node's store's address
        self._member_ns = ""  # the namespace in which this rank told the node's store its rank
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> its copy in the node's store, since when
        # The address that last failed, and when it may be tried again: a stopped agent's port still
        # takes a TCP connection, and each try would hold this watchdog's thread a call's bound.
        self._failed: tuple[str, float] = ("", 0.0)
        # The node's agent where this process runs it: LOCAL_RANK 0's, or the lease's under a launcher's store.
        self.agent: NodeAgent | LeasedAgent | None = None

    def _new_namespace(self) -> None:
        super()._new_namespace()
        self.filing.pending.clear()
        self._docs.clear()
        self._member_ns = ""
        self._seen.clear()

    def close(self) -> None:
        """Ends the helper threads of both stores' calls, and of the agent's."""
        super().close()
        if self.near is not None:
            self.near.close()
        if self.agent is not None:
            self.agent.close()

    # ----------------------------------------------------------------- the node's store

    def _look(self) -> None:
        """Connects to the node's store: the launcher's, else the one its agent named in the job's
        store (looked for at most every heartbeat; the named one also while the launcher's fails)."""
        now = time.monotonic()
        if self.near is not None or now < self._next_look:
            return
        self._next_look = now + self.heartbeat_s
        key = self.keys.node_addr(self.layout.node)
        if self.launcher and not (self._failed[0] == self.launcher and now < self._failed[1]):
            addr = self.launcher
        else:
            got = self._read_present([key])
            if not got:
                return
            addr = bytes(got[0][1])[:ADDR_MAX].decode(errors="replace")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdecimal() or len(port) > 5:
            self.warn_once(key, f"{key} holds {addr[:60]!r}, not the 'host:port' a node's agent writes")
            return
        if self._failed[0] == addr and now < self._failed[1]:
            return
        try:
            client = BoundedCalls(addr, self.timeout, 0.0).run(connect, host, int(port), self.timeout)
        except (StoreTimeout, StoreUnreachable) as exc:
            log.info(
                "watchdog: the node's store at %s did not take a connection (%s); the job's store meanwhile", addr, exc
            )
            self._failed = (addr, now + RETRY_BEATS * self.heartbeat_s)
            return
        self.near, self.near_addr, self._member_ns = BoundedCalls(client, self.timeout, self.gone_after), addr, ""
        node_store.note_linked(addr)  # should_commit's rounds go through it too (store/tier_round.py)
        log.info("watchdog: node tier: heartbeats through node %d's store at %s", self.layout.node, addr)

    @property
    def timeout(self) -> float:
        """The bound of each call."""
        return self.calls.timeout

    @property
    def gone_after(self) -> float:
        """Silence after which a store counts as gone."""
        return self.calls.gone_after

    def on_near(self, fn: Callable[[Any], T], what: str) -> tuple[bool, T | None]:
        """``(True, fn(client))`` on the node's store, or ``(False, None)``: no node store, or it did
        not answer this time (the caller turns to the job's store for this call). A node's store
        gone (no answer for ``gone_after`` seconds, or its process ended) is dropped with one log
        line until its agent names a store again."""
        near = self.near
        if near is None:
            return False, None
        try:
            return True, near.run(lambda: fn(near.store), what=what)
        except StoreUnreachable as exc:
            log.warning(
                "watchdog: node tier: the node's store at %s is gone (%s); this rank talks to the job's store until its "
                "agent names a store again",
                self.near_addr,
                exc,
            )
            near.close()
            self.near = None
            node_store.note_linked("")
            self._failed = (self.near_addr, time.monotonic() + RETRY_BEATS * self.heartbeat_s)
        except StoreTimeout:
            pass  # slow (a loaded host, an agent stopped): the job's store this time
        return False, None

    def _from_job(self, ranks: Sequence[int]) -> dict[int, Heartbeat]:
        """``ranks``' newest heartbeats in the job's store: published there directly (a rank without
        its node's store), or in the digests of their nodes as torchrun numbers them and of the nodes
        next to this one (a rebuild that left ranks out renumbers the rest, in order)."""
        out = WatchdogStore.read_heartbeats(self, ranks)
        lay = self.layout
        near = watched_nodes(lay.node, lay.nodes, len(ranks), lay.local_size)
        nodes = sorted({r // lay.local_size for r in ranks if r // lay.local_size < lay.nodes} | {lay.node, *near})
        for digest in read_digests(self, self.keys, nodes).values():
            for r in ranks:
                text = digest.beats.get(r)
                if text is None:
                    continue
                hb = self.parse_heartbeats([r], [f"{self.keys.digest(digest.node)}#{r}"], [(0, text.encode())]).get(r)
                if hb is not None and (r not in out or _newer(hb, out[r])):
                    out[r] = hb
        return out

    # ----------------------------------------------------------------- heartbeats

    def publish_heartbeat(self, hb: Heartbeat) -> None:
        """Sets this rank's heartbeat in its node's store (after saying there which rank this process
        is in the world, once per world); in the job's store without a node's store, and also there
        when it is the last (``finished``: the node's store may end before the peers read it)."""
        self._look()
        text = self.heartbeat_text(hb)
        key, ns = self.keys.heartbeat(hb.rank), self.keys.ns

        def put(client: Any) -> None:
            if self._member_ns != ns:
                node_store.put(client, self.keys.member(self.layout.local_rank), str(hb.rank))
            node_store.put(client, key, text)

        done, _ = self.on_near(put, f"set {key}")  # not done: the job's store has it, and peers look there
        if done:
            self._member_ns = ns
        if not done or hb.finished:
            self._call("set", key, text)
        if self.agent is not None:  # right after this rank's own heartbeat: the digest holds it fresh
            self.agent.beat()

    def read_heartbeats(self, ranks: Sequence[int]) -> dict[int, Heartbeat]:
        """The watched peers' heartbeats: from the node's store, and from the job's store
        (:meth:`_from_job`) for those it does not hold or holds frozen (the newer one wins)."""
        keys = [self.keys.heartbeat(r) for r in ranks]
        done, found = self.on_near(lambda client: read_present(client, keys), f"read {len(keys)} heartbeats")
        if not done or found is None:
            return self._from_job(ranks)
        now = time.monotonic()
        near = self.parse_heartbeats(ranks, keys, [(i, found[k]) for i, k in enumerate(keys) if k in found])
        frozen = []
        for r, k in zip(ranks, keys, strict=True):
            raw = found.get(k)
            last = self._seen.get(r)
            if raw is not None and (last is None or last[0] != raw):
                self._seen[r] = (bytes(raw), now)
            elif raw is None or now - last[1] >= FROZEN_BEATS * self.heartbeat_s:  # type: ignore[index]
                frozen.append(r)
        if not frozen:
            return near
        for r, hb in self._from_job(frozen).items():
            if r not in near or _newer(hb, near[r]):
                near[r] = hb
        return near

    def has_mark(self, key: str) -> bool:
        """The ``closing`` mark from the node's store (its agent copies it in), others from the job's."""
        if key != self.keys.closing:
            return super().has_mark(key)
        done, raw = self.on_near(lambda client: node_store.get_present(client, key), f"check {key}")
        if not done:
            return super().has_mark(key)
        return raw is not None and bytes(raw) == b"1"

    # ----------------------------------------------------------------- incidents

    def incident_count(self) -> int:
        """The incident counter through the node's store, one rank a node a window reading the job's
        (:class:`~ncclguard.watching.base.near_filing.RelayedCount`); the job's without one."""
        if self.near is None:
            return super().incident_count()
        return self.counter.read()

    def has_incident(self, n: int) -> bool:
        """Whether incident ``n`` is described: in the node's store, where the counter's relay copies
        the descriptions, else in the job's."""
        key = self.keys.incident(n)
        done, raw = self.on_near(lambda client: node_store.get_present(client, key), f"check {key}")
        if done and raw is not None:
            self._docs[n] = raw
            return True
        return super().has_incident(n)

    def read_incident(self, n: int, blob: bytes | None = None) -> IncidentDoc | None:
        """Incident ``n``'s description: the node's copy that :meth:`has_incident` found, else (or
        when that copy does not read) the job's."""
        copy = blob if blob is not None else self._docs.pop(n, None)
        doc = super().read_incident(n, copy) if copy is not None else None
        return doc if doc is not None else super().read_incident(n)

    def read_raw(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The values of those of ``keys`` the job's store holds (bounded reads)."""
        return {keys[i]: value for i, value in self._read_present(keys)}

    def file_statement(self, n: int, statement: Statement) -> bool | None:
        """Files this rank's statement on incident ``n`` through its node's store, one carrier a node
        taking them to the job's store (:class:`~ncclguard.watching.base.near_filing.NodeFiling`);
        in the job's store by itself without a node's store."""
        self._look()
        if self.near is None:
            return super().file_statement(n, statement)
        return self.filing.file(n, statement)

    def file_later(self, n: int) -> bool | None:
        """Goes on with a statement waiting in the node's store (:meth:`NodeFiling.later`)."""
        return self.filing.later(n)


def _newer(a: Heartbeat, b: Heartbeat) -> bool:
    """True when ``a`` was published after ``b`` (of one rank in one world): a later beat, or its last."""
    return a.beat > b.beat or (a.finished and not b.finished)


def read_digests(job: WatchdogStore, keys: Keys, nodes: Sequence[int]) -> dict[int, Digest]:
    """The digests of ``nodes`` in ``keys``' world that exist and parse, by node (a bad one is
    logged once a key and skipped, as a bad heartbeat is).

    Args:
        job: the watchdog's store of the job.
        keys: the world's keys.
        nodes: the nodes.

    Raises:
        StoreTimeout, StoreUnreachable: the job's store did not answer.
    """
    wanted = [keys.digest(n) for n in nodes]
    if not wanted:
        return {}
    found = job.calls.run(lambda: read_present(job.store, wanted), what=f"read {len(wanted)} digests")
    out = {}
    for node, key in zip(nodes, wanted, strict=True):
        if key not in found:
            continue
        try:
            digest = decode(Digest, bytes(found[key]), key, DIGEST_LIMIT)
        except ValueError as exc:
            job.warn_once(key, str(exc))
            continue
        if digest.node != node or digest.generation != keys.generation:
            job.warn_once(key, f"{key} holds node {digest.node}'s digest of generation {digest.generation}")
            continue
        out[node] = digest
    return out
