"""``python -m ncclguard status``: a live, read-only view of a running job, read from its store.

Per rank: phase, step, the last op number and the backend's number in each group, the op in
flight, the heartbeat's age, the straggler score; ranks that agree are grouped; then the newest
incidents. The store is ``--store HOST:PORT``, else torchrun's ``MASTER_ADDR:MASTER_PORT``.

Exit status (of the last read with ``--watch``):

====  =====================================================================
0     healthy: every rank beats, no open incident
2     bad usage (no store address, bad arguments)
3     suspect: a rank's heartbeat is missing, stopped or unreadable, a rank has been in one op
      for over half of ``hang_timeout_s``, or a straggler score is below 0.8
4     incident: an incident is open (raised and not resolved)
5     the store did not answer within ``--timeout``
6     the store answers, but no ncclguard watchdog named a session there (or its index is garbage)
====  =====================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

from ncclguard._naming import rank_ranges
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.store.calls import BoundedCalls
from ncclguard.watching.status import JobStatus, RankGroup, StatusReader, read_index, read_status

__all__ = ["EXIT_CODES", "add_arguments", "connect", "run"]

EXIT_CODES = {"healthy": 0, "usage": 2, "suspect": 3, "incident": 4, "no-store": 5, "no-watchdog": 6}
_STYLE = {"healthy": "bold green", "suspect": "bold yellow", "incident": "bold red"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("--store", metavar="HOST:PORT", help="the job's store (default: MASTER_ADDR:MASTER_PORT)")
    parser.add_argument("--session", default="main", help="the watchdog session (WatchdogConfig.session; default main)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument("--watch", type=float, metavar="S", help="read again every S seconds until interrupted")
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="bound of the connect and of each request (default 10)"
    )
    parser.add_argument("--groups", type=int, default=40, metavar="N", help="show at most N rank groups (default 40)")


def connect(addr: str, timeout: float) -> Any:
    """A TCPStore client of ``addr`` (``host:port``), connected within ``timeout``.

    Args:
        addr: the store's address.
        timeout: seconds.

    Returns:
        The client.

    Raises:
        OSError: the connection was refused (nobody listens there) or timed out.
        StoreTimeout, StoreUnreachable: no answer within ``timeout``.
        RuntimeError: torch's own connect error (``DistNetworkError``, ``DistStoreError``).
    """
    from ncclguard.store.clients import connect

    host, _, port = addr.rpartition(":")
    # A refused connection fails at once here, without torch's retries and C++ log lines.
    with socket.create_connection((host, int(port)), timeout=timeout):
        pass
    return BoundedCalls(addr, timeout, 0.0).run(connect, host, int(port), timeout)


def _seqs(seqs: dict[str, int] | None) -> str:
    if not seqs:
        return "-"
    return " ".join(f"{g}:#{s}" for g, s in sorted(seqs.items()))


def _span(span: tuple[float, float] | None, fmt: str) -> str:
    if span is None:
        return "-"
    lo, hi = span
    return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _group_cells(g: RankGroup) -> list[str]:
    inflight = "-" if g.inflight is None else f"{g.inflight} ({g.inflight_s or 0:.1f} s)"
    state = g.state + (" slow" if g.slow else "")
    step = "-" if g.step is None else str(g.step)
    return [
        g.ranks,
        str(g.count),
        state,
        g.phase or "-",
        step,
        _seqs(g.last_seq),
        _seqs(g.backend_seq),
        inflight,
        _span(g.age_s, ".1f"),
        _span(g.score, ".2f"),
        " ".join(f"#{n}" for n in g.incidents) or "-",
    ]


def show(status: JobStatus, max_groups: int) -> None:
    """Prints ``status`` as tables (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    idx = status.index
    console.print(
        f"[{_STYLE[status.health]}]{status.health.upper()}[/]  {idx.world_size} ranks in {len(status.groups)} "
        f"group(s), world generation {idx.generation}"
    )
    console.print(f"store {status.store}  run {idx.run_id}  restart {idx.restart}  session {idx.session}", markup=False)
    for reason in status.reasons:
        console.print(f"  - {reason}", markup=False)
    table = Table(show_lines=False, pad_edge=False)
    for col in (
        "ranks",
        "n",
        "state",
        "phase",
        "step",
        "last op #",
        "backend #",
        "in flight",
        "beat age s",
        "score",
        "incidents",
    ):
        table.add_column(col, overflow="fold")
    for g in status.groups[:max_groups]:
        table.add_row(*_group_cells(g), style="red" if g.state != "ok" or g.slow else None)
    console.print(table)
    hidden = status.groups[max_groups:]
    if hidden:
        more = rank_ranges(r for g in hidden for r in _ranks_of(g))
        console.print(f"... {len(hidden)} more group(s): ranks {more} (--groups N or --json shows them)", markup=False)
    if status.incidents:
        inc = Table(title=f"incidents ({status.incident_count} in this generation, newest shown)", pad_edge=False)
        for col in ("n", "id", "kind", "state", "by", "reason", "report"):
            inc.add_column(col, overflow="fold")
        for i in status.incidents:
            state = "bad value" if i.problem else "open" if i.open else "ranks back" if i.ranks_back else "resolved"
            reason = i.problem or i.reason
            inc.add_row(str(i.n), i.id, i.kind, state, str(i.by), reason, i.report or "-")
        console.print(inc)
    console.print(
        f"read at {time.strftime('%H:%M:%S', time.localtime(status.read_at))} in {status.requests} store requests"
    )


def _ranks_of(g: RankGroup) -> list[int]:
    out: list[int] = []
    for part in g.ranks.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _read_once(addr: str, args: argparse.Namespace) -> int:
    try:
        store = connect(addr, args.timeout)
    except ConnectionRefusedError:
        print(
            f"ncclguard status: nobody listens at {addr} (connection refused); is the job running, and is this its store?"
        )
        return EXIT_CODES["no-store"]
    except (StoreTimeout, StoreUnreachable, RuntimeError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"ncclguard status: the store at {addr} did not answer within {args.timeout:g} s ({first})")
        return EXIT_CODES["no-store"]
    reader = StatusReader(store, args.timeout)
    try:
        index = read_index(reader, args.session)
        if isinstance(index, str):
            print(
                f"ncclguard status: {index}; is the watchdog running (ncclguard.start_watchdog) and is this its store?"
            )
            return EXIT_CODES["no-watchdog"]
        status = read_status(reader, index, addr)
    except (StoreTimeout, StoreUnreachable) as exc:
        print(f"ncclguard status: the store at {addr} stopped answering ({exc})")
        return EXIT_CODES["no-store"]
    finally:
        reader.close()
    if args.json:
        print(json.dumps(status.model_dump(mode="json"), indent=1))
    else:
        show(status, args.groups)
    return EXIT_CODES[status.health]


def run(args: argparse.Namespace) -> int:
    """Runs the command; returns its exit status (see the module's docstring)."""
    addr = args.store
    if addr is None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit():
        print("ncclguard status: give --store HOST:PORT (or set MASTER_ADDR and MASTER_PORT)")
        return EXIT_CODES["usage"]
    if args.timeout <= 0 or (args.watch is not None and args.watch <= 0) or args.groups < 1:
        print("ncclguard status: --timeout and --watch must be > 0, --groups >= 1")
        return EXIT_CODES["usage"]
    assert addr is not None
    if args.watch is None:
        return _read_once(addr, args)
    code = 0
    try:
        while True:
            if not args.json:
                print("\033[H\033[2J", end="")  # clear the screen
            code = _read_once(addr, args)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code
