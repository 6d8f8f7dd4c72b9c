"""Stacks of a rank that cannot speak for itself, taken from outside the process by py-spy.

A rank whose watchdog thread cannot run (a C call holding the GIL, a SIGSTOPped process, native
code spinning) stops beating and gives no statement; its last heartbeat is old news. When
``py-spy`` is installed (``pip install py-spy``: its wheel ships the binary) a healthy rank on the
same host dumps that rank's Python and native stacks (``py-spy dump --native --pid P``) into the
incident. Without it, or on another host, the report says how to get them. py-spy reads the
other process's memory through ptrace: root, or ``kernel.yama.ptrace_scope`` 0, is needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.incidents.model import CulpritReason, HeartbeatView, Incident, OutsideStack, StatementView

__all__ = [
    "PY_SPY_TIMEOUT_S",
    "add_outside_stacks",
    "dump_stacks",
    "find_py_spy",
    "how_to_get",
    "outside_stacks",
]

PY_SPY_TIMEOUT_S = 20.0
_TRIES = 3
_RETRY_PAUSE_S = 0.3
_MAX_CHARS = 64_000  # a dump of a process with many threads and deep native stacks, kept whole


def find_py_spy() -> str | None:
    """The ``py-spy`` executable: beside this Python (a virtual environment's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def how_to_get(host: str, pid: int) -> str:
    """What to run to get a rank's stacks by hand."""
    return (
        f"on host {host}: `py-spy dump --native --pid {pid}` (pip install py-spy; run as root or with "
        "kernel.yama.ptrace_scope=0)"
    )


def dump_stacks(pid: int, timeout_s: float = PY_SPY_TIMEOUT_S) -> tuple[str | None, str | None]:
    """``py-spy dump --native --pid <pid>``, tried up to ``_TRIES`` times within ``timeout_s``.

    py-spy reads the stacks while the process runs on; a read that raced a frame change fails
    with "Failed to get stack traces" and the next read usually succeeds (seen on a loaded CI
    machine), so a failed read is retried, a timeout is not.

    Returns:
        (the dump, None), or (None, why there is none: the last failure).
    """
    exe = find_py_spy()
    if exe is None:
        return None, "py-spy is not installed"
    deadline = time.monotonic() + timeout_s
    error = "py-spy was not run"
    for attempt in range(_TRIES):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if attempt:
            time.sleep(min(_RETRY_PAUSE_S, left))
        try:
            proc = subprocess.run(
                [exe, "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=max(left, 0.1),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None, f"py-spy did not finish within {timeout_s:g} s"
        except OSError as exc:
            return None, f"py-spy could not run: {exc}"
        if proc.returncode == 0:
            return proc.stdout[-_MAX_CHARS:], None
        said = (proc.stderr or proc.stdout).strip().splitlines()
        error = f"py-spy failed (status {proc.returncode}): {said[0] if said else 'no output'}"
    return None, error


def outside_stacks(
    ranks: Mapping[int, tuple[str, int]], timeout_s: float = PY_SPY_TIMEOUT_S
) -> dict[str, OutsideStack]:
    """The stacks of ``ranks`` (rank -> (host, pid)) on this host, and how to get the others'.

    This process itself is never dumped (its own statement has its stacks).
    """
    out = {}
    for rank, (host, pid) in sorted(ranks.items()):
        if pid <= 0 or (host == HOSTNAME and pid == os.getpid()):
            continue
        text, error = dump_stacks(pid, timeout_s) if host == HOSTNAME else (None, f"on another host ({host})")
        out[str(rank)] = OutsideStack(rank=rank, host=host, pid=pid, text=text, error=error, how=how_to_get(host, pid))
    return out


def add_outside_stacks(incident: Incident, rewrite: Callable[[Incident], None]) -> threading.Thread | None:
    """Dumps, from a helper thread, the stacks of the ranks of ``incident`` that could not speak
    for themselves (lost culprits, silent ranks), then hands the incident with them to
    ``rewrite`` (which writes the report again). The report is on disk meanwhile, and the
    watchdog thread goes on beating.

    Returns:
        The helper thread, or None when no rank needs it.
    """
    lost = {c.rank for c in incident.culprits if c.why is CulpritReason.STOPPED_BEATING}
    targets = {}
    for r in sorted(lost | set(incident.silent)):
        view = incident.ranks.get(str(r))
        if isinstance(view, (StatementView, HeartbeatView)):
            targets[r] = (view.host, view.pid)
    if not targets:
        return None

    def run() -> None:
        stacks = outside_stacks(targets)
        rewrite(incident.model_copy(update={"outside_stacks": stacks}))
        got = sorted(k for k, st in stacks.items() if st.text is not None)
        log.info("watchdog: incident %s: stacks from outside of ranks %s", incident.incident.id, got or "none")

    thread = threading.Thread(target=run, name="ncclguard-watchdog-stacks", daemon=True)
    thread.start()
    return thread
