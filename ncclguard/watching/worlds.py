"""The watchdog and the worlds it watches: this rank's place in a world, the desk's store connection,
and a new world (after a rebuild) followed by the watchdog's own thread."""

from __future__ import annotations

import os
import threading
from typing import Any

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.store.clients import Connecting
from ncclguard.watching.base.near_store import TieredWatchdogStore
from ncclguard.watching.base.node_agent import start_agent
from ncclguard.watching.base.node_layout import NodeLayout, tier_wanted
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import Keys, WatchdogStore, store_addr
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.world import World, WorldChange

__all__ = ["Announced", "attach", "connect", "rank_and_size", "take_over"]


class Announced:
    """The newest world announced and not yet followed: the subscriber (the announcing thread) puts
    it, the watchdog's thread takes it at its next tick (it alone touches the per-world members)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: World | None = None

    def put(self, change: WorldChange) -> None:
        with self._lock:
            self._world = change.new

    def take(self) -> World | None:
        if self._world is None:  # the common case, every tick: no lock
            return None
        with self._lock:
            world, self._world = self._world, None
        return world


# given: Any, as Watchdog's store (a c10d Store, or a proxy or test double with its methods).
def connect(desk: IncidentDesk, cfg: WatchdogConfig, world_size: int, given: Any = None) -> None:
    """Starts ``desk``'s connection to its store: ``given``, else a new client of the job's store; none
    in a world of one. :func:`attach` gives the desk the store once it answers.

    The first try waits a store call's bound (``store_timeout``); if it misses, the tries go on in
    the background for ``startup_grace_s`` (a connect on a loaded host now and then takes seconds),
    and incidents are handled on this rank alone meanwhile."""
    if given is not None:
        desk.connecting = Connecting.made(given)
        return
    addr = store_addr(cfg.store_addr)
    if addr is None or world_size <= 1:
        log.info("watchdog: no store (world of %d); incidents are handled on this rank only", world_size)
        return
    host, _, port = addr.rpartition(":")
    desk.store_addr, desk.connecting = addr, Connecting(host, int(port), cfg.startup_grace_s, cfg.store_timeout)
    if desk.connecting.wait(cfg.store_timeout) is None:
        log.warning(
            "watchdog: no answer from the store at %s within %.3g s (%s); trying on for %.3g s, incidents are "
            "handled on this rank alone meanwhile",
            addr,
            cfg.store_timeout,
            desk.connecting.why or "still connecting",
            cfg.startup_grace_s,
        )


def attach(desk: IncidentDesk, cfg: WatchdogConfig, world_size: int = 1) -> WatchdogStore | None:
    """Gives ``desk`` the store its :func:`connect` made, once made: with the node tier on
    (:func:`~ncclguard.watching.base.node_layout.tier_wanted` for ``world_size``), one whose
    heartbeats go through the node's store (:mod:`~ncclguard.watching.base.near_store`).

    Returns:
        The store, the once it is given (the watchdog then reads what the store kept for this
        rank); None at every other call.
    """
    link = desk.connecting
    if link is None:
        return None
    client = link.client()
    if client is None:
        if not link.trying:
            desk.connecting = None
            log.error(
                "watchdog: could not connect to the store at %s in %.3g s (%s); incidents are handled on this rank only",
                desk.store_addr,
                cfg.startup_grace_s,
                link.why or "no answer",
            )
        return None
    desk.connecting = None
    keys = Keys.from_env(cfg.session, generation=desk.world["generation"])
    layout = NodeLayout.from_env()
    store: WatchdogStore
    if layout is not None and tier_wanted(cfg.node_tier, world_size, cfg.node_tier_min_ranks, layout):
        # A node's statements carried well inside the merger's wait (near_filing.py).
        carry_wait = min(cfg.heartbeat_s / 2, cfg.merge_wait / 4)
        store = TieredWatchdogStore(
            client, keys, cfg.store_timeout, cfg.peer_timeout, layout, cfg.heartbeat_s, carry_wait_s=carry_wait
        )
        store.agent = start_agent(store, cfg.watch_peers)  # on the node's LOCAL_RANK 0 (node_agent.py)
        log.info(
            "watchdog: node tier on: node %d of %d, local rank %d of %d",
            layout.node,
            layout.nodes,
            layout.local_rank,
            layout.local_size,
        )
    else:
        store = WatchdogStore(client, keys, cfg.store_timeout, cfg.peer_timeout)
    try:
        desk.seen_count = store.job_incident_count()  # incidents from before this watchdog are not its own
    except (StoreTimeout, StoreUnreachable):
        desk.seen_count = 0
    desk.store = store
    return store


def rank_and_size(world: World) -> tuple[int, int]:
    """This rank and the size of ``world``: its own once rebuilt, else torch's, else torchrun's."""
    import torch.distributed as dist

    if world.rank is not None and world.size is not None:
        return world.rank, world.size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def take_over(desk: IncidentDesk, old: IncidentDesk | None, world: World, session: str) -> None:
    """Makes ``desk`` the desk of ``world``: its incidents say the generation and the renumbering,
    and it takes ``old``'s store connection (if any) over, keyed for this generation."""
    desk.world = {
        "generation": world.generation,
        "rank_map": {str(k): v for k, v in world.rank_map.items()} if world.generation else None,
        "left_out": list(world.left_out) if world.generation else None,
    }
    if old is None:
        return
    desk.store, desk.store_addr, desk.store_lost = old.store, old.store_addr, old.store_lost
    desk.store_closing, desk.connecting = old.store_closing, old.connecting
    desk.lost_store = old.lost_store  # asked again in the new world
    if desk.lost_store is not None:
        desk.lost_store.store.keys = Keys.from_env(session, generation=world.generation)
    if desk.store is not None:
        desk.store.keys = Keys.from_env(session, generation=world.generation)
        try:
            desk.seen_count = desk.store.job_incident_count()
        except (StoreTimeout, StoreUnreachable):
            desk.seen_count = 0  # a fresh generation's counter starts at 0 anyway
