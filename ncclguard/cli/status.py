"""``python -m ncclguard status``: a live, read-only view of a running job, read from its store.

Per rank: phase, step, the last op number and the backend's number in each group, the op in
flight, the heartbeat's age, the straggler score; ranks that agree are grouped; then the newest
incidents. The store is ``--store HOST:PORT``, else torchrun's ``MASTER_ADDR:MASTER_PORT``.

Exit status (of the last read with ``--watch``):

====  =====================================================================
0     healthy: every rank beats, no open incident
2     bad usage (no store address, bad arguments)
3     suspect: a rank's heartbeat is missing, stopped or unreadable, a rank waits in an op for
      ranks that have not reached it (``waiting``; those are ``culprit``, with the verdict on
      them where one was published), a rank has been in one op for over half of its hang
      bound, a straggler score is below 0.8, or a numerical finding among the incidents shown
      named a suspect device (after its incident was handled)
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
from collections.abc import Sequence
from typing import Any

from ncclguard._naming import rank_ranges
from ncclguard.cli.status_read import JobStatus, RankGroup, StatusReader, read_index, read_status
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.store.bounded_calls import BoundedCalls

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


WIDE = 120  # from this many columns on, every column; below, the short table (--json has it all)


def _fit(text: str, width: int, lines: int = 1) -> str:
    """``text`` in at most ``lines`` lines of ``width`` characters, broken after spaces and commas
    where it can be (a rank list breaks between its ranges); what does not fit ends in "…"."""
    width = max(4, width)
    out: list[str] = []
    rest = text
    while rest and len(out) < lines:
        if len(rest) <= width:
            out.append(rest)
            rest = ""
            break
        cut = max(rest.rfind(" ", 0, width + 1), rest.rfind(",", 0, width) + 1)
        cut = cut if cut > width // 2 else width  # no break in reach: cut the word
        out.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip()
    if rest:
        out[-1] = out[-1][: width - 1] + "…"
    return "\n".join(out)


def _short_op(inflight: str | None, seconds: float | None) -> str:
    """``"all_reduce(SUM) #56731 on 0"``, 312.4 s -> ``"312s all_reduce #56731"``."""
    if inflight is None:
        return "-"
    op, _, rest = inflight.partition(" #")
    seq = rest.split(" on ", 1)[0]
    took = "" if seconds is None else f"{seconds:.0f}s " if seconds >= 10 else f"{seconds:.1f}s "
    return f"{took}{op.split('(', 1)[0]} #{seq}"  # the time first: a cut keeps it


def _group_cells(g: RankGroup, wide: bool, ranks_w: int) -> list[str]:
    state = g.state + (f" {g.judged}" if g.judged else "") + (" slow" if g.slow else "")
    # A script without phases still says where it is: the main thread's file and line.
    phase = g.phase or (f"at {os.path.basename(g.site)}" if g.site else "-")
    step = "-" if g.step is None else str(g.step)
    incidents = " ".join(f"#{n}" for n in g.incidents) or "-"
    if wide:
        inflight = "-" if g.inflight is None else f"{g.inflight} ({g.inflight_s or 0:.1f} s)"
        return [
            _fit(g.ranks, ranks_w, 2),
            str(g.count),
            state,
            phase,
            step,
            _seqs(g.last_seq),
            _seqs(g.backend_seq),
            inflight,
            _span(g.age_s, ".1f"),
            _span(g.score, ".2f"),
            incidents,
        ]
    inflight = _short_op(g.inflight, g.inflight_s)
    return [_fit(g.ranks, ranks_w, 2), str(g.count), state, phase, step, inflight, incidents]


_WIDE_COLUMNS = (
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
)
# Short: the beat's age and the score go (the state says "late", "stale" or "slow").
_SHORT_COLUMNS = ("ranks", "n", "state", "phase", "step", "in flight", "inc")


GAP = 2  # spaces between columns


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[: max(0, width - 1)] + "…"


def _layout(
    names: Sequence[str], rows: Sequence[Sequence[str]], flexible: dict[str, int], drop: Sequence[str], cols: int
) -> dict[int, int]:
    """Column index -> width, so that the table fits in ``cols``: every column keeps its content's
    width but the ``flexible`` ones (name: least width), which share what is left; columns of
    ``drop`` go, in that order, while even the least widths do not fit.

    rich's tables wrap or crop cells when a screen is short of columns; this layout never wraps a
    cell (a cell longer than its column ends in "…"), so a row takes as many lines as its cells
    hold (two at most: the ranks)."""
    natural = {
        k: max([len(n), *(len(line) for row in rows for line in row[k].splitlines())]) for k, n in enumerate(names)
    }
    least = {k: min(natural[k], flexible.get(n, natural[k])) for k, n in enumerate(names)}
    keep = list(range(len(names)))
    for name in drop:
        if sum(least[k] for k in keep) + GAP * (len(keep) - 1) <= cols:
            break
        keep = [k for k in keep if names[k] != name]
    widths = {k: natural[k] for k in keep}
    over = sum(widths.values()) + GAP * (len(keep) - 1) - cols
    flex = [k for k in keep if names[k] in flexible]
    room = sum(widths[k] - least[k] for k in flex)
    if over > 0 and room > 0:
        # Each flexible column gives in proportion to what it can give: a long phase keeps more.
        for k in flex:
            widths[k] -= min(widths[k] - least[k], -(-over * (widths[k] - least[k]) // room))
    return widths


def _print_table(
    console: Any,
    names: Sequence[str],
    rows: Sequence[Sequence[str]],
    styles: Sequence[str | None],
    widths: dict[int, int],
    two_lines: Sequence[str] = (),
    cut_left: Sequence[str] = (),
) -> None:
    """Prints a header and the rows, each cell's lines cut to its column's width; a cell of a
    ``two_lines`` column takes a second line before it is cut, one of ``cut_left`` loses its start
    (a path's end says the most)."""
    from rich.text import Text

    def line(cells: Sequence[str]) -> str:
        return (" " * GAP).join(_cut(cells[k], widths[k]).ljust(widths[k]) for k in widths).rstrip()

    console.print(Text(line(names), style="bold"))
    for cells, style in zip(rows, styles, strict=True):
        fitted = [_fit(c, widths[k], 2) if k in widths and names[k] in two_lines else c for k, c in enumerate(cells)]
        fitted = [
            "…" + c[len(c) - widths[k] + 1 :] if k in widths and names[k] in cut_left and len(c) > widths[k] else c
            for k, c in enumerate(fitted)
        ]
        split = [cell.splitlines() or [""] for cell in fitted]
        for i in range(max(len(parts) for parts in split)):
            console.print(Text(line([parts[i] if i < len(parts) else "" for parts in split]), style=style or ""))


def show(status: JobStatus, max_groups: int, width: int | None = None) -> None:
    """Prints ``status`` as tables (rich), laid out for the terminal's width: every column from
    :data:`WIDE` columns on, the short table below it; no cell wraps past two lines.

    Args:
        status: what was read.
        max_groups: rank groups shown at most.
        width: the screen's width in columns (default: the terminal's, or ``COLUMNS``).
    """
    from rich.console import Console

    console = Console(highlight=False, width=width)
    cols = console.width
    wide = cols >= WIDE
    idx = status.index
    console.print(
        f"[{_STYLE[status.health]}]{status.health.upper()}[/]  {idx.world_size} ranks in {len(status.groups)} "
        f"group(s), world generation {idx.generation}"
    )
    where = [f"store {status.store}", f"session {idx.session}", f"run {idx.run_id}", f"restart {idx.restart}"]
    if wide or sum(len(w) + 2 for w in where) <= cols:
        console.print("  ".join(where), markup=False)
    else:
        console.print(_fit("  ".join(where[:2]), cols), markup=False)
        console.print(_fit("  ".join(where[2:]), cols), markup=False)
    for reason in status.reasons:
        console.print(_fit(f"  - {reason}", cols, 2), markup=False)
    ranks_w = 34 if wide else 16
    shown = status.groups[:max_groups]
    rows = [_group_cells(g, wide, ranks_w) for g in shown]
    names = _WIDE_COLUMNS if wide else _SHORT_COLUMNS
    widths = _layout(names, rows, {"phase": 8, "in flight": 10}, ("step", "score", "beat age s", "n"), cols)
    _print_table(console, names, rows, ["red" if g.state != "ok" or g.slow else None for g in shown], widths)
    hidden = status.groups[max_groups:]
    if hidden:
        more = rank_ranges(r for g in hidden for r in _ranks_of(g))
        line = f"... {len(hidden)} more group(s): ranks {more} (--groups N or --json shows them)"
        console.print(_fit(line, cols, 2), markup=False)
    if status.incidents:
        title = f"incidents ({status.incident_count} in this generation, newest shown)"
        inc_names: tuple[str, ...] = ("n", "id", "kind", "state", "by", "reason", "report")
        if not wide:
            inc_names = ("n", "kind", "state", "by", "reason")
        inc_rows = []
        for i in status.incidents:
            state = "bad value" if i.problem else "open" if i.open else "ranks back" if i.ranks_back else "resolved"
            cells = {"n": str(i.n), "id": i.id, "kind": i.kind, "state": state, "by": str(i.by)}
            cells |= {"reason": i.problem or i.reason, "report": i.report or "-"}
            inc_rows.append([cells[c] for c in inc_names])
        console.print(title, style="bold")
        widths = _layout(inc_names, inc_rows, {"reason": 16, "report": 16}, ("by", "id", "state"), cols)
        _print_table(console, inc_names, inc_rows, [None] * len(inc_rows), widths, ("reason",), ("report",))
        if not wide:  # where each report is, on a line of its own: the end of a path says the most
            for i in status.incidents:
                if i.report:
                    text = f"#{i.n} report: {i.report}"
                    console.print(
                        text if len(text) <= cols else f"#{i.n} report: …" + i.report[-(cols - 13 - len(str(i.n))) :],
                        markup=False,
                    )
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
