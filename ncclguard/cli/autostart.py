"""The watchdog started in a rank that did not ask for it: ``ncclguard run`` and ``NCCLGUARD_AUTO``.

The start-up hook (the top-level ``ncclguard_autostart`` module, loaded by
``ncclguard-autostart.pth`` when ``NCCLGUARD_AUTO`` is set) calls :func:`started` right after
``init_process_group`` made the default group. It starts the watchdog with the settings of the
environment (``NCCLGUARD_WATCHDOG_*``, which ``ncclguard run``'s ``--ncclguard-*`` options set), so
every collective is recorded (``instrument``), and rank 0 prints, once, where incidents go and the
command that shows the job live.

The watchdog started here gives way: a script that calls :func:`ncclguard.start_watchdog` itself
stops it and runs its own, so a rank never has two. A restarted rank's stand-in world (a world of
one on torch's ``fake`` backend, :mod:`ncclguard.recovery._rebuild.stand_in`) gets none: the watchdog starts
when the rank joins the real world, which makes its group through ``init_process_group`` too.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from ncclguard._log import log, show_on_stderr
from ncclguard._naming import HOSTNAME, rank_ranges
from ncclguard.env.hostview import prepare_sockets
from ncclguard.env.sockets import SocketPlan
from ncclguard.errors import BadInterface
from ncclguard.incidents.model import Heartbeat
from ncclguard.recovery._rebuild.stand_in import stand_in_for
from ncclguard.watching.base.watchdog_store import store_addr
from ncclguard.watching.watchdog import Watchdog, current_watchdog

__all__ = ["before_init", "peer_gone_line", "plan_line", "stand_in_for", "started", "status_line"]

# gloo's errors when a peer's process or host went away: "Connection closed by peer [10.0.0.2]:4242",
# "Read error [10.0.0.2]:4242: Connection reset by peer" (gloo/transport/tcp/pair.cc).
_PEER_GONE = re.compile(
    r"Connection closed by peer \[([^\]]+)\]"
    r"|(?:Read|Write) error \[([^\]]+)\]:\d+: (?:Connection reset by peer|Broken pipe|Connection timed out|No route)"
)


class _Said:
    """Whether this process printed its line (rank 0 prints it once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.plan_done = False
        self.hooked = False


_SAID = _Said()


def plan_line(plan: SocketPlan, rank: str | None, host: str) -> str:
    """The line a rank prints when the network plan set or kept an interface: what, and why.

    Args:
        plan: the socket plan applied.
        rank: the rank (``RANK``), if known.
        host: this host's name.
    """
    return (
        f"ncclguard: rank {rank or '?'} on {host}: network plan to reach MASTER_ADDR {plan.master}: "
        f"{'; '.join(plan.lines())}. (off: NCCLGUARD_NET_PLAN=0, or ncclguard run --ncclguard-no-net-plan)"
    )


def before_init(backend: Any, init_method: Any) -> SocketPlan | None:
    """Applies the network plan right before the default group is made (the start-up hook calls it).

    Args:
        backend: the backend asked for (``fake``: a restarted rank's stand-in, left alone).
        init_method: the ``init_method`` asked for (the host of ``tcp://HOST:PORT`` is the master).

    Returns:
        The plan applied, or None (a stand-in, or the plan could not be made: the job goes on).

    Raises:
        BadInterface: the user's interface does not exist or has no route to the master.
    """
    show_on_stderr()  # first: the plan's own lines are ncclguard's first INFO lines
    if str(backend) == "fake":
        return None
    master = (
        urlsplit(init_method).hostname if isinstance(init_method, str) and init_method.startswith("tcp://") else None
    )
    try:
        plan = prepare_sockets(master_addr=master)
    except BadInterface:
        raise
    except Exception as exc:  # noqa: BLE001 -- a plan that cannot be made must not stop the job: torch's defaults apply
        log.warning("network plan not applied (%s: %s); torch's defaults apply", type(exc).__name__, exc)
        return None
    with _SAID.lock:
        if not _SAID.plan_done and any(c.action in ("set", "kept") for c in plan.choices):
            _SAID.plan_done = True
            # Printed, once per rank: the job's environment changed without the user asking.
            print(plan_line(plan, os.environ.get("RANK"), HOSTNAME), file=sys.stderr, flush=True)
    return plan


def peer_gone_line(text: str, rank: int, beats: dict[int, Heartbeat], master: str | None) -> str | None:
    """The line that names the host behind gloo's "Connection closed by peer [ADDR]", or None.

    Args:
        text: the error's text.
        rank: this rank.
        beats: the watched peers' last heartbeats (their hosts and addresses).
        master: ``MASTER_ADDR``: the store's host.
    """
    found = _PEER_GONE.search(text)
    if found is None:
        return None
    addr = found.group(1) or found.group(2)
    there = sorted(r for r, hb in beats.items() if hb.address == addr)
    names = sorted({beats[r].host for r in there})
    who = f" ({', '.join(names)}: {'rank' if len(there) == 1 else 'ranks'} {rank_ranges(there)})" if there else ""
    store = ", the host of the job's store (MASTER_ADDR)," if master and addr == master.strip("[]") else ""
    return (
        f"ncclguard: rank {rank}: the host at {addr}{who}{store} is gone: its processes died or its link is down; "
        "this rank's collective failed on it (gloo's error above)"
    )


def _hook(watchdog: Watchdog, rank: int) -> None:
    """Chains an excepthook that names the lost host after the traceback of an uncaught error."""
    previous = sys.excepthook

    def explain(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(kind, exc, tb)
        try:
            beats = (current_watchdog() or watchdog).peer_heartbeats()  # the world's watchdog now
            line = peer_gone_line(str(exc), rank, beats, os.environ.get("MASTER_ADDR"))
        except Exception:  # noqa: BLE001 - the hook of a dying process must not fail in its turn
            line = None
        if line:
            print(line, file=sys.stderr, flush=True)

    sys.excepthook = explain


def status_line(watchdog: Watchdog, world_size: int) -> str:
    """The line rank 0 prints when its watchdog starts: what is watched, where incidents go, and
    the command that shows the job live.

    Args:
        watchdog: the watchdog just started.
        world_size: ranks in the job.

    Returns:
        One line of text.
    """
    cfg = watchdog.config
    addr = store_addr(cfg.store_addr)
    live = f"python -m ncclguard status --store {addr}" if addr else "python -m ncclguard status --store HOST:PORT"
    if cfg.session != "main":
        live += f" --session {cfg.session}"
    return (
        f"ncclguard: watching {world_size} rank(s): hang after {cfg.hang_timeout_s:g} s"
        f"{'' if watchdog.hang.fixed else ' until learned per phase from the job'}, ladder "
        f"{'/'.join(watchdog.ladder.names)}, incidents in {cfg.incident_dir.resolve()}; live view: {live}"
    )


def started() -> Watchdog | None:
    """Starts the watchdog after ``init_process_group`` unless one runs already; prints rank 0's line.

    Returns:
        The watchdog started, or None (one runs already, no group, or the group is a stand-in).
    """
    import torch.distributed as dist

    show_on_stderr()
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "fake":  # a restarted rank's stand-in: the watchdog starts at its join
        return None
    if current_watchdog() is not None:  # the script's own, or one that follows the worlds itself
        return None
    watchdog = Watchdog()
    watchdog.gives_way = True
    watchdog.start()
    rank, size = dist.get_rank(), dist.get_world_size()
    log.info("watchdog started by ncclguard run / NCCLGUARD_AUTO (it gives way to the script's own)")
    with _SAID.lock:
        if not _SAID.hooked:
            _SAID.hooked = True
            _hook(watchdog, rank)
        if rank == 0 and not _SAID.done:
            _SAID.done = True
            # ncclguard run's own line, printed from inside the job: only rank 0 knows the store's
            # address (torchrun picks the port); stderr, so that the script's stdout stays its own.
            print(status_line(watchdog, size), file=sys.stderr, flush=True)
    return watchdog
