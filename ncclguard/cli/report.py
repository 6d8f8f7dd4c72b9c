"""``python -m ncclguard report DIR``: print a merged incident (who waited, who was elsewhere).

DIR is an incident directory (``<incident_dir>/<id>``) or the incident root, in which case the
newest incident is shown (``--list`` lists them all). Without an ``incident.json`` (the merging
rank died first), the rank dumps found there are merged on the spot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ncclguard.diagnosis.incident import INCIDENT_FILE, load_incident, render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="an incident directory, or the incident root (newest incident)")
    parser.add_argument("--json", action="store_true", help="print the merged incident as JSON")
    parser.add_argument("--list", action="store_true", help="list the incidents under DIR, oldest first")
    parser.add_argument(
        "--stack-lines",
        type=int,
        default=8,
        metavar="N",
        help="frames of each culprit's main-thread stack to show (default 8)",
    )


def _list(root: Path) -> int:
    rows = []
    for d in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime):
        merged = d / INCIDENT_FILE
        dumps = len(list(d.glob("rank*.json")))
        if not merged.is_file() and not dumps:
            continue
        summary = (
            json.loads(merged.read_text()).get("summary", "") if merged.is_file() else "(not merged: rank dumps only)"
        )
        rows.append(f"{d.name}  {dumps} rank dump(s)  {summary}")
    if not rows:
        print(f"no incidents under {root}")
        return 1
    print("\n".join(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.stack_lines < 0:
        print("--stack-lines must be >= 0")
        return 2
    if args.list:
        if not args.dir.is_dir():
            print(f"{args.dir} is not a directory")
            return 2
        return _list(args.dir)
    try:
        incident, where, merged_here = load_incident(args.dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ncclguard report: {exc}")
        return 2
    except json.JSONDecodeError as exc:
        print(f"ncclguard report: a file under {args.dir} is not valid JSON ({exc}); was it cut short?")
        return 2
    if args.json:
        print(json.dumps(incident, indent=1, default=str))
        return 0
    if merged_here:
        print(f"(no incident.json in {where}: merged here from its rank dumps; the merging rank may have died)\n")
    print(render(incident, stack_lines=args.stack_lines), end="")
    print(f"\nincident directory: {where}")
    return 0
