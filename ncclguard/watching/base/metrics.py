"""The watchdog's Prometheus metrics (the ``metrics`` extra: ``pip install 'ncclguard[metrics]'``).

Off by default. ``WatchdogConfig.metrics_port`` serves them over HTTP (each rank on
``metrics_port + LOCAL_RANK``, bound to ``metrics_addr``), ``metrics_textfile`` writes them for
node-exporter's textfile collector (atomically; ``{rank}`` in the path becomes the rank). The
watchdog thread updates them once per heartbeat (:meth:`WatchdogMetrics.update`); nothing is
done on a collective's path. Every metric is in a registry of its own (never the process's
default one) and carries the label ``rank``.

=============================================  =======  ============================================
name                                           type     what
=============================================  =======  ============================================
``ncclguard_incidents_total{kind}``            counter  incidents this rank handled, by kind
``ncclguard_peer_heartbeat_age_seconds{peer}`` gauge    age of each watched peer's last new beat
``ncclguard_peer_stale{peer}``                 gauge    1 when that peer counts as lost
``ncclguard_straggler_score{peer}``            gauge    the score a watched peer published (1: fastest)
``ncclguard_collective_wait_seconds_total``    counter  time this rank's recorded collectives took
``ncclguard_collectives_total``                counter  collectives this rank completed (recorded)
``ncclguard_inflight_ops``                     gauge    ops in flight now
``ncclguard_oldest_inflight_seconds``          gauge    age of the oldest op in flight (0: none)
``ncclguard_world_generation``                 gauge    the world's generation (0 until a rebuild)
``ncclguard_rebuilds_total``                   counter  new world generations this watchdog followed
``ncclguard_commits_total{result}``            counter  commits counted by :func:`count_commit`
``ncclguard_heartbeat_timestamp_seconds``      gauge    wall time of this rank's last beat
=============================================  =======  ============================================
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ncclguard._log import log
from ncclguard.incidents.model import Heartbeat, PeerView
from ncclguard.recording.flight import FlightRecord

__all__ = ["NAMES", "WatchdogMetrics", "count_commit", "local_port", "textfile_path"]

NAMES = (
    "ncclguard_incidents_total",
    "ncclguard_peer_heartbeat_age_seconds",
    "ncclguard_peer_stale",
    "ncclguard_straggler_score",
    "ncclguard_collective_wait_seconds_total",
    "ncclguard_collectives_total",
    "ncclguard_inflight_ops",
    "ncclguard_oldest_inflight_seconds",
    "ncclguard_world_generation",
    "ncclguard_rebuilds_total",
    "ncclguard_commits_total",
    "ncclguard_heartbeat_timestamp_seconds",
)


class _Current:
    """The metrics of the watchdog running in this process (one per process, as the watchdog)."""

    def __init__(self) -> None:
        self.metrics: WatchdogMetrics | None = None


_current = _Current()


def count_commit(ok: bool) -> None:
    """Counts one commit (a step every rank agreed on) in the running watchdog's metrics; nothing
    when metrics are off.

    Args:
        ok: True when the commit succeeded.
    """
    m = _current.metrics
    if m is not None:
        m.commits.labels(rank=m.rank, result="ok" if ok else "failed").inc()


def textfile_path(template: Path, rank: int) -> Path:
    """``template`` with ``{rank}`` replaced by ``rank`` (several ranks on one node need their own file).

    Args:
        template: ``WatchdogConfig.metrics_textfile``.
        rank: this rank.

    Returns:
        The path to write.
    """
    return Path(str(template).replace("{rank}", str(rank)))


class WatchdogMetrics:
    """The metrics of one watchdog, in a registry of their own.

    Args:
        rank: this rank (the label ``rank``).
        textfile: where to write them for the textfile collector (None: not written).

    Raises:
        ImportError: prometheus_client is not installed (the ``metrics`` extra).
    """

    def __init__(self, rank: int, textfile: Path | None = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge
        except ImportError as exc:
            raise ImportError(
                "the watchdog's metrics need prometheus_client: pip install 'ncclguard[metrics]'"
            ) from exc
        self.rank, self.textfile = str(rank), textfile
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.incidents = Counter(
            "ncclguard_incidents", "Incidents this rank handled, by kind", ["rank", "kind"], registry=reg
        )
        self.peer_age = Gauge(
            "ncclguard_peer_heartbeat_age_seconds",
            "Age of a watched peer's last new heartbeat",
            ["rank", "peer"],
            registry=reg,
        )
        self.peer_stale = Gauge(
            "ncclguard_peer_stale", "1 when a watched peer counts as lost", ["rank", "peer"], registry=reg
        )
        self.score = Gauge(
            "ncclguard_straggler_score",
            "Straggler score a watched peer published (1: fastest)",
            ["rank", "peer"],
            registry=reg,
        )
        self.wait = Counter(
            "ncclguard_collective_wait_seconds", "Time recorded collectives took", ["rank"], registry=reg
        )
        self.done = Counter("ncclguard_collectives", "Recorded collectives completed", ["rank"], registry=reg)
        self.inflight = Gauge("ncclguard_inflight_ops", "Ops in flight", ["rank"], registry=reg)
        self.oldest = Gauge(
            "ncclguard_oldest_inflight_seconds", "Age of the oldest op in flight", ["rank"], registry=reg
        )
        self.generation = Gauge("ncclguard_world_generation", "The world's generation", ["rank"], registry=reg)
        self.rebuilds = Counter("ncclguard_rebuilds", "World generations followed", ["rank"], registry=reg)
        self.commits = Counter("ncclguard_commits", "Commits counted", ["rank", "result"], registry=reg)
        self.beat = Gauge("ncclguard_heartbeat_timestamp_seconds", "Wall time of the last beat", ["rank"], registry=reg)
        self._seen: set[str] = set()  # incident ids counted
        self._cut = 0.0  # the newest record end counted into wait
        self._generation: int | None = None
        self._server: Any = None

    def serve(self, addr: str, port: int, owner: threading.Thread) -> None:
        """Serves the metrics over HTTP at ``addr:port`` from a thread of their own, until ``owner``
        (the watchdog's thread) ends.

        Raises:
            OSError: the port cannot be bound.
        """
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """The library never prints: requests are not logged."""

        server = make_server(addr, port, make_wsgi_app(self.registry), handler_class=Quiet)
        server.timeout = 0.2
        self._server = server

        def run() -> None:
            try:
                while owner.is_alive():
                    server.handle_request()
            finally:
                server.server_close()
                self.deactivate()

        threading.Thread(target=run, name="ncclguard-metrics", daemon=True).start()
        log.info("watchdog: metrics served at http://%s:%d/metrics", addr, server.server_port)

    @property
    def port(self) -> int | None:
        """The port served on (None when not serving)."""
        return None if self._server is None else int(self._server.server_port)

    def update(
        self,
        rank: int,
        generation: int,
        incidents: Iterable[Mapping[str, Any]],
        peers: Mapping[str, PeerView],
        beats: Mapping[int, Heartbeat],
        records: Iterable[FlightRecord],
    ) -> None:
        """Takes this beat's values (on the watchdog's thread); writes the textfile when configured.

        Args:
            rank: this rank now (a rebuild renumbers).
            generation: the world's generation now.
            incidents: ``Watchdog.incidents``.
            peers: how this rank sees its watched peers.
            beats: the watched peers' last heartbeats.
            records: this rank's flight records, oldest first.
        """
        if str(rank) != self.rank or generation != self._generation:
            if self._generation is not None and generation > self._generation:
                self.rebuilds.labels(rank=str(rank)).inc()
            for g in (self.peer_age, self.peer_stale, self.score):
                g.clear()  # the peers of the world before
            self.rank, self._generation = str(rank), generation
        r, now = self.rank, time.time()
        self.rebuilds.labels(rank=r)  # shown at 0 before the first rebuild
        self.generation.labels(rank=r).set(generation)
        self.beat.labels(rank=r).set(now)
        for inc in incidents:
            if inc["id"] not in self._seen:
                self._seen.add(inc["id"])
                self.incidents.labels(rank=r, kind=inc["kind"]).inc()
        for peer, view in peers.items():
            self.peer_age.labels(rank=r, peer=peer).set(view.age_s)
            self.peer_stale.labels(rank=r, peer=peer).set(1 if view.stale else 0)
        for peer_rank, hb in beats.items():
            if hb.straggler_score is not None:
                self.score.labels(rank=r, peer=str(peer_rank)).set(hb.straggler_score)
        self._records(r, records, now)
        if self.textfile is not None:
            self.write_textfile()

    def _records(self, r: str, records: Iterable[FlightRecord], now: float) -> None:
        waited, done, cut, open_starts = 0.0, 0, self._cut, []
        for rec in records:
            end = rec.end
            if end is None:
                open_starts.append(rec.start)
            elif end > self._cut:
                waited += max(0.0, end - rec.start)
                done += 1
                cut = max(cut, end)
        self._cut = cut
        self.wait.labels(rank=r).inc(waited)
        self.done.labels(rank=r).inc(done)
        self.inflight.labels(rank=r).set(len(open_starts))
        self.oldest.labels(rank=r).set(max(0.0, now - min(open_starts)) if open_starts else 0.0)

    def write_textfile(self) -> None:
        """Writes the metrics to the textfile (atomically: a temporary file renamed into place)."""
        from prometheus_client import write_to_textfile

        assert self.textfile is not None
        path = textfile_path(self.textfile, int(self.rank))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(path), self.registry)
        except OSError as exc:
            log.warning("watchdog: could not write the metrics to %s: %s", path, exc)

    def activate(self) -> None:
        """Makes these the process's metrics (:func:`count_commit` counts into them)."""
        _current.metrics = self

    def deactivate(self) -> None:
        """Unless another watchdog's metrics took over, :func:`count_commit` counts nowhere again."""
        if _current.metrics is self:
            _current.metrics = None


def local_port(port: int) -> int:
    """``port + LOCAL_RANK`` (ranks of one node serve on consecutive ports)."""
    return port + int(os.environ.get("LOCAL_RANK", "0") or 0)
