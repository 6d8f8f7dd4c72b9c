"""The watchdog's settings (:class:`WatchdogConfig`), each also read from ``NCCLGUARD_WATCHDOG_<FIELD>``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ACTIONS", "EXIT_CODE", "LADDERS", "WatchdogConfig"]

ACTIONS = ("report", "raise", "abort", "fence", "exit")
# The built-in ladder of each top rung. ``fence`` is the top of a job that recovers in process
# (RecoveringStep with allow_shrink): it has no ``raise`` (an exception thrown into the main thread
# could land in a commit or a rebuild, and break the loop that recovers) and no ``exit`` (a job
# that exits 75 is restarted by its launcher instead).
LADDERS: dict[str, tuple[str, ...]] = {
    "report": ("report",),
    "raise": ("report", "raise"),
    "abort": ("report", "raise", "abort"),
    "fence": ("report", "abort", "fence"),
    "exit": ("report", "raise", "abort", "exit"),
}
EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, try again"; launchers restart on it


class WatchdogConfig(BaseSettings):
    """Settings of the :class:`Watchdog`; each can be set as ``NCCLGUARD_WATCHDOG_<FIELD>``.

    Invariants: ``hang_timeout_s > heartbeat_s``; ``peer_timeout_s >= 2 * heartbeat_s`` (a beat may
    come almost one period late); every duration positive.

    Attributes:
        heartbeat_s: how often this rank publishes its state.
        hang_timeout_s: an op in flight this long is a hang (unset, with the ``report`` ladder:
            learned per phase from the job, never above this default; set, or a ladder that acts:
            always this value). Keep it below the process group's
            timeout (NCCL default 600 s) so the watchdog reports before the backend kills the job
            (:mod:`ncclguard.watching.base.hang_bound`).
        peer_timeout_s: a peer whose heartbeat has not changed this long is lost (default 6 beats).
        action: the top rung of the ladder: report, raise, abort, fence or exit (the rungs of each:
            :data:`LADDERS`; a ladder of your own: ``Watchdog(actions=[...])``, see
            :mod:`ncclguard.watching.ladder.actions`).
        escalate_after_s: the time each rung gets to clear the hang before the next one.
        exit_code: the status of the ``exit`` rung.
        fence_after_s: the ``fence`` rung's wait after the rung before it (default
            ``escalate_after_s``): how long a rank stays named the culprit, its op still open,
            before it fences itself (exits 0). At least ``merge_wait``: it acts on the merged report.
        incident_dir: where incidents are written (``<incident_dir>/<id>/``).
        merge_wait_s: how long the merging rank waits for the others' statements (default 2 beats).
        store_timeout_s: the bound of every store call (default: ``min(heartbeat_s, 5)``).
        watch_peers: each rank watches this many next ranks (ring order); every rank is watched
            by as many. Bounds the store traffic of large jobs.
        startup_grace_s: a peer never heard from is lost after this long; the first connect to the
            store is tried this long (in the background once it missed ``store_timeout_s``).
        raise_signal: the signal that carries the ``raise`` rung into the main thread.
        session: a name for this watchdog's keys in the store; give a new one to a second
            watchdog started in the same job.
        store_addr: ``host:port`` of the store (default ``MASTER_ADDR:MASTER_PORT``).
        node_tier: heartbeats through a store per node (served by ``ncclguard run``'s launcher, else by ``LOCAL_RANK`` 0), one digest a
            node in the job's store: ``"auto"`` (on from ``node_tier_min_ranks`` ranks, with more
            than one node and rank a node), ``"on"``, ``"off"`` (docs/scale.md).
        node_tier_min_ranks: the world size from which ``"auto"`` turns the node tier on.
        instrument: also call :func:`ncclguard.recording.instrument` so plain ``torch.distributed`` calls
            are recorded.
    """

    model_config = SettingsConfigDict(env_prefix="NCCLGUARD_WATCHDOG_", frozen=True, extra="forbid")

    heartbeat_s: float = Field(5.0, gt=0)
    hang_timeout_s: float = Field(300.0, gt=0)
    peer_timeout_s: float | None = Field(None, gt=0)
    action: Literal["report", "raise", "abort", "fence", "exit"] = "report"
    escalate_after_s: float = Field(30.0, gt=0)
    exit_code: int = Field(EXIT_CODE, ge=1, le=255)
    fence_after_s: float | None = Field(None, gt=0)
    incident_dir: Path = Path("ncclguard-incidents")
    merge_wait_s: float | None = Field(None, gt=0)
    store_timeout_s: float | None = Field(None, gt=0)
    watch_peers: int = Field(16, ge=1)
    startup_grace_s: float = Field(60.0, gt=0)
    raise_signal: str = "SIGUSR2"
    session: str = Field("main", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    store_addr: str | None = None
    instrument: bool = True
    # The node tier (docs/scale.md): heartbeats through a store per node, one digest a node in the job's store.
    node_tier: Literal["auto", "on", "off"] = "auto"
    node_tier_min_ranks: int = Field(512, ge=2)
    # Metrics (the ``metrics`` extra; off by default; see ncclguard/watching/base/metrics.py and docs/status.md).
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="serve Prometheus metrics over HTTP on this port + LOCAL_RANK"
    )
    metrics_addr: str = Field("0.0.0.0", min_length=1, description="the address the metrics server binds")
    metrics_textfile: Path | None = Field(
        None, description="write the metrics here for node-exporter's textfile collector ({rank}: the rank)"
    )
    incident_plot: bool = Field(True, description="draw timeline.png into each merged incident (with matplotlib)")

    @field_validator("raise_signal")
    @classmethod
    def _known_signal(cls, name: str) -> str:
        if name in ("SIGKILL", "SIGSTOP", "SIGALRM") or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ValueError(
                f"raise_signal must name a catchable signal other than SIGALRM (used by sigalrm_timeout), "
                f"e.g. 'SIGUSR2'; got {name!r}"
            )
        return name

    @field_validator("store_addr")
    @classmethod
    def _host_port(cls, addr: str | None) -> str | None:
        if addr is not None:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"store_addr must be 'host:port', got {addr!r}")
        return addr

    @model_validator(mode="after")
    def _in_order(self) -> WatchdogConfig:
        if self.hang_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"hang_timeout_s ({self.hang_timeout_s}) must be > heartbeat_s ({self.heartbeat_s}): "
                "a hang can only be told apart from a slow op over several beats"
            )
        if self.peer_timeout < 2 * self.heartbeat_s:
            raise ValueError(
                f"peer_timeout_s ({self.peer_timeout}) must be >= 2 * heartbeat_s ({self.heartbeat_s}): "
                "a beat may come almost one period late, and a peer is lost only when beats stop"
            )
        if self.action == "fence" and self.fence_after < self.merge_wait:
            raise ValueError(
                f"fence_after_s ({self.fence_after}) must be >= merge_wait ({self.merge_wait}): the fence acts on "
                "the merged report, which takes up to merge_wait to come"
            )
        return self

    # Straggler detection (docs/stragglers.md; ncclguard/watching/sensors/straggler.py): on by default.
    straggler: bool = True  # measure windows and raise ``straggler`` incidents
    straggler_window_s: float = Field(10.0, gt=0, le=3600)  # published in a heartbeat: at least heartbeat_s
    straggler_threshold: float = Field(1.15, gt=1.0, le=100.0)  # the slowdown factor that counts
    straggler_windows: int = Field(2, ge=1, le=100)  # slow windows in a row that raise the incident
    straggler_link_threshold: float = Field(2.0, gt=1.0, le=100.0)  # the transfer's slowdown that counts
    straggler_min_share: float = Field(0.05, ge=0.0, lt=1.0)  # the least share of a window the slowdown costs

    @model_validator(mode="after")
    def _straggler_window(self) -> WatchdogConfig:
        if "straggler_window_s" in self.model_fields_set and self.straggler_window_s < self.heartbeat_s:
            raise ValueError(
                f"straggler_window_s ({self.straggler_window_s}) must be >= heartbeat_s ({self.heartbeat_s}): "
                "each window is published in a heartbeat"
            )
        return self

    @property
    def straggler_window(self) -> float:
        """``straggler_window_s``, at least one heartbeat (each window is published in a heartbeat)."""
        return max(self.straggler_window_s, self.heartbeat_s)

    @property
    def peer_timeout(self) -> float:
        """``peer_timeout_s``, or 6 heartbeats when unset."""
        return self.peer_timeout_s if self.peer_timeout_s is not None else 6 * self.heartbeat_s

    @property
    def merge_wait(self) -> float:
        """``merge_wait_s``, or 2 heartbeats when unset."""
        return self.merge_wait_s if self.merge_wait_s is not None else 2 * self.heartbeat_s

    @property
    def fence_after(self) -> float:
        """``fence_after_s``, or ``escalate_after_s`` when unset."""
        return self.fence_after_s if self.fence_after_s is not None else self.escalate_after_s

    @property
    def store_timeout(self) -> float:
        """``store_timeout_s``, or ``min(heartbeat_s, 5)`` when unset."""
        return self.store_timeout_s if self.store_timeout_s is not None else min(self.heartbeat_s, 5.0)

    @property
    def ladder(self) -> tuple[str, ...]:
        """The rungs this watchdog climbs: ``report`` up to ``action`` (:data:`LADDERS`)."""
        return LADDERS[self.action]
