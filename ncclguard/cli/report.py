"""``python -m ncclguard report DIR``: print a merged incident (who waited, who was elsewhere).

DIR (default: where the watchdog writes them from here) is an incident directory (``<incident_dir>/<id>``) or the incident root, in which case the
newest incident is shown (``--list`` lists them all). Without an ``incident.json`` (the merging
rank died first), the rank dumps found there are merged on the spot. Files of format version 1
(ncclguard before the typed model) and 2 both read; ``--json`` prints version 2, ``--schema`` its
JSON schema. ``--trace OUT.json`` also writes the merged records as a Chrome/Perfetto trace and
``--plot OUT.png`` a timeline of the last ``--seconds`` (:mod:`ncclguard.incidents.pictures`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ncclguard.incidents.files import INCIDENT_FILE, load
from ncclguard.incidents.model import Incident, RankDump, upgrade_incident
from ncclguard.incidents.pictures import plot_timeline, timeline
from ncclguard.incidents.render import render
from ncclguard.incidents.trace import chrome_trace
from ncclguard.watching.base.settings import WatchdogConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir",
        type=Path,
        nargs="?",
        help="an incident directory, or the incident root (newest incident); default: where the watchdog "
        "writes them from here ($NCCLGUARD_WATCHDOG_INCIDENT_DIR, else ./ncclguard-incidents)",
    )
    parser.add_argument("--json", action="store_true", help="print the merged incident as JSON (format version 2)")
    parser.add_argument("--list", action="store_true", help="list the incidents under DIR, oldest first")
    parser.add_argument(
        "--schema", action="store_true", help="print the JSON schemas of incident.json and rank<r>.json, and exit"
    )
    parser.add_argument(
        "--stack-lines",
        type=int,
        default=8,
        metavar="N",
        help="frames of each culprit's main-thread stack to show (default 8)",
    )
    parser.add_argument(
        "--trace", type=Path, metavar="OUT.json", help="also write the merged records as a Chrome/Perfetto trace"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="also draw a timeline of the last seconds (matplotlib, 'plot' extra)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        metavar="S",
        help="the plot's window before the report (default: from when the story started, at least 10)",
    )


def default_dir() -> Path:
    """Where the watchdog writes incidents when started from here: ``NCCLGUARD_WATCHDOG_INCIDENT_DIR``,
    else its default (``ncclguard-incidents`` in the current directory)."""
    raw = os.environ.get(f"{WatchdogConfig.model_config.get('env_prefix', '')}INCIDENT_DIR", "").strip()
    return Path(raw) if raw else Path(WatchdogConfig.model_fields["incident_dir"].default)


def _summary(merged: Path) -> str:
    try:
        return upgrade_incident(json.loads(merged.read_text()), str(merged)).summary
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and pydantic's errors are ValueErrors
        return f"(unreadable: {str(exc).splitlines()[0]})"


def _list(root: Path) -> int:
    rows = []
    for d in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime):
        merged = d / INCIDENT_FILE
        dumps = len(list(d.glob("rank*.json")))
        if not merged.is_file() and not dumps:
            continue
        summary = _summary(merged) if merged.is_file() else "(not merged: rank dumps only)"
        rows.append(f"{d.name}  {dumps} rank dump(s)  {summary}")
    if not rows:
        print(f"no incidents under {root}")
        return 1
    print("\n".join(rows))
    return 0


def _pictures(incident: Incident, where: Path, args: argparse.Namespace) -> int:
    """Writes ``--trace`` and ``--plot``; 0, or 2 when one cannot be written."""
    if args.seconds is not None and args.seconds <= 0:
        print("--seconds must be > 0")
        return 2
    tl = timeline(incident, where)
    try:
        if args.trace is not None:
            args.trace.parent.mkdir(parents=True, exist_ok=True)
            args.trace.write_text(json.dumps(chrome_trace(tl)))
            print(f"trace: {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
        if args.plot is not None:
            plot_timeline(tl, args.plot, args.seconds)
            print(f"plot: {args.plot}", file=sys.stderr)
    except ImportError as exc:
        print(f"ncclguard report: {exc}")
        return 2
    except OSError as exc:
        print(f"ncclguard report: cannot write a picture: {exc}")
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    if args.schema:
        schemas = {
            "ncclguard-incident": Incident.model_json_schema(),
            "ncclguard-rank-dump": RankDump.model_json_schema(),
        }
        print(json.dumps(schemas, indent=1))
        return 0
    if args.dir is None:
        args.dir = default_dir()
        if not args.dir.exists():
            print(f"ncclguard report: no incident directory given, and none at {args.dir} (the default here)")
            return 2
    if args.stack_lines < 0:
        print("--stack-lines must be >= 0")
        return 2
    if args.list:
        if not args.dir.is_dir():
            print(f"{args.dir} is not a directory")
            return 2
        return _list(args.dir)
    try:
        incident, where, merged_here = load(args.dir)
    except json.JSONDecodeError as exc:
        print(f"ncclguard report: a file under {args.dir} is not valid JSON ({exc}); was it cut short?")
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"ncclguard report: {exc}")
        return 2
    if args.trace is not None or args.plot is not None:
        code = _pictures(incident, where, args)
        if code:
            return code
    if args.json:
        print(json.dumps(incident.to_json(), indent=1, default=str))
        return 0
    if merged_here:
        print(f"(no incident.json in {where}: merged here from its rank dumps; the merging rank may have died)\n")
    print(render(incident, stack_lines=args.stack_lines), end="")
    print(f"\nincident directory: {where}")
    return 0
