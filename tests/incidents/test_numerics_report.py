"""A numerical finding's incident, pure: its words (the reason, the summary, `status`'s row), the
report's sections, the bounds of what travels through the store, and the marks of the pictures
(timeline and trace). The real-rank versions are tests/recovery/test_numerics_multirank.py and
tests/recovery/test_replicas_multirank.py (docs/numerics.md, "Where the finding appears")."""

from __future__ import annotations

import importlib.util
import json

import pytest
from pydantic import ValidationError

from ncclguard.cli import main
from ncclguard.incidents.assemble import assemble
from ncclguard.incidents.files import INCIDENT_FILE, write_json
from ncclguard.incidents.model import (
    DriftReport,
    FlaggedBucket,
    IncidentDoc,
    IncidentKind,
    NamedRank,
    NonFiniteReport,
    Statement,
    upgrade_incident,
)
from ncclguard.incidents.numerics_model import RANKS_CHARS, ranks_field
from ncclguard.incidents.numerics_text import advice, marks, numerics_line
from ncclguard.incidents.pictures import plot_timeline, timeline
from ncclguard.incidents.render import render
from ncclguard.incidents.trace import chrome_trace
from ncclguard.watching.base.watchdog_store import LIMITS

AT = 1_000_000.0
NAMES = ["net.0.weight", "net.0.bias"]


def nan_on_1(**over: object) -> NonFiniteReport:
    fields: dict = {
        "step": 5,
        "at": AT,
        "phase": "train",
        "ranks": "1",
        "named": [NamedRank(rank=1, buckets=[FlaggedBucket(index=0, kind="NaN", params=NAMES)])],
        "finite": "0,2",
        "action": "redo",
    }
    return NonFiniteReport(**{**fields, **over})


def drift_of_2(**over: object) -> DriftReport:
    fields: dict = {
        "step": 8,
        "at": AT,
        "ranks": "2",
        "named": [2],
        "parts": {"parameters": "2"},
        "majority": "0-1",
        "source": 0,
        "outcome": "healed",
    }
    return DriftReport(**{**fields, **over})


def incident(report: NonFiniteReport | DriftReport, world: int = 3):
    doc = IncidentDoc(
        kind=IncidentKind.NUMERICS, reason=numerics_line(report), id="t-001", by=0, created=AT + 0.2, numerics=report
    )
    merged = assemble(doc, {}, {}, {}, world, merged_by=0, waiting_after_s=1.0)
    return merged.model_copy(update={"written_at": AT + 1.5})


def test_a_nan_on_one_rank_reads_as_the_step_the_rank_the_bucket_its_names_and_the_finite_ranks() -> None:
    assert numerics_line(nan_on_1()) == (
        "step 5 (phase train): rank 1's gradient held NaN in bucket 0 (net.0.weight, net.0.bias); ranks 0,2 finite; "
        "the step was redone"
    )
    assert numerics_line(nan_on_1(phase="", action="skip", finite="0")) == (
        "step 5: rank 1's gradient held NaN in bucket 0 (net.0.weight, net.0.bias); rank 0 finite; the step was "
        "skipped (not applied)"
    )
    raised = nan_on_1(attempt=2, action="raise", suspects=[1])
    assert numerics_line(raised) == (
        "step 5 (attempt 2, phase train): rank 1's gradient held NaN in bucket 0 (net.0.weight, net.0.bias); ranks "
        "0,2 finite; the step was not applied: NonFiniteGradient raised on every rank; rank 1 is now a suspect device "
        "(flagged again soon after)"
    )


def test_several_ranks_each_with_its_buckets_the_rest_counted() -> None:
    named = [
        NamedRank(rank=1, buckets=[FlaggedBucket(index=0, kind="NaN", params=["a"], more_params=3)]),
        NamedRank(rank=3, buckets=[FlaggedBucket(index=2, kind="Inf"), FlaggedBucket(index=4, kind="NaN")]),
    ]
    report = nan_on_1(ranks="1,3-6", named=named, finite="", phase="")
    assert numerics_line(report) == (
        "step 5: ranks 1,3-6's gradients were not finite (rank 1: NaN in bucket 0 (a and 3 more); rank 3: Inf in "
        "bucket 2; NaN in bucket 4; 3 more ranks); no other rank's gradient was checked; the step was redone"
    )
    assert advice(report)[0].startswith("no rank's gradient was finite: the cause is shared")
    assert marks(report) == {1: "NaN in bucket 0 (a and 3 more)", 3: "Inf in bucket 2; NaN in bucket 4"}


