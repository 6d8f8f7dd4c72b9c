"""The Watchdog: a background thread per process that notices hangs and says who caused them.

Every ``heartbeat_s`` it publishes this rank's state to the rendezvous store (its own client
connection, so the training thread never waits on the store for it): last sequence number per
group, the ops in flight, the main thread's phase and call site, host, pid, time. It raises an
incident when

- an op of this rank has been in flight longer than ``hang_timeout_s`` (kind ``hang``), or
- a watched peer's heartbeat has not changed for ``peer_timeout_s`` (kind ``lost``), or
- the store itself stops answering (kind ``store``; handled on this rank alone).

An incident is a numbered entry in the store. Every rank's watchdog that sees it dumps the stacks
of all its Python threads, its flight records and the heartbeats to
``<incident_dir>/<id>/rank<r>.json`` and publishes a statement; the first rank done merges the
statements into ``incident.json`` and ``summary.txt`` (culprits apart from victims, see
:mod:`ncclguard.diagnosis.incident`). Then every rank climbs the action ladder up to ``action``, giving
each rung ``escalate_after_s`` to clear the hang:

``report``  log only;
``raise``   raise :class:`~ncclguard.errors.CollectiveTimeout` in the main thread (by a signal,
            ``raise_signal``). Works where the main thread runs Python (a stalled loop, a
            sleep); a main thread blocked in a C++ collective is skipped, since no exception can
            reach it before the backend returns;
``abort``   ``ProcessGroup.abort()`` on every process group: blocked NCCL waits return with an
            error. Gloo's abort does not wake a blocked op (it returns at its own timeout);
``exit``    ``os._exit(exit_code)`` (default 75, EX_TEMPFAIL) after the dump, so torchrun or an
            elastic agent restarts the job.

No store call waits longer than ``store_timeout_s``; nothing waits on a dead peer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.diagnosis.flight import FlightRecord, format_stack, frame_site, recorder, seq_key
from ncclguard.diagnosis.incident import INCIDENT_FILE, SUMMARY_FILE, merge, render, write_json
from ncclguard.diagnosis.phase import main_thread_phase
from ncclguard.errors import CollectiveTimeout

__all__ = ["ACTIONS", "EXIT_CODE", "Watchdog", "WatchdogConfig", "current_watchdog", "start_watchdog"]

ACTIONS = ("report", "raise", "abort", "exit")
EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, try again"; launchers restart on it
_HOST = socket.gethostname()
_RECENT = 20  # flight records carried in a statement (the rank file has them all)


class WatchdogConfig(BaseSettings):
    """Settings of the :class:`Watchdog`; each can be set as ``NCCLGUARD_WATCHDOG_<FIELD>``.

    Invariants: ``hang_timeout_s > heartbeat_s``; ``peer_timeout_s >= 2 * heartbeat_s`` (a beat may
    come almost one period late); every duration positive.

    Attributes:
        heartbeat_s: how often this rank publishes its state.
        hang_timeout_s: an op in flight this long is a hang. Keep it below the process group's
            timeout (NCCL default 600 s) so the watchdog reports before the backend kills the job.
        peer_timeout_s: a peer whose heartbeat has not changed this long is lost (default 6 beats).
        action: the top rung of the ladder: report, raise, abort or exit.
        escalate_after_s: the time each rung gets to clear the hang before the next one.
        exit_code: the status of the ``exit`` rung.
        incident_dir: where incidents are written (``<incident_dir>/<id>/``).
        merge_wait_s: how long the merging rank waits for the others' statements (default 2 beats).
        store_timeout_s: the bound of every store call (default: ``min(heartbeat_s, 5)``).
        watch_peers: each rank watches this many next ranks (ring order); every rank is watched
            by as many. Bounds the store traffic of large jobs.
        startup_grace_s: a peer never heard from is lost after this long.
        raise_signal: the signal that carries the ``raise`` rung into the main thread.
        session: a name for this watchdog's keys in the store; give a new one to a second
            watchdog started in the same job.
        store_addr: ``host:port`` of the store (default ``MASTER_ADDR:MASTER_PORT``).
        instrument: also call :func:`ncclguard.diagnosis.instrument` so plain ``torch.distributed`` calls
            are recorded.
    """

    model_config = SettingsConfigDict(env_prefix="NCCLGUARD_WATCHDOG_", frozen=True, extra="forbid")

    heartbeat_s: float = Field(5.0, gt=0)
    hang_timeout_s: float = Field(300.0, gt=0)
    peer_timeout_s: float | None = Field(None, gt=0)
    action: Literal["report", "raise", "abort", "exit"] = "report"
    escalate_after_s: float = Field(30.0, gt=0)
    exit_code: int = Field(EXIT_CODE, ge=1, le=255)
    incident_dir: Path = Path("ncclguard-incidents")
    merge_wait_s: float | None = Field(None, gt=0)
    store_timeout_s: float | None = Field(None, gt=0)
    watch_peers: int = Field(16, ge=1)
    startup_grace_s: float = Field(60.0, gt=0)
    raise_signal: str = "SIGUSR2"
    session: str = Field("main", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    store_addr: str | None = None
    instrument: bool = True

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
        return self

    @property
    def peer_timeout(self) -> float:
        """``peer_timeout_s``, or 6 heartbeats when unset."""
        return self.peer_timeout_s if self.peer_timeout_s is not None else 6 * self.heartbeat_s

    @property
    def merge_wait(self) -> float:
        """``merge_wait_s``, or 2 heartbeats when unset."""
        return self.merge_wait_s if self.merge_wait_s is not None else 2 * self.heartbeat_s

    @property
    def store_timeout(self) -> float:
        """``store_timeout_s``, or ``min(heartbeat_s, 5)`` when unset."""
        return self.store_timeout_s if self.store_timeout_s is not None else min(self.heartbeat_s, 5.0)

    @property
    def ladder(self) -> tuple[str, ...]:
        """The rungs this watchdog climbs: ``report`` up to ``action``."""
        return ACTIONS[: ACTIONS.index(self.action) + 1]


@dataclass
class _Peer:
    beat: int = -1
    changed: float = 0.0  # time.monotonic() when its beat last changed
    heartbeat: dict[str, Any] | None = None
    lost: bool = False


@dataclass
class _Incident:
    """An incident as this rank handles it."""

    n: int
    doc: dict[str, Any]
    dir: Path
    local: bool
    merger: bool = False
    merge_deadline: float = 0.0
    merged: bool = False
    rung: int = 0
    rung_deadline: float = 0.0
    done: bool = False
    actions: list[dict[str, Any]] = field(default_factory=list)
    dump: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)  # what Watchdog.incidents shows of it


def _default_store_addr() -> str | None:
    """``host:port`` of the default group's TCPStore (a group set up with ``store=``), or None."""
    import torch.distributed as dist

    try:
        store = compat.default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return f"{store.host}:{store.port}" if isinstance(store, dist.TCPStore) else None
    except (RuntimeError, ValueError, AttributeError):
        return None


