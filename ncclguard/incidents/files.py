"""Incidents on disk: the per-rank dumps, the merged ``incident.json``, the report, loading them back.

The watchdog (:mod:`ncclguard.watching.watchdog`) writes ``<incident_dir>/<id>/rank<r>.json`` on
every rank it can reach, and one surviving rank merges the ranks' statements into
``incident.json`` and ``summary.txt``. The typed model is :mod:`ncclguard.incidents.model`, the
analysis :mod:`ncclguard.incidents.analysis`, the text :mod:`ncclguard.incidents.render`. This
module is their JSON face: :func:`analyse`, :func:`merge` and :func:`render` take and give the plain
JSON data written to the files, and :func:`load` / :func:`load_incident` read format versions 1
and 2 (``python -m ncclguard report``).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from ncclguard._naming import rank_ranges
from ncclguard.incidents import analysis, assemble
from ncclguard.incidents import render as _render
from ncclguard.incidents.model import (
    FORMAT_VERSION,
    Finding,
    Heartbeat,
    Incident,
    IncidentDoc,
    Statement,
    upgrade_incident,
    upgrade_rank_dump,
)

__all__ = [
    "FORMAT_VERSION",
    "INCIDENT_FILE",
    "SUMMARY_FILE",
    "analyse",
    "find_incident",
    "load",
    "load_incident",
    "merge",
    "rank_ranges",
    "render",
    "write_json",
    "write_text",
]

INCIDENT_FILE = "incident.json"
SUMMARY_FILE = "summary.txt"


@functools.cache
def _findings() -> TypeAdapter[list[Finding]]:
    # Built on first use: the union's schema took 0.2 s of every rank's start (ncclguard run).
    return TypeAdapter(list[Finding])


def write_json(path: Path, doc: Any) -> None:
    """Writes ``doc`` (JSON data or a model) as JSON to ``path`` atomically (a reader never sees
    half a file)."""
    text = None
    if isinstance(doc, BaseModel):
        # pydantic's own encoder: 0.4 s for a 31 MB report of 16,384 ranks where json.dumps of its
        # dump took 2.3 s (benchmarks/desk_scale.py); the same JSON. Kept ASCII, as json.dumps
        # writes it, so that any locale reads it back: a rare non-ASCII name takes the slow way.
        text = doc.model_dump_json(indent=1, by_alias=True)
        if not text.isascii():
            text, doc = None, doc.model_dump(mode="json", by_alias=True)
    write_text(path, text if text is not None else json.dumps(doc, indent=1, default=str))


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: a reader never sees half a file, and two threads
    writing the same report (the merge, then the outside stacks' rewrite) each write their own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _statements(raw: Mapping[int, Any]) -> dict[int, Statement]:
    return {int(r): Statement.model_validate(v) for r, v in raw.items()}


def _heartbeats(raw: Mapping[int, Any]) -> dict[int, Heartbeat]:
    return {int(r): Heartbeat.model_validate(v) for r, v in raw.items()}


def analyse(
    statements: Mapping[int, Any],
    heartbeats: Mapping[int, Any],
    stale: Mapping[int, float],
    world_size: int,
    *,
    now: float | None = None,
    waiting_after_s: float = 0.0,
    focus: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """:func:`ncclguard.incidents.analysis.analyse` on JSON statements and heartbeats.

    Returns:
        ``{"findings", "culprits", "victims", "lost", "silent", "summary"}`` as JSON data.

    Raises:
        pydantic.ValidationError: a statement or heartbeat that does not fit the model.
    """
    result = analysis.analyse(
        _statements(statements),
        _heartbeats(heartbeats),
        stale,
        world_size,
        now=now,
        waiting_after_s=waiting_after_s,
        focus=focus,
    )
    return result.to_json()


def merge(
    doc: Mapping[str, Any],
    statements: Mapping[int, Any],
    heartbeats: Mapping[int, Any],
    stale: Mapping[int, float],
    world_size: int,
    *,
    merged_by: int,
    waiting_after_s: float,
    extra_findings: Sequence[Mapping[str, Any]] | None = None,
    analyse_ranks: bool = True,
) -> dict[str, Any]:
    """:func:`ncclguard.incidents.assemble.assemble` on JSON data: the content of ``incident.json``.

    Args:
        doc: the incident as raised (``id``, ``kind``, ``reason``, ``by``, ``created``, ...).
        statements, heartbeats, stale, world_size, waiting_after_s: see :func:`analyse`.
        merged_by: the rank that merges.
        extra_findings: findings known to the merger only (``{"kind": "store", "text": ...}``).
        analyse_ranks: False when the statements say nothing about the others (a lost store).

    Returns:
        The merged incident as JSON data (format version 2).
    """
    incident = assemble.assemble(
        IncidentDoc.model_validate(doc),
        _statements(statements),
        _heartbeats(heartbeats),
        stale,
        world_size,
        merged_by=merged_by,
        waiting_after_s=waiting_after_s,
        extra_findings=_findings().validate_python(list(extra_findings or [])),
        analyse_ranks=analyse_ranks,
    )
    return incident.to_json()


def render(incident: Incident | Mapping[str, Any], *, stack_lines: int = 8) -> str:
    """The merged incident (a model, or JSON data of version 1 or 2) as plain text.

    Raises:
        ValueError: JSON data that is not an ncclguard incident.
    """
    if not isinstance(incident, Incident):
        incident = upgrade_incident(dict(incident), "the incident")
    return _render.render(incident, stack_lines=stack_lines)


def find_incident(path: str | os.PathLike[str]) -> Path:
    """The incident directory at ``path``: itself, or its newest incident subdirectory.

    Raises:
        FileNotFoundError: nothing that looks like an incident is there.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; pass an incident directory (the one holding rank*.json)")

    def is_incident(d: Path) -> bool:
        return (d / INCIDENT_FILE).is_file() or any(d.glob("rank*.json"))

    if is_incident(root):
        return root
    subs = sorted((d for d in root.iterdir() if d.is_dir() and is_incident(d)), key=lambda d: d.stat().st_mtime)
    if not subs:
        raise FileNotFoundError(f"no incident under {root}: expected incident.json or rank<r>.json files")
    return subs[-1]


