"""What the watchdog shows outside the job, once per beat, from its own thread.

- the status index: rank 0 names its namespace under :func:`~ncclguard.store.keys.index_key` on
  the first beat of each world (:func:`~ncclguard.watching.base.index.publish_index`), so that
  ``python -m ncclguard status`` finds the heartbeats knowing only the store's address;
- the metrics (:mod:`ncclguard.watching.base.metrics`), when ``metrics_port`` or ``metrics_textfile``
  is set.

Nothing here may stop the watchdog: a failure is logged and the beat goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from ncclguard._log import log
from ncclguard.recording.flight import recorder
from ncclguard.watching.base.index import publish_index
from ncclguard.watching.base.metrics import WatchdogMetrics, local_port
from ncclguard.watching.base.near_store import TieredWatchdogStore
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.desk.desk import IncidentDesk

__all__ = ["Views"]


class _Watched(Protocol):
    @property
    def incidents(self) -> list[dict[str, Any]]: ...


class Views:
    """The status index and the metrics of one run of the watchdog's thread.

    Args:
        config: the watchdog's settings.
    """

    def __init__(self, config: WatchdogConfig) -> None:
        self.config = config
        self.metrics: WatchdogMetrics | None = None
        self._indexed: tuple[int, int] | None = None  # (generation, world size) named in the store
        self._metrics_off = config.metrics_port is None and config.metrics_textfile is None

    def beat(self, watchdog: _Watched, desk: IncidentDesk) -> None:
        """Names the namespace (rank 0, once per world) and updates the metrics.

        Args:
            watchdog: the watchdog (its ``incidents``).
            desk: the current world's incident desk (its store, rank, liveness).
        """
        try:
            self._index(desk)
            if not self._metrics_off:
                self._update(watchdog, desk)
        except Exception:  # noqa: BLE001 - a view must never stop the watchdog
            log.exception("watchdog: the status index or the metrics failed this beat; going on")

    def _index(self, desk: IncidentDesk) -> None:
        world = (int(desk.world.get("generation", 0)), desk.world_size)
        if desk.rank != 0 or desk.store is None or self._indexed == world:
            return
        cfg = self.config
        store = desk.store
        nodes = store.layout.nodes if isinstance(store, TieredWatchdogStore) else 0  # status reads the digests
        publish_index(store, cfg.heartbeat_s, cfg.peer_timeout, cfg.hang_timeout_s, desk.world_size, nodes)
        self._indexed = world

    def _start_metrics(self, rank: int) -> WatchdogMetrics | None:
        cfg = self.config
        try:
            metrics = WatchdogMetrics(rank, cfg.metrics_textfile)
        except ImportError as exc:
            log.error("watchdog: metrics are off: %s", exc)
            self._metrics_off = True
            return None
        if cfg.metrics_port is not None:
            port = local_port(cfg.metrics_port)
            try:
                metrics.serve(cfg.metrics_addr, port, threading.current_thread())
            except OSError as exc:
                log.error("watchdog: cannot serve metrics on %s:%d (%s)", cfg.metrics_addr, port, exc)
        metrics.activate()
        return metrics

    def _update(self, watchdog: _Watched, desk: IncidentDesk) -> None:
        if self.metrics is None:
            self.metrics = self._start_metrics(desk.rank)
            if self.metrics is None:
                return
        peers: Mapping[str, Any] = desk.liveness.views(time.monotonic())
        self.metrics.update(
            desk.rank,
            int(desk.world.get("generation", 0)),
            watchdog.incidents,
            peers,
            desk.liveness.heartbeats(),
            recorder.records(),
        )