def test_a_drifted_replica_reads_as_a_silent_corruption_healed_from_a_peer_or_raised() -> None:
    assert numerics_line(drift_of_2()) == (
        "step 8: a silent corruption was seen: rank 2's replica drifted from ranks 0-1's (parameters: rank 2); the "
        "step was not applied; rank 2 was healed from rank 0 in this world and the step redone"
    )
    assert numerics_line(drift_of_2(outcome="heal failed", suspects=[2])) == (
        "step 8: a silent corruption was seen: rank 2's replica drifted from ranks 0-1's (parameters: rank 2); the "
        "step was not applied; healing rank 2 from rank 0 failed: the world is rebuilt; rank 2 is now a suspect "
        "device (flagged again soon after)"
    )
    split = drift_of_2(ranks="0-2", named=[0, 1, 2], parts={"parameters": "0-2"}, majority="", source=None)
    split = split.model_copy(update={"outcome": "raised"})
    assert numerics_line(split) == (
        "step 8: a silent corruption was seen: the replicas of ranks 0-2 differ (parameters: ranks 0-2) and no "
        "digest is held by a majority, so which one drifted cannot be told; the step was not applied: "
        "ReplicasDiverged raised on every rank"
    )
    two_parts = drift_of_2(ranks="1-2", named=[1, 2], parts={"optimizer": "1", "parameters": "1-2"}, majority="0,3")
    assert marks(two_parts) == {1: "replica drifted (optimizer, parameters)", 2: "replica drifted (parameters)"}


def test_the_report_says_what_was_seen_and_done_and_what_to_do_with_no_culprit() -> None:
    text = render(incident(nan_on_1(action="skip", suspects=[1])))
    body = text.split("\n", 2)[2]  # after the title and the line of times
    assert body == (
        "\n"
        "IN ONE LINE\n"
        "  step 5 (phase train): rank 1's gradient held NaN in bucket 0 (net.0.weight, net.0.bias); ranks 0,2 finite; "
        "the step was skipped (not applied); rank 1 is now a suspect device (flagged again soon after)\n"
        "\n"
        "NON-FINITE GRADIENT (step 5, attempt 1, phase train; each bucket checked in the backward, before its "
        "all-reduce)\n"
        "  rank 1: NaN in bucket 0 (net.0.weight, net.0.bias)\n"
        "  ranks 0,2: finite\n"
        "\n"
        "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)\n"
        "  its state was put back and its batch skipped: the loop went on with the next (on_nonfinite='skip')\n"
        "  rank 1: named a suspect device (flagged again soon after an earlier finding)\n"
        "\n"
        "WHAT TO DO\n"
        "  - look at rank 1's batch of step 5 and at the layers of the parameters named; a batch that overflows "
        "again is skipped again\n"
        "  - suspect device on rank 1: check its GPU (nvidia-smi -q -d ECC, dcgmi diag) and take its host out of "
        "the job if it comes back\n"
        "\n"
        "Per-rank dumps (all threads' stacks, flight records, heartbeats): rank<r>.json next to this file.\n"
    )
    assert "CULPRITS" not in text and "VICTIMS" not in text
    drift = render(incident(drift_of_2()))
    assert (
        "SILENT CORRUPTION (step 8, attempt 1, no phase set; the replicas' digests compared at the commit, before "
        "the step was applied)\n"
        "  parameters: rank 2 differed\n"
        "  ranks 0-1: the majority (the same digests)\n"
        "\n"
        "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)\n"
        "  rank 2 healed from rank 0 in this world (no rebuild), the step redone\n"
    ) in drift


def test_the_ranks_statements_are_not_analysed_for_a_hang(tmp_path) -> None:
    # The ranks speak while they train: one in a collective is no victim of a numerical finding.
    now = AT + 1
    busy = {
        "rank": 0,
        "host": "h",
        "pid": 1,
        "beat": 1,
        "time": now,
        "phase": "train",
        "site": "t.py:1",
        "last_seq": {"0": 5},
        "last_completed": {"0": 4},
        "inflight": [{"seq": 5, "op": "all_reduce(SUM)", "group": "0", "start": now - 60}],
    }
    statements = {0: Statement.model_validate(busy), 1: Statement.model_validate({**busy, "rank": 1, "last_seq": {}})}
    doc = IncidentDoc(kind=IncidentKind.NUMERICS, reason="r", id="t-002", numerics=nan_on_1())
    merged = assemble(doc, statements, {}, {}, 2, merged_by=0, waiting_after_s=1.0)
    assert (merged.findings, merged.culprits, merged.victims) == ([], [], [])
    assert merged.summary == numerics_line(nan_on_1())
    write_json(tmp_path / INCIDENT_FILE, merged)  # `ncclguard report` reads it back, the same
    assert upgrade_incident(json.loads((tmp_path / INCIDENT_FILE).read_text())) == merged


