"""A stuck transport told apart from a desync by the backend's numbers alone, and reports that carry
both numberings where Python issued the op: the merge and the text, on synthetic statements (the
detectors are tests/watching/test_watching_detect.py; real ranks, tests/watching/test_watching_stuck_multirank.py)."""

from __future__ import annotations

from ncclguard.incidents.analysis import FROM_CPP, analyse
from ncclguard.incidents.assemble import assemble
from ncclguard.incidents.model import (
    BackendOp,
    DesyncFinding,
    IncidentDoc,
    IncidentKind,
    OpRecord,
    Statement,
    StuckFinding,
)
from ncclguard.incidents.render import render

NOW = 1_000_000.0


def statement(
    rank: int, seq: int, *, op: BackendOp | None = None, inflight: list[OpRecord] | None = None, **kw
) -> Statement:
    fields = {
        "rank": rank,
        "host": "node1",
        "pid": 100 + rank,
        "beat": 9,
        "time": NOW,
        "phase": "train step=4",
        "site": "/job/train.py:30",
        "last_seq": {},
        "last_completed": {},
        "inflight": inflight or [],
        "backend_seq": {"0": seq},
        "world_size": 3,
        "groups": {"0": [0, 1, 2]},
        "backend_ops": {"0": op} if op else {},
        **kw,
    }
    return Statement.model_validate(fields)


def bucket(*, completed: bool | None = False, record: OpRecord | None = None) -> BackendOp:
    return BackendOp(
        seq=9,
        name="gloo:all_reduce",
        sizes=[[272]],
        dtypes=["Float"],
        created=NOW - 4.0,
        completed=completed,
        record=record,
    )


def doc(kind: IncidentKind) -> IncidentDoc:
    return IncidentDoc(kind=kind, reason="rank 0 stood 4.0 s at backend op #9", id="x", group="0", seq=9)


def merged(kind: IncidentKind, statements: dict[int, Statement]):
    return assemble(doc(kind), statements, {}, {}, 3, merged_by=0, waiting_after_s=0.5)


def test_every_member_at_one_number_with_the_op_open_is_a_stuck_transport_not_a_desync():
    statements = {r: statement(r, 9, op=bucket()) for r in range(3)}
    incident = analyse(statements, {}, {}, 3, now=NOW, stuck_group="0")
    (finding,) = incident.findings
    assert isinstance(finding, StuckFinding) and finding.backend
    assert (finding.op, finding.seq, finding.numel, finding.dtype, finding.waiting) == (
        "gloo:all_reduce",
        9,
        272,
        "float32",
        [0, 1, 2],
    )
    assert finding.site == f"{FROM_CPP}; main thread at /job/train.py:30"
    assert (incident.culprits, incident.victims) == ([], [0, 1, 2])
    assert incident.summary == (
        "ranks 0-2 waiting in gloo:all_reduce backend #9 (272 x float32, phase train step=4) for 4.0 s; "
        "every member is there: a stuck transport, not a desync"
    )
    text = render(merged(IncidentKind.BACKEND_STUCK, statements))
    assert "CULPRITS: none found" in text
    assert "every member is in the same collective: not a desync. Suspect the network/transport" in text


def test_a_stuck_suspect_that_the_merge_finds_a_rank_behind_of_is_a_desync():
    # Each rank watches a few peers: rank 0 saw none behind, the statements show rank 2 at #8.
    statements = {0: statement(0, 9, op=bucket()), 1: statement(1, 9, op=bucket()), 2: statement(2, 8)}
    statements[2] = statements[2].model_copy(update={"phase": "eval batch=3", "site": "/job/eval.py:12"})
    incident = merged(IncidentKind.BACKEND_STUCK, statements)
    (finding,) = incident.findings
    assert isinstance(finding, DesyncFinding) and finding.waiting == [0, 1]
    assert [(c.rank, c.why.value, c.site) for c in incident.culprits] == [(2, "behind", "/job/eval.py:12")]


def test_everyone_at_one_number_with_the_op_completed_is_nothing():
    done = {r: statement(r, 9, op=bucket(completed=True)) for r in range(3)}
    assert merged(IncidentKind.BACKEND_STUCK, done).findings == []
    # And a desync whose last rank caught up is closed, whatever the statements said of the op.
    assert merged(IncidentKind.BACKEND_DESYNC, {r: statement(r, 9, op=bucket()) for r in range(3)}).findings == []


ISSUED = OpRecord(
    seq=4,
    op="all_reduce(SUM)",
    group="0",
    numel=272,
    dtype="float32",
    start=NOW - 4.0,
    phase="train step=4 > sync",
    site="/job/sync.py:7",
)


def test_a_backend_op_that_python_issued_is_reported_at_its_call_site_with_both_numbers():
    statements = {r: statement(r, 9, op=bucket(record=ISSUED)) for r in range(2)} | {2: statement(2, 8)}
    incident = merged(IncidentKind.BACKEND_DESYNC, statements)
    (finding,) = incident.findings
    assert (finding.site, finding.phase, finding.seq, finding.record_seq) == (
        "/job/sync.py:7",
        "train step=4 > sync",
        9,
        4,
    )
    assert "issued at /job/sync.py:7 (ncclguard's #4)" in render(incident)


def test_a_hang_on_a_recorded_op_carries_the_backends_number_and_name():
    waiting = ISSUED.model_copy(update={"start": NOW - 4.0})
    statements = {
        r: statement(r, 9, op=bucket(record=ISSUED), inflight=[waiting], last_seq={"0": 4}, last_completed={"0": 3})
        for r in range(2)
    }
    statements[2] = statement(2, 8, last_seq={"0": 3}, last_completed={"0": 3})
    incident = assemble(
        IncidentDoc(kind=IncidentKind.HANG, reason="rank 0 waited", id="x", group="0", seq=4),
        statements,
        {},
        {},
        3,
        merged_by=0,
        waiting_after_s=0.5,
    )
    (finding,) = incident.findings
    assert not finding.backend and (finding.seq, finding.backend_seq, finding.backend_op) == (4, 9, "gloo:all_reduce")
    assert "issued at /job/sync.py:7 (the backend's gloo:all_reduce #9)" in render(incident)
    # A statement whose newest backend op is not this record's: no number is claimed.
    other = {r: st.model_copy(update={"backend_ops": {"0": bucket()}}) for r, st in statements.items()}
    incident = assemble(incident.incident, other, {}, {}, 3, merged_by=0, waiting_after_s=0.5)
    assert (incident.findings[0].backend_seq, incident.findings[0].backend_op) == (None, "")
