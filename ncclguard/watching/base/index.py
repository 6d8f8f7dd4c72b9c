"""The status index: where a job's watchdog keeps its keys, named under a fixed key.

Rank 0's watchdog writes a :class:`WatchIndex` under :func:`~ncclguard.store.keys.index_key` on the
first beat of each world, so that ``python -m ncclguard status`` (:mod:`ncclguard.cli.status_read`)
finds the heartbeats knowing only the store's address.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.store.keys import Keys, index_key
from ncclguard.watching.base.watchdog_store import WatchdogStore

__all__ = ["INDEX_LIMIT", "WatchIndex", "publish_index"]

INDEX_LIMIT = 4096  # bytes of JSON


class WatchIndex(BaseModel):
    """Where a job's watchdog keeps its keys, as rank 0 wrote it (the value of ``index_key``)."""

    model_config = ConfigDict(extra="ignore")

    run_id: str = Field(min_length=1, max_length=256)
    restart: str = Field(min_length=1, max_length=64)
    session: str = Field(min_length=1, max_length=128)
    generation: int = Field(ge=0)
    world_size: int = Field(ge=1, le=1 << 20)
    heartbeat_s: float = Field(gt=0)
    peer_timeout_s: float = Field(gt=0)
    hang_timeout_s: float = Field(gt=0)
    written: float
    host: str = Field("", max_length=256)
    pid: int = 0
    nodes: int = Field(0, ge=0, le=1 << 20)  # with the node tier: the job's nodes, whose digests hold the heartbeats

    @property
    def keys(self) -> Keys:
        """The key schema of this namespace."""
        return Keys(self.session, self.run_id, self.restart, self.generation)


def publish_index(
    store: WatchdogStore,
    heartbeat_s: float,
    peer_timeout_s: float,
    hang_timeout_s: float,
    world_size: int,
    nodes: int = 0,
) -> None:
    """Names ``store``'s namespace under the session's index key (rank 0, first beat of a world).

    Args:
        store: rank 0's watchdog store (its keys say run id, restart, session and generation).
        heartbeat_s, peer_timeout_s, hang_timeout_s: the watchdog's settings, for the reader's health call.
        world_size: the ranks of this world.
        nodes: with the node tier on, the job's nodes (their digests hold the heartbeats); else 0.
    """
    keys = store.keys
    index = WatchIndex(
        run_id=keys.run_id,
        restart=keys.restart,
        session=keys.session,
        generation=keys.generation,
        world_size=world_size,
        heartbeat_s=heartbeat_s,
        peer_timeout_s=peer_timeout_s,
        hang_timeout_s=hang_timeout_s,
        written=time.time(),
        host=HOSTNAME,
        nodes=nodes,
    )
    try:
        store.put_index(index_key(keys.session), index)
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not name this job's namespace for `ncclguard status` (%s)", exc)