def _completed_here(key: tuple[str, int]) -> bool:
    """True when this rank's record of op ``(group, seq)`` completed (failed does not count: an
    op that errored because a peer closed its pairs leaves the job as stuck as before)."""
    for rec in reversed(recorder.records()):
        if rec.seq == key[1] and seq_key(rec.group, rec.peer is not None) == key[0]:
            return rec.state == "completed"
    return False


class _StoreGone(Exception):
    """The store stopped answering."""


_running_lock = threading.Lock()
_running: Watchdog | None = None


def current_watchdog() -> Watchdog | None:
    """The watchdog running in this process, or None."""
    return _running


class Watchdog:
    """One background thread per process that detects hangs, dumps and names the culprits.

    Use ``Watchdog(...).start()`` (or ``with Watchdog(...):``, or :func:`start_watchdog`) on every
    rank right after ``init_process_group``.

    Args:
        config: the settings; default from the environment (``NCCLGUARD_WATCHDOG_*``).
        store: a c10d Store to use instead of a fresh TCPStore client (it is then used from the
            watchdog thread only; it must answer within ``store_timeout_s``).
        **overrides: fields of :class:`WatchdogConfig` applied on top of ``config``.

    Raises:
        pydantic.ValidationError: an unknown field or a value that breaks an invariant.
    """

    def __init__(self, config: WatchdogConfig | None = None, *, store: Any = None, **overrides: Any) -> None:
        if config is not None and not isinstance(config, WatchdogConfig):
            raise TypeError(
                f"config must be a WatchdogConfig, got {type(config).__name__}; pass fields as keywords instead"
            )
        if config is None:
            config = WatchdogConfig(**overrides)
        elif overrides:
            config = WatchdogConfig(**{**config.model_dump(exclude_unset=True), **overrides})
        self.config = config
        self._given_store = store
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._handled: list[dict[str, Any]] = []
        self._prev_handler: Any = None
        self._handler_installed = False
        self._signum = getattr(signal, config.raise_signal)
        self._pending_raise: tuple[BaseException, tuple[str, int] | None, dict[str, Any]] | None = None
        self._instrumented = False

    # ----------------------------------------------------------------- life cycle

    def start(self) -> Watchdog:
        """Starts the thread (returns at once; the store connection is made by the thread).

        Raises:
            RuntimeError: another watchdog runs in this process, or ``action`` needs the signal
                handler (raise and above) and this is not the main thread.
        """
        global _running
        cfg = self.config
        needs_handler = ACTIONS.index(cfg.action) >= ACTIONS.index("raise")
        if needs_handler and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"action {cfg.action!r} raises into the main thread through {cfg.raise_signal}, whose handler "
                "only the main thread can install: start the watchdog from the main thread, or use action='report'"
            )
        with _running_lock:
            if _running is not None:
                raise RuntimeError("a Watchdog already runs in this process; stop() it first (one per process)")
            _running = self
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self._main_ident = threading.main_thread().ident
        self._pid = os.getpid()
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        self._ns = f"ncclguard/wd/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{cfg.session}"
        self._peers: dict[int, _Peer] = {}
        n_watch = min(cfg.watch_peers, self.world_size - 1)
        self._watched = [(self.rank + i) % self.world_size for i in range(1, n_watch + 1)]
        self._reported_ops: set[tuple[str, int]] = set()
        self._incidents: list[_Incident] = []
        self._seen_count = 0
        self._waiting_docs: dict[int, float] = {}
        self._beat = 0
        self._store_error_since: float | None = None
        self._store_lost = False
        self._local_count = 0
        if cfg.instrument:
            from ncclguard.diagnosis.instrument import instrument, is_instrumented

            if not is_instrumented():
                instrument()
                self._instrumented = True
        if needs_handler:
            self._prev_handler = signal.signal(self._signum, self._on_signal)
            self._handler_installed = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ncclguard-watchdog", daemon=True)
        self._thread.start()
        log.info(
            "watchdog started: heartbeat %.3g s, hang after %.3g s, peers lost after %.3g s, action %s, incidents in %s",
            cfg.heartbeat_s,
            cfg.hang_timeout_s,
            cfg.peer_timeout,
            cfg.action,
            cfg.incident_dir,
        )
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread (waits at most ``timeout``, default two store timeouts plus a beat)."""
        global _running
        self._stop.set()
        if self._thread is not None:
            cfg = self.config
            self._thread.join(timeout if timeout is not None else 2 * cfg.store_timeout + cfg.heartbeat_s)
            self._thread = None
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            # None: the old handler was installed from C, which Python cannot put back.
            signal.signal(self._signum, self._prev_handler if self._prev_handler is not None else signal.SIG_DFL)
            self._prev_handler, self._handler_installed = None, False
        if self._instrumented:
            from ncclguard.diagnosis.instrument import uninstrument

            uninstrument()
            self._instrumented = False
        with _running_lock:
            if _running is self:
                _running = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def incidents(self) -> list[dict[str, Any]]:
        """The incidents this rank handled, oldest first: ``id``, ``kind``, ``dir``, ``merger`` (this rank
        merged it), ``actions`` (the rungs taken), ``settled`` (the ladder is over), ``doc``."""
        with self._cond:
            return [dict(i) for i in self._handled]

    def wait_for_incident(
        self,
        timeout: float,
        count: int = 1,
        merged: bool = False,
        settled: bool = False,
    ) -> list[dict[str, Any]]:
        """Waits until this rank has handled ``count`` incidents, at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait at most.
            count: incidents to wait for.
            merged: also wait until the ``count``-th one's ``incident.json`` exists (on this host).
            settled: also wait until this rank's ladder for it is over (top rung taken, or cleared).

        Returns:
            :attr:`incidents`, as they are when the wait ends.
        """
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            if len(self._handled) < count:
                return False
            last = self._handled[count - 1]
            if settled and not last["settled"]:
                return False
            return not merged or (Path(last["dir"]) / INCIDENT_FILE).is_file()

        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            return [dict(i) for i in self._handled]

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        cfg = self.config
        poll = min(cfg.heartbeat_s / 5, 0.5)
        self._connect()
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                recorder.sweep()
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_s
                    self._publish()
                    self._watch()
                self._check_hang()
                self._check_peers()
                self._poll_incidents()
                self._progress()
            except _StoreGone as exc:
                self._on_store_gone(exc)
            except Exception:  # noqa: BLE001 - the watchdog must outlive its own bugs
                log.exception("watchdog tick failed; going on")
            self._stop.wait(poll)

    # ----------------------------------------------------------------- the store

    def _connect(self) -> None:
        cfg = self.config
        if self._given_store is not None:
            self._store = self._given_store
            return
        import torch.distributed as dist

        addr = cfg.store_addr
        if addr is None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if addr is None and dist.is_available() and dist.is_initialized():
            addr = _default_store_addr()
        if addr is None or self.world_size <= 1:
            log.info("watchdog: no store (world of %d); incidents are handled on this rank only", self.world_size)
            return

        host, _, port = addr.rpartition(":")
        try:
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=cfg.store_timeout))
            self._seen_count = int(self._store.add(f"{self._ns}/count", 0))
        except Exception as exc:  # noqa: BLE001
            self._store = None
            self._store_lost = True
            log.error(
                "watchdog: could not connect to the store at %s (%s); incidents are handled on this rank only",
                addr,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )

    def _call(self, method: str, *args: Any) -> Any:
        """One bounded store call; a dead store raises _StoreGone."""
        from torch.distributed import DistNetworkError

        if self._store is None:
            raise _StoreGone("no store")
        try:
            out = getattr(self._store, method)(*args)
        except DistNetworkError as exc:  # broken pipe, connection reset/refused: the server is gone
            raise _StoreGone(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        except RuntimeError as exc:  # a timeout: slow or gone; gone once it lasts a peer timeout
            now = time.monotonic()
            if self._store_error_since is None:
                self._store_error_since = now
            if now - self._store_error_since >= self.config.peer_timeout:
                raise _StoreGone(
                    f"no answer for {now - self._store_error_since:.1f} s: {str(exc).splitlines()[0]}"
                ) from exc
            raise
        self._store_error_since = None
        return out

    def _on_store_gone(self, exc: BaseException) -> None:
        if self._store_lost:
            return
        self._store_lost = True
        self._store = None
        addr = self.config.store_addr or f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        text = (
            f"the rendezvous store at {addr} stopped answering ({exc}); it lives in rank 0's process under a plain "
            "launcher and in the agent under torchrun, so that process is probably gone"
        )
        log.error("watchdog: %s; handling incidents on this rank only from now on", text)
        self._open_local({"kind": "store", "reason": "the rendezvous store is gone", "store_text": text})

    # ----------------------------------------------------------------- state

    def _main_frame(self) -> Any:
        return sys._current_frames().get(self._main_ident)

    def _blocked_in(self) -> FlightRecord | None:
        """The synchronous op the main thread is inside, if any: it is in C++ and cannot be interrupted."""
        for rec in reversed(recorder.inflight()):
            if rec.thread == self._main_ident and not rec.async_op:
                return rec
        return None

    def _heartbeat(self) -> dict[str, Any]:
        blocked = self._blocked_in()
        return {
            "rank": self.rank,
            "host": _HOST,
            "pid": self._pid,
            "beat": self._beat,
            "time": time.time(),
            "phase": main_thread_phase(),
            "site": frame_site(self._main_frame()),
            "last_seq": recorder.last_seq(),
            "last_completed": recorder.last_completed(),
            "inflight": [r.to_dict() for r in recorder.inflight()],
            "blocked_in": blocked.to_dict() if blocked is not None else None,
        }

    def _publish(self) -> None:
        self._beat += 1
        if self._store is None:
            return
        try:
            self._call("set", f"{self._ns}/hb/{self.rank}", json.dumps(self._heartbeat()))
        except RuntimeError:
            pass  # slow store: the next beat tries again

    def _read_heartbeats(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        keys = [f"{self._ns}/hb/{r}" for r in ranks]
        present = [(r, k) for r, k in zip(ranks, keys) if self._call("check", [k])]
        if not present:
            return {}
        blobs = self._call("multi_get", [k for _, k in present])
        return {r: json.loads(b) for (r, _), b in zip(present, blobs)}

    def _watch(self) -> None:
        if self._store is None or not self._watched:
            return
        try:
            beats = self._read_heartbeats(self._watched)
        except RuntimeError:
            return
        now = time.monotonic()
        for r in self._watched:
            peer = self._peers.setdefault(r, _Peer(changed=now))
            hb = beats.get(r)
            if hb is not None and hb.get("beat") != peer.beat:
                if peer.lost:
                    log.warning("watchdog: rank %d is beating again", r)
                    peer.lost = False
                peer.beat, peer.changed, peer.heartbeat = hb["beat"], now, hb

    def _stale(self) -> dict[int, float]:
        """Watched peers whose heartbeat stopped, with seconds since it last changed."""
        cfg = self.config
        now = time.monotonic()
        out = {}
        for r, peer in self._peers.items():
            age = now - peer.changed
            limit = cfg.peer_timeout if peer.beat >= 0 else max(cfg.startup_grace_s, cfg.peer_timeout)
            if age >= limit:
                out[r] = age
        return out

    def _groups(self) -> dict[str, list[int]]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return {}
        for _ in range(3):  # the main thread may add a group while we read
            try:
                names = compat.group_names()
                ranks = compat.group_ranks()
                return {names[pg]: sorted(ranks[pg]) for pg in names if pg in ranks}
            except RuntimeError:
                continue
        return {}

    def _peer_view(self) -> dict[str, dict[str, Any]]:
        stale = self._stale()
        now = time.monotonic()
        return {
            str(r): {"age_s": round(now - p.changed, 3), "stale": r in stale, "seen": p.beat >= 0}
            for r, p in sorted(self._peers.items())
        }

    def _statement(self) -> dict[str, Any]:
        frame = self._main_frame()
        return {
            **self._heartbeat(),
            "world_size": self.world_size,
            "stack": format_stack(frame),
            "recent": [r.to_dict() for r in recorder.records(_RECENT)],
            "groups": self._groups(),
            "peers": self._peer_view(),
        }

    # ----------------------------------------------------------------- detection

    def _check_hang(self) -> None:
        now = time.time()
        for rec in recorder.inflight():
            key = (seq_key(rec.group, rec.peer is not None), rec.seq)
            if key in self._reported_ops or now - rec.start < self.config.hang_timeout_s:
                continue
            self._reported_ops.add(key)
            reason = (
                f"rank {self.rank} waited {now - rec.start:.1f} s in {rec.op} #{rec.seq} on group {rec.group} "
                f"({rec.numel} x {rec.dtype or 'no data'}, issued at {rec.site})"
            )
            log.error("watchdog: hang: %s", reason)
            doc = {"kind": "hang", "reason": reason, "group": key[0], "seq": rec.seq, "op": rec.op}
            p2p = f"/r{self.rank}" if rec.peer is not None else ""
            self._open(f"hang/{key[0]}/{rec.seq}{p2p}", doc)

    def _check_peers(self) -> None:
        if self._store is None:
            return  # without a store no beat can arrive: silence says nothing about the peers
        stale = self._stale()
        fresh = [r for r in stale if not self._peers[r].lost]
        if not fresh:
            return
        for r in fresh:
            self._peers[r].lost = True
        ages = ", ".join(f"rank {r} for {stale[r]:.1f} s" for r in sorted(fresh))
        reason = f"no heartbeat from {ages}"
        log.error("watchdog: peer lost: %s", reason)
        if any(not i.done and i.doc["kind"] == "lost" for i in self._incidents):
            return  # an open lost-incident's merge will list these ranks too
        self._open(f"lost/{min(fresh)}", {"kind": "lost", "reason": reason, "ranks": sorted(fresh)})

    # ----------------------------------------------------------------- incidents

    def _open(self, signature: str, doc: dict[str, Any]) -> None:
        """Raises an incident in the store (once per signature across ranks), or locally without a store."""
        if self._store is None:
            self._open_local(doc)
            return
        token = f"{self.rank}:{uuid.uuid4().hex[:8]}"
        claim = f"{self._ns}/claim/{signature}"
        if self._call("compare_set", claim, "", token).decode() != token:
            return  # another rank raised it; _poll_incidents picks it up
        n = int(self._call("add", f"{self._ns}/count", 1))
        created = time.time()
        doc = {
            **doc,
            "n": n,
            "id": f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(created))}-{n:03d}",
            "by": self.rank,
            "created": created,
            "signature": signature,
        }
        self._call("set", f"{self._ns}/incident/{n}", json.dumps(doc))

    def _open_local(self, doc: dict[str, Any]) -> None:
        self._local_count += 1
        created = time.time()
        doc = {
            **doc,
            "n": -self._local_count,
            "by": self.rank,
            "created": created,
            "signature": "local",
            "id": f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(created))}-r{self.rank}-{doc['kind']}-{self._local_count}",
        }
        self._handle(-self._local_count, doc, local=True)

    def _poll_incidents(self) -> None:
        if self._store is None:
            return
        try:
            count = int(self._call("add", f"{self._ns}/count", 0))
        except RuntimeError:
            return
        for n in range(self._seen_count + 1, count + 1):
            key = f"{self._ns}/incident/{n}"
            if not self._call("check", [key]):
                first = self._waiting_docs.setdefault(n, time.monotonic())
                if time.monotonic() - first < self.config.peer_timeout:
                    return  # its creator is between add and set; look again next tick
                log.warning("watchdog: incident %d was counted but never described; skipping it", n)
            else:
                self._handle(n, json.loads(self._call("get", key)), local=False)
            self._seen_count = n

    def _handle(self, n: int, doc: dict[str, Any], *, local: bool) -> None:
        """Dumps this rank's state for incident ``n`` and publishes its statement."""
        cfg = self.config
        inc = _Incident(n=n, doc=doc, dir=Path(cfg.incident_dir) / doc["id"], local=local)
        statement = self._statement()
        heartbeats: dict[int, dict[str, Any]] = {}
        if not local:
            try:
                heartbeats = self._read_heartbeats(list(range(self.world_size)))
            except (RuntimeError, _StoreGone):
                heartbeats = {r: p.heartbeat for r, p in self._peers.items() if p.heartbeat}
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        inc.dump = {
            "kind": "ncclguard-rank-dump",
            "version": 1,
            "incident": doc,
            "statement": statement,
            "threads": {
                f"{names.get(ident, 'thread')} ({ident})": format_stack(frame, limit=60)
                for ident, frame in frames.items()
            },
            "records": [r.to_dict() for r in recorder.records()],
            "heartbeats": {str(r): hb for r, hb in heartbeats.items()},
            "waiting_after_s": cfg.heartbeat_s,
            "watchdog": json.loads(cfg.model_dump_json()),
            "actions": inc.actions,
        }
        inc.actions.append({"rung": "report", "time": time.time(), "done": True})
        self._write_dump(inc)
        log.error(
            "watchdog: incident %s (%s): %s; this rank's dump: %s",
            doc["id"],
            doc["kind"],
            doc["reason"],
            inc.dir / f"rank{self.rank}.json",
        )
        now = time.monotonic()
        if local:
            inc.merger = True
            inc.merge_deadline = now
        else:
            base = f"{self._ns}/incident/{n}"
            try:
                self._call("set", f"{base}/st/{self.rank}", json.dumps(statement))
                self._call("add", f"{base}/dumped", 1)
                mine = str(self.rank)
                inc.merger = self._call("compare_set", f"{base}/merger", "", mine).decode() == mine
                inc.merge_deadline = now + cfg.merge_wait
            except (RuntimeError, _StoreGone) as exc:
                # Nobody can collect this rank's statement: it merges what it has itself.
                inc.merger, inc.merge_deadline = True, now
                if isinstance(exc, _StoreGone):
                    self._on_store_gone(exc)
        inc.rung_deadline = now  # the next rung (if any) follows the report at once
        self._incidents.append(inc)
        with self._cond:
            inc.record = {
                "id": doc["id"],
                "kind": doc["kind"],
                "dir": str(inc.dir),
                "merger": inc.merger,
                "actions": inc.actions,
                "settled": False,
                "doc": doc,
            }
            self._handled.append(inc.record)
            self._cond.notify_all()

    def _write_dump(self, inc: _Incident) -> None:
        try:
            write_json(inc.dir / f"rank{self.rank}.json", inc.dump)
        except OSError as exc:
            log.error("watchdog: could not write the dump of incident %s: %s", inc.doc["id"], exc)

    def _progress(self) -> None:
        for inc in list(self._incidents):
            if inc.done:
                continue
            try:
                if inc.merger and not inc.merged and not self._merge(inc):
                    continue  # still waiting for statements; the ladder waits for the merge
                self._climb(inc)
            except _StoreGone as exc:
                self._on_store_gone(exc)  # this incident goes on without the store next tick

    def _gather(self, inc: _Incident, stale: dict[int, float]) -> tuple[dict[int, Any], dict[int, Any]] | None:
        """The statements and heartbeats of incident ``inc`` from the store; None while still waiting."""
        base = f"{self._ns}/incident/{inc.n}"
        dumped = int(self._call("add", f"{base}/dumped", 0))
        if dumped < self.world_size - len(stale) and time.monotonic() < inc.merge_deadline:
            return None
        ranks = list(range(self.world_size))
        keys = [f"{base}/st/{r}" for r in ranks]
        present = [(r, k) for r, k in zip(ranks, keys) if self._call("check", [k])]
        blobs = self._call("multi_get", [k for _, k in present]) if present else []
        statements = {r: json.loads(b) for (r, _), b in zip(present, blobs)}
        return statements, self._read_heartbeats(ranks)

    def _merge(self, inc: _Incident) -> bool:
        """Merges when every live rank has spoken or the wait is over; returns True once merged."""
        stale = self._stale()
        own = {self.rank: inc.dump["statement"]}
        cached = {r: p.heartbeat for r, p in self._peers.items() if p.heartbeat}
        extra: list[dict[str, Any]] = []
        analyse_ranks = True
        if inc.doc["kind"] == "store":
            statements, heartbeats, analyse_ranks = own, {}, False
            extra = [{"kind": "store", "text": inc.doc["store_text"]}]
        elif inc.local or self._store is None:
            statements, heartbeats = own, cached
            if not inc.local:
                extra = [
                    {
                        "kind": "store",
                        "text": f"the store went away before the merge: only rank {self.rank}'s "
                        "statement and the heartbeats it had seen are in this report",
                    }
                ]
        else:
            try:
                gathered = self._gather(inc, stale)
            except _StoreGone as exc:
                self._on_store_gone(exc)
                return False  # merge from what this rank has, next tick
            if gathered is None:
                return False
            statements, heartbeats = gathered
            # Each rank watched a few peers: a peer is lost if anyone found it stale.
            for st in statements.values():
                for r, view in (st.get("peers") or {}).items():
                    if view.get("stale") and int(r) not in statements:
                        stale[int(r)] = max(stale.get(int(r), 0.0), view.get("age_s", 0.0))
        stale = {r: a for r, a in stale.items() if r not in statements}
        incident = merge(
            inc.doc,
            statements,
            heartbeats,
            stale,
            self.world_size,
            merged_by=self.rank,
            waiting_after_s=self.config.heartbeat_s,
            extra_findings=extra,
            analyse_ranks=analyse_ranks,
        )
        text = render(incident)
        try:
            write_json(inc.dir / INCIDENT_FILE, incident)
            (inc.dir / SUMMARY_FILE).write_text(text)
        except OSError as exc:
            log.error("watchdog: could not write incident %s: %s", inc.doc["id"], exc)
        inc.merged = True
        log.error(
            "watchdog: incident %s merged: %s; report: %s", inc.doc["id"], incident["summary"], inc.dir / SUMMARY_FILE
        )
        log.info("watchdog: incident report\n%s", text)
        if self._store is not None and not inc.local:
            try:
                self._call(
                    "set",
                    f"{self._ns}/incident/{inc.n}/merged",
                    json.dumps({"host": _HOST, "dir": str(inc.dir.resolve()), "summary": incident["summary"]}),
                )
            except (RuntimeError, _StoreGone):
                pass
        with self._cond:
            self._cond.notify_all()
        return True

    # ----------------------------------------------------------------- the ladder

    def _resolved(self, inc: _Incident) -> bool:
        """True once the op that raised a hang incident completed somewhere (never for lost ranks)."""
        key = self._op_key(inc)
        if key is None:
            return False
        if _completed_here(key):
            if not inc.local and self._store is not None:
                try:
                    self._call("set", f"{self._ns}/incident/{inc.n}/resolved", "1")
                except (RuntimeError, _StoreGone):
                    pass
            return True
        if inc.local or self._store is None:
            return False
        try:
            return bool(self._call("check", [f"{self._ns}/incident/{inc.n}/resolved"]))
        except (RuntimeError, _StoreGone):
            return False

    def _settle(self, inc: _Incident) -> None:
        inc.done = True
        with self._cond:
            inc.record["settled"] = True
            self._cond.notify_all()

    @staticmethod
    def _op_key(inc: _Incident) -> tuple[str, int] | None:
        """(group, seq) of the op that raised a hang incident; None for other kinds."""
        doc = inc.doc
        return (doc["group"], doc["seq"]) if doc["kind"] == "hang" else None

    def _climb(self, inc: _Incident) -> None:
        ladder = self.config.ladder
        if inc.rung + 1 >= len(ladder):
            self._settle(inc)
            return
        now = time.monotonic()
        if now < inc.rung_deadline:
            return
        if self._resolved(inc):
            inc.actions.append({"rung": "resolved", "time": time.time(), "done": True})
            log.warning("watchdog: incident %s cleared before %s", inc.doc["id"], ladder[inc.rung + 1])
            self._settle(inc)
            self._write_dump(inc)
            return
        inc.rung += 1
        inc.rung_deadline = now + self.config.escalate_after_s
        rung = ladder[inc.rung]
        entry: dict[str, Any] = {"rung": rung, "time": time.time()}
        inc.actions.append(entry)
        getattr(self, f"_do_{rung}")(inc, entry)
        self._write_dump(inc)
        with self._cond:
            self._cond.notify_all()

    def _error(self, inc: _Incident) -> CollectiveTimeout:
        doc = inc.doc
        return CollectiveTimeout(
            f"ncclguard watchdog, incident {doc['id']}: {doc['reason']}; report in {inc.dir}",
            op=doc.get("op", ""),
            group=doc.get("group") or "",
            elapsed_s=time.time() - doc["created"],
            missing_ranks=doc.get("ranks"),
        )

    def _do_raise(self, inc: _Incident, entry: dict[str, Any]) -> None:
        blocked = self._blocked_in()
        if blocked is not None:
            entry.update(
                done=False,
                why=f"the main thread is blocked in C++ ({blocked.op} #{blocked.seq}); "
                "an exception cannot reach it before the backend returns",
            )
            log.warning("watchdog: raise skipped: %s", entry["why"])
            return
        self._pending_raise = (self._error(inc), self._op_key(inc), entry)
        signal.pthread_kill(self._main_ident, self._signum)
        entry["done"] = True
        log.error("watchdog: raised CollectiveTimeout in the main thread")

    def _on_signal(self, signum: int, frame: Any) -> None:
        pending, self._pending_raise = self._pending_raise, None
        if pending is not None:
            exc, key, entry = pending
            # Checked here, in the main thread, so it cannot race with the op completing: a rank
            # whose part of the hung op completed meanwhile is not stuck any more.
            if key is not None and _completed_here(key):
                entry.update(
                    done=False,
                    why=f"dropped: op #{key[1]} on group {key[0]} completed on this rank before the signal landed",
                )
                log.warning("watchdog: raise %s", entry["why"])
                return
            raise exc
        prev = self._prev_handler
        if callable(prev):  # not ours: the application's own use of the signal
            prev(signum, frame)

    def _do_abort(self, inc: _Incident, entry: dict[str, Any]) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            entry.update(done=False, why="no process group")
            return
        aborted, failed = compat.abort_all_groups()
        entry.update(done=bool(aborted), aborted=aborted, failed=failed)
        log.error("watchdog: aborted process groups %s%s", aborted, f" (failed: {failed})" if failed else "")

    def _do_exit(self, inc: _Incident, entry: dict[str, Any]) -> None:
        code = self.config.exit_code
        entry.update(done=True, code=code)
        self._write_dump(inc)
        log.critical("watchdog: exiting with status %d after incident %s", code, inc.doc["id"])
        for handler in logging.getLogger().handlers + logging.getLogger("ncclguard").handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_watchdog(config: WatchdogConfig | None = None, *, store: Any = None, **overrides: Any) -> Watchdog:
    """Builds and starts a :class:`Watchdog` (see it for the arguments); returns it.

    Example::

        dist.init_process_group("nccl")
        ncclguard.start_watchdog(heartbeat_s=5, hang_timeout_s=300, action="exit")
    """
    return Watchdog(config, store=store, **overrides).start()
