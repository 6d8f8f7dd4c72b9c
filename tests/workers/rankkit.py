"""What a rank of a multi-rank test uses: set-up, a fault vocabulary, and saving results.

Faults read like what they do to the job:
    stall(2, 10)            # rank 2 sleeps 10 s here
    kill(1)                 # rank 1 dies with SIGKILL here
    leave(2)                # rank 2 exits cleanly here (a rank gone before the collective)
    if not skip_collective(3): dist.all_reduce(t)   # rank 3 skips this collective

Every fault of the vocabulary, and each fault a worker injects by its own code
(``fault_fired("rank 2 raises in step 4")`` where it fires), is written at once to
``$NCCLGUARD_TEST_OUT/faults.jsonl``; ``save()`` adds this process's world generation and lost
snapshot takes under ``_ncclguard``. tests/harness.py reads both: a launch with no fault must end
with no rebuild and no lost take on every rank (issue 59).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

_results: dict[str, Any] = {}
_fired: list[str] = []  # the faults fired in this process, in order
HEALTH_KEY = "_ncclguard"  # the results' key of what ncclguard did here (tests/harness.py checks it)
FAULTS_FILE = "faults.jsonl"  # under $NCCLGUARD_TEST_OUT: one JSON line per fault fired, any rank
RESTART_VAR = "NCCLGUARD_RESTART_COUNT"  # set by ncclguard's launcher and supervisor: 1, 2, ... in a restart


def init(timeout_s: float = 60.0) -> int:
    """Joins the gloo process group of the launch; returns this rank."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def _health() -> dict[str, int]:
    """This process's world generation and snapshot takes lost, read from the ncclguard modules it
    already imported (a worker that never imported ncclguard has none; nothing is imported here)."""
    world = sys.modules.get("ncclguard.world")
    if world is None:
        return {}
    agreement = sys.modules.get("ncclguard.recovery.snapshots.agreement")  # no keeper ran without it
    return {
        "generation": world.current_world().generation,
        "failed_takes": agreement.takes_lost() if agreement is not None else 0,
    }


def _restarted() -> bool:
    return os.environ.get(RESTART_VAR, "0") not in ("", "0")


def fault_fired(what: str) -> None:
    """Records that a fault fires in this process: this launch is not fault-free.

    Called by every fault of this vocabulary, and by a worker where a fault of its own fires (a
    raise, a NaN, a stall or a kill of its own code, a rebuild it asks for), before the fault acts.
    The line is written at once, so that a rank that never saves again (killed, stuck, fenced)
    still marks its launch. It holds the generation and the takes lost before the fault, but in a
    restarted process: there the first life's end came before, a fault whatever ended it.

    Args:
        what: the fault, in words (the harness's message names it).
    """
    _fired.append(what)
    try:
        me: int | None = rank()
    except (KeyError, ValueError, RuntimeError):  # before init, outside a launcher
        me = None
    before = {} if _restarted() else _health()
    line = {"rank": me, "pid": os.getpid(), "what": what, "at": time.time(), **before}
    out = os.environ.get("NCCLGUARD_TEST_OUT")
    if out is None:
        return
    # One write on a file opened to append: lines of several ranks never interleave.
    fd = os.open(Path(out) / FAULTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, default=str) + "\n").encode())
    finally:
        os.close(fd)


def _note_restart() -> None:
    """A restarted process marks its launch, whatever ended its first life (once; the restart count is
    read at each save: a warm spare learns it only when it takes over)."""
    what = f"a restarted process ({RESTART_VAR}={os.environ.get(RESTART_VAR)})"
    if _restarted() and what not in _fired:
        fault_fired(what)


def stall(who: int, seconds: float) -> None:
    """Rank ``who`` sleeps ``seconds`` here; the others go on."""
    if rank() == who:
        fault_fired(f"stall {seconds} s")
        time.sleep(seconds)


def asleep_for_good(key: str = "stall_at") -> NoReturn:
    """This rank sleeps in Python for good, its threads running and nothing of it moving; when it
    fell asleep is saved first under ``key`` (the stuck-rank tests' fault)."""
    fault_fired("asleep for good")
    put(key, time.time())
    save()
    while True:
        time.sleep(0.1)


def stopped_for_good(key: str = "stall_at") -> NoReturn:
    """This rank stops for good (SIGSTOP to itself: every thread stands, its heartbeats with them, as
    a process frozen in the kernel or a GPU driver call); when is saved first under ``key``."""
    fault_fired("stopped for good")
    put(key, time.time())
    save()
    os.kill(os.getpid(), signal.SIGSTOP)
    while True:  # continued by someone (not in the tests): still stuck
        time.sleep(0.1)


def stuck_for_good() -> NoReturn:
    """The stuck drill's fault: asleep in Python for good, or with ``DRILL_FAULT=stopped``
    (benchmarks/stuck_drill.py --fault stopped) stopped for good, its heartbeats too."""
    if os.environ.get("DRILL_FAULT") == "stopped":
        stopped_for_good()
    asleep_for_good()