def test_ncclguard_report_prints_it(tmp_path, capsys) -> None:
    write_json(tmp_path / INCIDENT_FILE, incident(drift_of_2()))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ncclguard incident t-001: step 8: a silent corruption was seen: rank 2's replica drifted")
    assert "  rank 2 healed from rank 0 in this world (no rebuild), the step redone\n" in out


def test_what_travels_through_the_store_is_bounded_and_a_bad_value_is_refused() -> None:
    assert ranks_field([]) == "" and ranks_field([3, 1, 2, 7]) == "1-3,7"
    spread = ranks_field(list(range(0, 4000, 2)))  # every other rank: no range to fold
    assert len(spread) <= RANKS_CHARS + 1 and spread.endswith("…") and spread.startswith("0,2,4,")
    NonFiniteReport(step=1, ranks=spread, action="redo")  # a cut set still reads
    doc = IncidentDoc(kind=IncidentKind.NUMERICS, reason="r", id="x", numerics=drift_of_2())
    assert IncidentDoc.model_validate_json(doc.model_dump_json()) == doc
    for bad in (
        {"ranks": "1; rm -rf"},  # not rank ranges
        {"ranks": "1," * RANKS_CHARS},  # too long
        {"named": [NamedRank(rank=r) for r in range(9)]},  # too many ranks named
        {"action": "retry"},
    ):
        with pytest.raises(ValidationError):
            NonFiniteReport.model_validate({**nan_on_1().model_dump(), **bad})
    with pytest.raises(ValidationError):
        FlaggedBucket(index=0, kind="NaN", params=["x" * 97])
    old = IncidentDoc.model_validate({"kind": "hang", "reason": "r", "id": "y"})  # before the field: none
    assert old.numerics is None
    # At every bound (and the engine's reason cut at 1500 characters), the incident fits the store's limit.
    full = FlaggedBucket(index=10**6, kind="NaN", params=["x" * 96] * 8, more_params=10**6)
    widest = NonFiniteReport(
        step=10**12,
        attempt=10**6,
        commit=10**9,
        at=AT,
        phase="p" * 200,
        ranks="1" * RANKS_CHARS + "…",
        named=[NamedRank(rank=10**5, buckets=[full] * 4)] * 8,
        finite="2" * RANKS_CHARS + "…",
        action="raise",
        suspects=list(range(8)),
    )
    doc = IncidentDoc(kind=IncidentKind.NUMERICS, reason="r" * 1500, id="x" * 128, numerics=widest, ranks=[0] * 8)
    assert len(doc.model_dump_json().encode()) < LIMITS[IncidentDoc] / 2


def test_the_pictures_mark_each_named_rank_where_the_commit_named_it(tmp_path) -> None:
    tl = timeline(incident(nan_on_1()))
    assert (tl.marks, tl.marked_at, tl.culprits) == ({1: "NaN in bucket 0 (net.0.weight, net.0.bias)"}, AT, {})
    assert tl.title.startswith("t-001 (numerics): step 5 (phase train): rank 1's gradient held NaN in bucket 0")
    trace = chrome_trace(tl)
    marked = [e for e in trace["traceEvents"] if e["name"].startswith("numerical finding")]
    assert marked == [
        {
            "ph": "i",
            "s": "p",
            "name": "numerical finding: NaN in bucket 0 (net.0.weight, net.0.bias)",
            "pid": 1,
            "tid": 1,
            "ts": 0.0,  # the earliest event: the finding, before the incident was raised
        }
    ]
    assert trace["otherData"]["t0"] == AT
    plain = timeline(
        incident(drift_of_2()).model_copy(update={"incident": IncidentDoc(kind="hang", reason="r", id="z")})
    )
    assert plain.marks == {}  # an incident of another kind marks nothing
    if importlib.util.find_spec("matplotlib") is not None:
        plot_timeline(tl, tmp_path / "t.png")
        assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
