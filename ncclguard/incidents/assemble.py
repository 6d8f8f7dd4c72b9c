"""The merged incident (``incident.json``): the incident as raised, the analysis of what the ranks
said (:func:`~ncclguard.incidents.analysis.analyse`), and each rank's view (:func:`assemble`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TypeVar

from ncclguard.incidents.analysis import analyse
from ncclguard.incidents.model import (
    Analysis,
    Finding,
    HeadView,
    Heartbeat,
    HeartbeatView,
    Incident,
    IncidentDoc,
    IncidentKind,
    NoView,
    RankView,
    Statement,
    StatementView,
)
from ncclguard.incidents.numerics_text import numerics_line

__all__ = ["assemble", "with_whole"]


def _rank_view(
    rank: int, statements: Mapping[int, Statement], heartbeats: Mapping[int, Heartbeat], view: type[StatementView]
) -> RankView:
    # Built without validating again: each value was validated as it was read, and at 16,384 ranks
    # validating every view again took 1.2 s of the merge (benchmarks/desk_scale.py).
    if rank in statements:
        return _as(view, statements[rank])
    if rank in heartbeats:
        return _as(HeartbeatView, heartbeats[rank])
    return NoView()


V = TypeVar("V", StatementView, HeartbeatView)


def _as(view: type[V], value: Heartbeat) -> V:
    """``value``'s fields as a ``view``, its ``source`` that view's own."""
    return view.model_construct(**{**dict(value), "source": view.model_fields["source"].default})


def with_whole(incident: Incident, whole: Mapping[int, Statement]) -> Incident:
    """``incident`` (assembled from heads: :meth:`Statement.head`) with the views of the ranks in
    ``whole`` replaced by their whole statements. The analysis stands: a head holds all of a
    statement that it reads."""
    ranks = dict(incident.ranks)
    for r, st in whole.items():
        if str(r) in ranks:
            ranks[str(r)] = _as(StatementView, st)
    return incident.model_copy(update={"ranks": ranks})


def assemble(
    doc: IncidentDoc,
    statements: Mapping[int, Statement],
    heartbeats: Mapping[int, Heartbeat],
    stale: Mapping[int, float],
    world_size: int,
    *,
    merged_by: int,
    waiting_after_s: float,
    extra_findings: Sequence[Finding] = (),
    analyse_ranks: bool = True,
    heads: bool = False,
) -> Incident:
    """Builds the merged incident (the content of ``incident.json``).

    Args:
        doc: the incident as raised.
        statements, heartbeats, stale, world_size, waiting_after_s: see :func:`analyse`.
        merged_by: the rank that merges (-1: ``python -m ncclguard report``).
        extra_findings: findings known to the merger only (a lost store: a :class:`StoreFinding`).
        analyse_ranks: False when the statements say nothing about the others (a lost store); an
            incident of the recovery engine's numerical finding is never analysed: its summary is
            the finding (:func:`~ncclguard.incidents.numerics_text.numerics_line`).
        heads: ``statements`` are heads (:meth:`Statement.head`): their views say so
            (:class:`HeadView`), until :func:`with_whole` puts whole ones in.

    Returns:
        The merged incident.
    """
    if doc.numerics is not None:  # the engine's finding: the ranks were training, not waiting (no analysis)
        analyse_ranks = False
    focus = (doc.group, doc.seq) if doc.group is not None and doc.seq is not None else None
    backend = doc.group if doc.kind is IncidentKind.BACKEND_DESYNC else None
    stuck = doc.group if doc.kind is IncidentKind.BACKEND_STUCK else None
    if backend is not None or stuck is not None:
        focus = None  # numbered by the backend, not by ncclguard's records
    result = (
        analyse(
            statements,
            heartbeats,
            stale,
            world_size,
            waiting_after_s=waiting_after_s,
            focus=focus,
            backend_group=backend,
            stuck_group=stuck,
        )
        if analyse_ranks
        else Analysis(summary=numerics_line(doc.numerics) if doc.numerics is not None else "")
    )
    if extra_findings:
        texts = [getattr(f, "text", "") for f in extra_findings] + ([result.summary] if result.findings else [])
        result = result.model_copy(
            update={"findings": [*extra_findings, *result.findings], "summary": "; ".join(texts)}
        )
    return Incident(
        incident=doc,
        written_at=time.time(),
        merged_by=merged_by,
        world_size=world_size,
        statements_from=sorted(statements),
        missing_statements=[r for r in range(world_size) if r not in statements],
        findings=result.findings,
        culprits=result.culprits,
        victims=result.victims,
        lost=result.stale_ranks,
        silent=result.silent,
        summary=result.summary,
        ranks={
            str(r): _rank_view(r, statements, heartbeats, HeadView if heads else StatementView)
            for r in range(world_size)
        },
    )
