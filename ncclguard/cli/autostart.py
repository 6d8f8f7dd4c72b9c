"""The watchdog started in a rank that did not ask for it: ``ncclguard run`` and ``NCCLGUARD_AUTO``.

The start-up hook (the top-level ``ncclguard_autostart`` module, loaded by
``ncclguard-autostart.pth`` when ``NCCLGUARD_AUTO`` is set) calls :func:`started` right after
``init_process_group`` made the default group. It starts the watchdog with the settings of the
environment (``NCCLGUARD_WATCHDOG_*``, which ``ncclguard run``'s ``--ncclguard-*`` options set), so
every collective is recorded (``instrument``), and rank 0 prints, once, where incidents go and the
command that shows the job live.

The watchdog started here gives way: a script that calls :func:`ncclguard.start_watchdog` itself
stops it and runs its own, so a rank never has two. A restarted rank's stand-in world (a world of
one on torch's ``fake`` backend, :mod:`ncclguard.recovery.internals.stand_in`) gets none: the watchdog starts
when the rank joins the real world, which makes its group through ``init_process_group`` too.
"""

from __future__ import annotations

import sys
import threading

from ncclguard._log import log
from ncclguard.watching.protocol import store_addr
from ncclguard.watching.watchdog import Watchdog, current_watchdog

__all__ = ["started", "status_line"]


class _Said:
    """Whether this process printed its line (rank 0 prints it once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False


_SAID = _Said()


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
        f"ncclguard: watching {world_size} rank(s): hang after {cfg.hang_timeout_s:g} s, ladder "
        f"{'/'.join(watchdog.ladder.names)}, incidents in {cfg.incident_dir.resolve()}; live view: {live}"
    )


def started() -> Watchdog | None:
    """Starts the watchdog after ``init_process_group`` unless one runs already; prints rank 0's line.

    Returns:
        The watchdog started, or None (one runs already, no group, or the group is a stand-in).
    """
    import torch.distributed as dist

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
        if rank == 0 and not _SAID.done:
            _SAID.done = True
            # ncclguard run's own line, printed from inside the job: only rank 0 knows the store's
            # address (torchrun picks the port); stderr, so that the script's stdout stays its own.
            print(status_line(watchdog, size), file=sys.stderr, flush=True)
    return watchdog
