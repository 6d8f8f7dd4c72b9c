"""The analysis by the backend's sequence numbers (a ``desync`` incident: ops issued from C++,
e.g. DDP's reducer), on synthetic statements; the Python-level analysis is tests/incidents/test_incident.py."""

from __future__ import annotations

from ncclguard.incidents.analysis import FROM_CPP, analyse
from ncclguard.incidents.assemble import assemble
from ncclguard.incidents.model import BackendOp, CulpritReason, DesyncFinding, IncidentDoc, IncidentKind, Statement
from ncclguard.incidents.render import render

NOW = 1_000_000.0


def statement(rank: int, seq: int, *, phase: str, site: str, op: BackendOp | None = None) -> Statement:
    return Statement(
        rank=rank,
        host="node1",
        pid=100 + rank,
        beat=4,
        time=NOW,
        phase=phase,
        site=site,
        last_seq={},
        last_completed={},
        inflight=[],
        backend_seq={"0": seq},
        world_size=3,
        stack=[f"{site} in loop"],
        groups={"0": [0, 1, 2]},
        backend_ops={"0": op} if op else {},
    )


BUCKET = BackendOp(seq=9, name="gloo:all_reduce", sizes=[[272]], dtypes=["Float"], created=NOW - 3.04, completed=False)
DOC = IncidentDoc(
    kind=IncidentKind.BACKEND_DESYNC, reason="rank 0 stood 3.0 s at backend op #9", id="x", group="0", seq=9
)


def ddp_desync() -> dict[int, Statement]:
    return {
        0: statement(0, 9, phase="train step=4", site="/job/train.py:30", op=BUCKET),
        1: statement(1, 9, phase="train step=4", site="/job/train.py:30", op=BUCKET),
        2: statement(2, 8, phase="eval batch=3", site="/job/eval.py:12"),
    }


def test_ranks_ahead_wait_in_the_backends_op_and_the_rank_behind_is_the_culprit():
    out = analyse(ddp_desync(), {}, {}, 3, now=NOW, backend_group="0")
    (finding,) = out.findings
    assert isinstance(finding, DesyncFinding) and finding.backend
    assert (finding.op, finding.seq, finding.numel, finding.dtype, finding.waiting) == (
        "gloo:all_reduce",
        9,
        272,
        "float32",
        [0, 1],
    )
    assert finding.site == f"{FROM_CPP}; main thread at /job/train.py:30" and finding.waiting_s == 3.0
    (culprit,) = out.culprits
    assert (culprit.rank, culprit.why, culprit.last_seq, culprit.phase) == (2, CulpritReason.BEHIND, 8, "eval batch=3")
    assert out.victims == [0, 1]
    assert out.summary == (
        "ranks 0-1 waiting in gloo:all_reduce backend #9 (272 x float32, phase train step=4) for 3.0 s; "
        "rank 2 last completed #8, now in phase eval batch=3 at eval.py:12"
    )
    # Without the backend's group, the Python-level analysis finds nothing: no recorded op is in flight.
    assert analyse(ddp_desync(), {}, {}, 3, now=NOW).findings == []


def test_a_desync_incident_is_merged_by_the_backends_numbers_and_rendered():
    incident = assemble(DOC, ddp_desync(), {}, {}, 3, merged_by=0, waiting_after_s=0.5)
    assert [c.rank for c in incident.culprits] == [2]
    text = render(incident)
    assert (
        "  ranks 0-1 in gloo:all_reduce backend #9: 272 x float32, phase train step=4, for "
        f"{incident.findings[0].waiting_s:.1f} s, issued from {FROM_CPP}; main thread at /job/train.py:30"
    ) in text


def test_a_rank_behind_that_stopped_beating_is_lost_and_a_closed_desync_is_nothing():
    out = analyse(ddp_desync(), {}, {2: 4.0}, 3, now=NOW, backend_group="0")
    (culprit,) = out.culprits
    assert (culprit.rank, culprit.why, culprit.stale_s) == (2, CulpritReason.STOPPED_BEATING, 4.0)
    closed = ddp_desync()
    closed[2] = statement(2, 9, phase="train step=4", site="/job/train.py:30")
    out = analyse(closed, {}, {}, 3, now=NOW, backend_group="0")
    assert (out.findings, out.culprits, out.victims) == ([], [], [])