def beats_uncounted(seconds: float) -> None:
    """From now on this rank's heartbeats carry no backend count, as the one its watchdog publishes
    inside a rebuild's ``init_process_group`` (before the new group exists); waits ``seconds`` here,
    so that at least one such beat goes out (the watchdog beats every 5 s by default)."""
    from ncclguard.watching.sensors.rank_state import RankState

    fault_fired("heartbeats without a backend count")
    RankState.backend_seq = staticmethod(dict)  # type: ignore[method-assign]
    time.sleep(seconds)


def kill(who: int) -> None:
    """Rank ``who`` dies here with SIGKILL: no cleanup, no goodbye to its peers."""
    if rank() == who:
        fault_fired("SIGKILL")
        save()
        os.kill(os.getpid(), signal.SIGKILL)


def dead(pid: int) -> bool:
    """True once process ``pid`` has ended (gone, or a zombie: its sockets are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def leave(who: int) -> None:
    """Rank ``who`` exits cleanly (status 0) here, as a rank that never reaches the collective."""
    if rank() == who:
        fault_fired("leaves before the collective")
        save()
        os._exit(0)


def skip_collective(who: int) -> bool:
    """True on rank ``who``: the caller skips the collective there (a desync)."""
    if rank() != who:
        return False
    fault_fired("skips a collective")
    return True


def _job_store() -> Any:
    """The launch's own store, under the default group's prefixes (the same after a rebuild)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def announce(name: str) -> None:
    """Marks ``name`` done in the job's store, for :func:`wait_for` on the other ranks."""
    _job_store().set(f"rankkit/{name}", "1")


def wait_for(name: str, at_least_s: float = 0.0, timeout_s: float = 60.0) -> None:
    """Waits until some rank called ``announce(name)``, and at least ``at_least_s`` in all.

    For a rank that must come late (after another gave up): waiting on the event, not a fixed
    sleep that a loaded machine can outrun."""
    t0 = time.monotonic()
    _job_store().wait([f"rankkit/{name}"], timedelta(seconds=timeout_s))
    time.sleep(max(0.0, at_least_s - (time.monotonic() - t0)))


def put(key: str, value: Any) -> None:
    """Records ``value`` (JSON-able) under ``key`` for the test to assert on."""
    _results[key] = value


def save() -> None:
    """Writes this rank's results to ``$NCCLGUARD_TEST_OUT/rank<r>.json``, with what ncclguard did
    here under :data:`HEALTH_KEY` (its world generation, the takes lost, the faults fired)."""
    _note_restart()
    health = _health()
    if health:
        _results[HEALTH_KEY] = {**health, "faults": list(_fired)}
    out = Path(os.environ["NCCLGUARD_TEST_OUT"])
    tmp = out / f".rank{rank()}.json"
    tmp.write_text(json.dumps(_results, default=str))
    tmp.replace(out / f"rank{rank()}.json")


def done() -> None:
    """Saves the results and ends the rank at once.

    ``os._exit`` because a group that timed out still holds the abandoned op in gloo's queue,
    and normal interpreter shutdown would wait on it (or abort) in the group's destructor.
    A rank that made a group just before barriers first: leaving closes the group's pairs, and
    a peer still in gloo's connect fails (tests/workers/netenv_worker.py, ``_leave_together``).
    """
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def when(check: Callable[[], bool], bound_s: float, every_s: float = 0.05) -> threading.Event:
    """An event set once ``check()`` is true, polled on a thread of its own for ``bound_s`` at most.

    A stalled rank waits on it from its own line (``when(...).wait(bound_s)  # MARK: ...``): a
    sample of its main thread then finds it on that line (threading's frames are skipped as
    library frames), never inside the check. Polling on the main thread let a loaded run sample
    it inside the check's file reads, and the report named pathlib.py as the stalled rank's site.
    """
    done = threading.Event()

    def poll() -> None:
        deadline = time.monotonic() + bound_s
        while not check() and time.monotonic() < deadline:
            time.sleep(every_s)
        done.set()

    threading.Thread(target=poll, name="rankkit-when", daemon=True).start()
    return done


class WindowLog:
    """Every straggler window the watchdog ``wd`` closes on this rank, polled every 0.1 s (the test's
    evidence). ``stop()`` ends the polling and returns them (plain dicts)."""

    def __init__(self, wd: Any) -> None:
        self.windows: list[dict] = []
        self._done = threading.Event()

        def poll() -> None:
            while not self._done.wait(0.1):
                w = wd.sensor("straggler").window
                if w is not None and (not self.windows or self.windows[-1]["n"] != w.n):
                    self.windows.append(w.model_dump())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> list[dict]:
        self._done.set()
        self._thread.join(5)
        return self.windows
