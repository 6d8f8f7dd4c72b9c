"""A node's agent in the node tier (docs/scale.md): the node's store, and one digest a beat.

Where the node's store comes from:

- under ``ncclguard run``, its launcher serves it (one process a node, which outlives any rank) and
  names it in ``NCCLGUARD_NODE_STORE``; the agent then runs in whichever rank's watchdog holds the
  lease in that store (:class:`LeasedAgent`): a rank that dies or stops lets its lease lapse after
  :data:`LEASE_BEATS` heartbeats, and another rank of the node takes the agent over;
- without a launcher, the watchdog of the node's ``LOCAL_RANK`` 0 process serves it (a ``TCPStore``
  on a free port (:mod:`ncclguard.store.node_store`)) and runs the agent; the store dies with it.

Either way the store is named in the job's store under :meth:`~ncclguard.store.keys.Keys.node_addr`,
and the node's ranks publish their heartbeats there
(:class:`~ncclguard.watching.base.near_store.TieredWatchdogStore`). At each of its beats the agent

1. reads which rank each of the node's processes is in the world, and their heartbeats (node's store);
2. puts them as one :class:`~ncclguard.watching.base.node_layout.Digest` into the job's store;
3. reads the digests of the nodes its ranks watch (:func:`~ncclguard.watching.base.node_layout.watched_nodes`)
   and copies their heartbeats into the node's store, where its ranks read them;
4. copies the job's ``closing`` mark in.

That is 4 requests a beat to the job's store for the whole node (a check more while a peer's
digest is missing), where each rank made 4 of its own. A failed call to the job's store is logged
once a spell and tried again at the next beat: the ranks' own calls to the job's store (incidents,
the incident counter) tell a store that is gone.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.model import Heartbeat
from ncclguard.store import node_store
from ncclguard.store.bounded_calls import BoundedCalls
from ncclguard.store.clients import connect
from ncclguard.store.codec import encode
from ncclguard.store.keys import Keys
from ncclguard.store.rounds import read_present
from ncclguard.watching.base.near_store import TieredWatchdogStore, read_digests
from ncclguard.watching.base.node_layout import DIGEST_LIMIT, Digest, NodeLayout, watched_nodes
from ncclguard.watching.base.watchdog_store import WatchdogStore, parse_value

__all__ = ["LEASE_BEATS", "LeasedAgent", "NodeAgent", "start_agent"]

# A lease not renewed for this many heartbeats lapses: the node's agent stopped or died, and the
# next rank of the node to beat takes it over. Over the FROZEN_BEATS (3) after which a watcher
# reads a copy that stands still in the job's store, so the agent changes hands before the watchers
# need it, and far under the peers' timeout.
LEASE_BEATS = 3


class NodeAgent:
    """One node's agent (see the module doc); driven by its watchdog's thread, one :meth:`beat` a
    heartbeat.

    Args:
        layout: the node and its place among the nodes.
        watch_peers: the ranks each rank watches (which nodes' digests are copied in).
        job: the watchdog's store of the job (its keys follow the world).
        near: the node's store (a c10d Store: :func:`ncclguard.store.node_store.serve`'s, or a test's ``HashStore``).
        host: the address the node's ranks reach ``near`` at (``127.0.0.1``).
        first_beat: the number its beats count from (a leased agent's successor counts on from the
            clock, so that its node's digest's number never goes back).
    """

    def __init__(
        self,
        layout: NodeLayout,
        watch_peers: int,
        job: WatchdogStore,
        near: Any,
        host: str = "127.0.0.1",
        first_beat: int = 0,
    ) -> None:
        self.layout, self.job = layout, job
        self.watched = watched_nodes(layout.node, layout.nodes, watch_peers, layout.local_size)
        self.near = BoundedCalls(near, job.calls.timeout, job.calls.gone_after)
        port = getattr(near, "port", None)
        self.addr = f"{host}:{port}" if isinstance(port, int) else ""
        self.beats = first_beat
        self._named = False  # the node's store's address is in the job's store
        self._copied: dict[int, int] = {}  # watched node -> the digest beat last copied in
        self._failing = False  # the last beat failed (logged once a spell)

    def close(self) -> None:
        """Ends the helper thread of the node store's calls."""
        self.near.close()

    def beat(self) -> bool:
        """One beat of the agent (see the module doc).

        Returns:
            True when every step of it went through.
        """
        self.beats += 1
        keys = self.job.keys
        try:
            if not self._named and self.addr:
                self.job.put_value(keys.node_addr(self.layout.node), self.addr)
                self._named = True
            self._put_digest(keys, self._gather(keys))
            self._copy_in(keys)
            # The job's own mark (a tiered store reads ``closing`` from the node's store, where this copies it).
            if WatchdogStore.has_mark(self.job, keys.closing):
                self.near.run(lambda: node_store.put(self.near.store, keys.closing, "1"), what=f"set {keys.closing}")
        except (StoreTimeout, StoreUnreachable) as exc:
            if not self._failing:
                log.warning(
                    "watchdog: node tier: node %d's agent missed a beat (%s); trying again next beat",
                    self.layout.node,
                    exc,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("watchdog: node tier: node %d's agent beats again", self.layout.node)
        self._failing = False
        return True

    def _gather(self, keys: Keys) -> dict[int, str]:
        """The node's ranks' heartbeats in the node's store, by rank in the world (as each said)."""
        members = [keys.member(lr) for lr in range(self.layout.local_size)]

        def read() -> dict[int, str]:
            said = read_present(self.near.store, members)
            ranks = sorted(
                {int(v) for v in (bytes(b)[:12].decode(errors="replace") for b in said.values()) if v.isdecimal()}
            )
            beats = read_present(self.near.store, [keys.heartbeat(r) for r in ranks])
            return {
                r: bytes(beats[keys.heartbeat(r)]).decode(errors="replace") for r in ranks if keys.heartbeat(r) in beats
            }

        got: dict[int, str] = self.near.run(read, what="read the node's heartbeats")
        return got

    def _put_digest(self, keys: Keys, beats: dict[int, str]) -> None:
        share = (DIGEST_LIMIT - 4096) // max(1, len(beats))  # each heartbeat's part of the digest's bound
        beats = {r: text if _inside(text) <= share else self._cut(keys, r, text, share) for r, text in beats.items()}
        digest = Digest(node=self.layout.node, beat=self.beats, generation=keys.generation, beats=beats)
        self.job.put_value(keys.digest(self.layout.node), encode(digest))

    def _cut(self, keys: Keys, rank: int, text: str, share: int) -> str:
        """Rank ``rank``'s heartbeat cut to ``share`` bytes: without its sensors' readings and with its
        oldest 4 ops in flight; ``"{}"`` (read as no heartbeat: logged) if it still does not fit."""
        try:
            hb = parse_value(Heartbeat, text, keys.heartbeat(rank))
            text = encode(hb.model_copy(update={"readings": None, "inflight": hb.inflight[:4]}))
        except ValueError:
            pass  # not a heartbeat: its readers would refuse it anyway
        if _inside(text) > share:
            self.job.warn_once(
                keys.heartbeat(rank),
                f"rank {rank}'s heartbeat is {_inside(text)} bytes in the digest, over its share of {share}",
            )
            return "{}"
        return text

    def _copy_in(self, keys: Keys) -> None:
        """Copies the watched nodes' new digests' heartbeats into the node's store."""
        if not self.watched:
            return
        digests = read_digests(self.job, keys, self.watched)
        names: list[str] = []
        values: list[str] = []
        for node, digest in digests.items():
            if self._copied.get(node) == digest.beat:
                continue  # its agent did not beat since: nothing new to copy
            self._copied[node] = digest.beat
            for rank, text in digest.beats.items():
                names.append(keys.heartbeat(rank))
                values.append(text)
        if names:
            self.near.run(
                lambda: node_store.put_all(self.near.store, names, values), what=f"copy {len(names)} heartbeats in"
            )


class LeasedAgent:
    """The node's agent where ``ncclguard run``'s launcher serves the node's store: each beat of this
    rank's watchdog claims or renews the lease (:func:`~ncclguard.store.node_store.claim_agent`), and
    the holder runs a :class:`NodeAgent` on a client of its own.

    Args:
        store: this rank's watchdog store, linked (or to be linked) to the launcher's store.
        watch_peers: the ranks each rank watches.
    """

    def __init__(self, store: TieredWatchdogStore, watch_peers: int) -> None:
        self.store, self.watch_peers = store, watch_peers
        self.me = f"{os.getpid()}/{store.layout.local_rank}"
        self.agent: NodeAgent | None = None

    @property
    def holding(self) -> bool:
        """True while this rank runs the node's agent."""
        return self.agent is not None

    def beat(self) -> bool:
        """Claims or renews the lease, then beats as the node's agent if this rank holds it.

        Returns:
            True when this rank held the lease and its agent's beat went through.
        """
        store = self.store
        span = LEASE_BEATS * store.heartbeat_s
        linked = store.near is not None and store.near_addr == store.launcher
        done, won = (
            store.on_near(lambda c: node_store.claim_agent(c, self.me, time.time(), span), "claim the node's agent")
            if linked
            else (False, None)
        )
        if not (done and won):
            self._drop("its lease is another rank's" if done else "the launcher's store did not answer")
            return False
        if self.agent is None:
            self.agent = self._start()
            if self.agent is None:
                return False
        return self.agent.beat()

    def _start(self) -> NodeAgent | None:
        """The node's agent on a client of its own (a client runs one request at a time, and the
        rank's own calls go through the store's)."""
        store = self.store
        host, _, port = store.launcher.rpartition(":")
        try:
            client = BoundedCalls(store.launcher, store.timeout, 0.0).run(connect, host, int(port), store.timeout)
        except (StoreTimeout, StoreUnreachable) as exc:
            log.info("watchdog: node tier: no client of the launcher's store for the agent (%s)", exc)
            return None
        log.warning(
            "watchdog: node tier: node %d's agent now runs in this rank (local rank %d), in the store its launcher "
            "serves at %s",
            store.layout.node,
            store.layout.local_rank,
            store.launcher,
        )
        return NodeAgent(store.layout, self.watch_peers, store, client, host, first_beat=int(time.time() * 1000))

    def _drop(self, why: str) -> None:
        if self.agent is not None:
            log.info("watchdog: node tier: this rank no longer runs node %d's agent (%s)", self.store.layout.node, why)
            self.agent.close()
            self.agent = None

    def close(self) -> None:
        """Ends the agent's helper thread, if this rank runs it (its lease lapses by itself)."""
        self._drop("closed")


def _inside(text: str) -> int:
    """What ``text`` weighs inside a digest's JSON: its quotes escaped (about 12% more for a heartbeat)."""
    return len(json.dumps(text))


def start_agent(store: WatchdogStore, watch_peers: int) -> NodeAgent | LeasedAgent | None:
    """The node's agent with the tier on: on every rank where the launcher serves the node's store
    (a :class:`LeasedAgent`, which runs the agent while it holds the lease), else on the node's
    ``LOCAL_RANK`` 0 process; None elsewhere, or when no store could be served here (logged: the
    node's ranks then publish to the job's store, as without the tier).

    Args:
        store: the watchdog's store of the job (a tiered one runs the agent).
        watch_peers: the ranks each rank watches.
    """
    if not isinstance(store, TieredWatchdogStore):
        return None
    if store.launcher:
        return LeasedAgent(store, watch_peers)
    if not store.layout.is_agent:
        return None
    try:
        near = node_store.serve(store.calls.timeout)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or DistStoreError; the ranks go direct
        log.warning(
            "watchdog: node tier: could not serve node %d's store here (%s); its ranks use the job's store",
            store.layout.node,
            exc,
        )
        return None
    agent = NodeAgent(store.layout, watch_peers, store, near)
    log.info(
        "watchdog: node tier: node %d's agent serves its store at %s, watching nodes %s",
        store.layout.node,
        agent.addr,
        agent.watched,
    )
    return agent