def load(path: str | os.PathLike[str]) -> tuple[Incident, Path, bool]:
    """Loads the merged incident at ``path`` (format 1 or 2); merges the rank dumps there when no
    merge was written.

    Returns:
        (the merged incident, its directory, True when it was merged here from rank files).

    Raises:
        FileNotFoundError: no incident at ``path``.
        ValueError: a file there is not an ncclguard incident, or not one this version reads.
        json.JSONDecodeError: a file there is not JSON (cut short?).
    """
    where = find_incident(path)
    merged = where / INCIDENT_FILE
    if merged.is_file():
        return upgrade_incident(json.loads(merged.read_text()), str(merged)), where, False
    dumps = {}
    for f in sorted(where.glob("rank*.json")):
        dump = upgrade_rank_dump(json.loads(f.read_text()), str(f))
        dumps[dump.statement.rank] = dump
    any_dump = next(iter(dumps.values()))
    heartbeats: dict[int, Heartbeat] = {}
    stale: dict[int, float] = {}
    for d in dumps.values():
        for r, hb in d.heartbeats.items():
            heartbeats.setdefault(int(r), hb)
        for r, peer in d.statement.peers.items():
            if peer.stale:
                stale[int(r)] = max(stale.get(int(r), 0.0), peer.age_s)
    incident = assemble.assemble(
        any_dump.incident,
        {r: d.statement for r, d in dumps.items()},
        heartbeats,
        stale,
        any_dump.statement.world_size or max(dumps) + 1,
        merged_by=-1,
        waiting_after_s=any_dump.waiting_after_s,
    )
    return incident, where, True


def load_incident(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path, bool]:
    """:func:`load`, with the incident as JSON data (format version 2).

    Raises:
        FileNotFoundError, ValueError, json.JSONDecodeError: as :func:`load`.
    """
    incident, where, merged_here = load(path)
    return incident.to_json(), where, merged_here
