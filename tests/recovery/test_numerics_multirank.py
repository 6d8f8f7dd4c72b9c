"""A gradient that turns NaN or Inf on one rank, named at its source and never applied, on 3 real gloo ranks.

One launch of tests/workers/numerics_worker.py, 3 ranks under torchrun, scenario ``drill``: five runs
in a row from the same start (a 956,042-parameter classifier with dropout, AdamW, a warm-up LR
schedule stepped every iteration, shuffled data, 8 steps, RecoveringStep with every default but
``on_nonfinite="redo"`` unless said: the default, ``"auto"``, checks only a model on a GPU); rank 1's gradient of ``fc1.weight`` is poisoned by a tensor hook, so one of DDP's two buckets
holds it:

1. ``clean``: no fault: nothing reported, every commit names the three ranks finite, 0 rebuilds.
2. ``redo``: NaN at step K in the first attempt: the commit names rank 1, bucket 1 and its four
   parameters, ranks 0 and 2 finite; the step is redone once on the same world (no rebuild) and the
   run ends bit-equal to ``clean``.
3. ``skip``: ``on_nonfinite="skip"``, Inf at steps K and K2: both steps skipped (falsy,
   ``NonFiniteGradient``), rank 1 named a suspect device once; the run ends bit-equal to ``plain``.
4. ``plain``: a plain DDP loop without ncclguard that leaves batches K and K2 out (so the check's
   comm hook also reduces as DDP's own path does, bit for bit).
5. ``raise``: ``on_nonfinite="raise"``: every rank raises ``NonFiniteGradient`` naming rank 1, its
   parameters as the step found them.

Then ``safe_all_reduce``'s input check: NaN on rank 1 with ``check_finite=True``, Inf on rank 2 with
``verify=True`` under ``Config.check_finite="verified"``: every rank's call fails naming the rank,
nothing reduced; a finite call after it works; under the default (``"never"``) nothing is checked.

A watchdog runs on every rank (tests/workers/numerics_views.py), each step in phase ``train``: each of
the four findings is one ``numerics`` incident, and nothing else is (``clean`` raised none); ``ncclguard
status``, read by rank 0 from the job's store, lists them resolved; this test runs ``ncclguard report``
on each incident's directory after the launch and draws its timeline and trace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.cli import main
from ncclguard.incidents.files import load
from ncclguard.incidents.pictures import timeline
from ncclguard.incidents.trace import chrome_trace

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]  # 60 s past the launch's own hang guard

STEPS, K, K2 = 8, 3, 6  # numerics_worker's
CLEAN = {
    "ok": True,
    "attempts": 1,
    "rebuilds": 0,
    "skipped": False,
    "commits": [[True, []]],
    "nonfinite": [{}],
    "finite": [[0, 1, 2]],
    "error": None,
}
# DDP's second bucket once rebuilt after step 0 (the first holds head and fc3), in its order.
BUCKET_1 = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]


def flagged(kind: str) -> dict[str, list[dict[str, object]]]:
    return {"1": [{"index": 1, "kind": kind, "params": BUCKET_1, "more_params": 0}]}


@pytest.fixture(scope="module")
def drill():
    # Five short runs and four all_reduces after torchrun's start: 9 s here. Hang guard: over 10x that.
    return run_ranks("numerics_worker", 3, "drill", timeout_s=150)


def test_a_fault_free_run_reports_nothing_and_rebuilds_nothing(drill):
    for r in range(3):
        clean = drill[r]["clean"]
        assert clean["results"] == [CLEAN] * STEPS
        assert (clean["seen"], clean["suspects"], clean["recoveries"], clean["raised"]) == ([], [], 0, None)
        assert drill[r]["clean_warnings"] == []


def test_a_nan_named_at_its_rank_bucket_and_parameters_is_redone_once_and_ends_bit_equal(drill):
    redone = {
        "ok": True,
        "attempts": 2,
        "rebuilds": 0,
        "skipped": False,
        "commits": [[False, [1]], [True, []]],
        "nonfinite": [flagged("NaN"), {}],
        "finite": [[0, 2], [0, 1, 2]],
        "error": None,
    }
    for r in range(3):
        redo = drill[r]["redo"]
        assert redo["results"] == [CLEAN] * K + [redone] + [CLEAN] * (STEPS - K - 1)
        assert redo["seen"] == [[K, [1], [0, 2], "redo"]]
        assert (redo["suspects"], redo["recoveries"]) == ([], 0)  # a redo for the values is no recovery
        assert drill[r]["redo_equal_to_clean"] is True  # bit for bit, the run without the fault
        assert drill[r]["redo_same_everywhere"] is True


def test_skipped_batches_leave_no_trace_and_a_rank_flagged_twice_is_a_suspect_device(drill):
    skipped = {
        "ok": False,
        "attempts": 1,
        "rebuilds": 0,
        "skipped": True,
        "commits": [[False, [1]]],
        "nonfinite": [flagged("Inf")],
        "finite": [[0, 2]],
        "error": "NonFiniteGradient",
    }
    for r in range(3):
        skip = drill[r]["skip"]
        expected = [CLEAN] * STEPS
        expected[K] = expected[K2] = skipped
        assert skip["results"] == expected
        assert skip["seen"] == [[K, [1], [0, 2], "skip"], [K2, [1], [0, 2], "skip"]]
        assert skip["suspects"] == [1]
        (warning,) = drill[r]["skip_suspect_warnings"]  # one warning, on every rank, naming rank 1
        assert f"[rank {r}] RecoveringStep: rank 1 gave a non-finite gradient again at step {200 + K2}" in warning
        # Bit for bit, a plain DDP loop (no hook, no ncclguard) that left batches K and K2 out.
        assert drill[r]["skip_equal_to_plain"] is True
        assert drill[r]["skip_same_everywhere"] is True
        assert drill[r]["skip_differs_from_clean"] is True
        assert drill[r]["finite"] is True  # every parameter of the three runs


def test_with_raise_every_rank_raises_naming_the_rank_and_nothing_is_applied(drill):
    for r in range(3):
        raised = drill[r]["raise"]
        assert raised["results"] == [CLEAN] * K
        assert raised["raised"] == {
            "step": 300 + K,
            "ranks": [1],
            "finite": [0, 2],
            "action": "raise",
            "buckets": {"1": [{"index": 1, "kind": "NaN", "params": BUCKET_1, "more_params": 0}]},
            "untouched": True,
        }


def test_safe_all_reduce_names_a_non_finite_input_before_anything_is_reduced(drill):
    for r in range(3):
        said = drill[r]["all_reduce"]
        mine = [float(r + i) for i in range(4)]
        assert said["checked"] == {
            "ok": False,
            "error": "NonFiniteInput",
            "ranks": [1],
            "kinds": {"1": "NaN"},
            "nothing_reduced": True,
            "untouched": True,  # bit for bit, rank 1's NaN included
            "values": mine if r != 1 else [1.0, 2.0, "nan", 4.0],
        }
        assert said["finite_after"] == {
            "ok": True,
            "error": None,
            "ranks": None,
            "kinds": {},
            "nothing_reduced": False,
            "untouched": False,
            "values": [3.0, 6.0, 9.0, 12.0],
        }
        assert said["verified"]["error"] == "NonFiniteInput" and said["verified"]["ranks"] == [2]
        assert said["verified"]["kinds"] == {"2": "Inf"} and said["verified"]["untouched"] is True
        # Off by default (its measured cost, docs/numerics.md): not checked, even in the round; the NaN spreads.
        assert said["default"]["ok"] is True and said["default"]["values"] == [3.0, 6.0, "nan", 12.0]


NAMED = "(fc2.bias, fc2.weight, fc1.bias, fc1.weight)"
FOUND = [  # each finding's incident, in words: its reason, its summary and status's row
    f"step 103 (phase train): rank 1's gradient held NaN in bucket 1 {NAMED}; ranks 0,2 finite; the step was redone",
    f"step 203 (phase train): rank 1's gradient held Inf in bucket 1 {NAMED}; ranks 0,2 finite; the step was skipped "
    "(not applied)",
    f"step 206 (phase train): rank 1's gradient held Inf in bucket 1 {NAMED}; ranks 0,2 finite; the step was skipped "
    "(not applied); rank 1 is now a suspect device (flagged again soon after)",
    f"step 303 (phase train): rank 1's gradient held NaN in bucket 1 {NAMED}; ranks 0,2 finite; the step was not "
    "applied: NonFiniteGradient raised on every rank",
]
DONE = [
    "its state was put back and the step ran again on the same world (no rebuild; on_nonfinite='redo')",
    "its state was put back and its batch skipped: the loop went on with the next (on_nonfinite='skip')",
    "its state was put back and its batch skipped: the loop went on with the next (on_nonfinite='skip')\n"
    "  rank 1: named a suspect device (flagged again soon after an earlier finding)",
    "NonFiniteGradient was raised on every rank (on_nonfinite='raise')",
]


def test_each_finding_is_one_incident_that_status_lists_and_nothing_else_is_raised(drill):
    for r in range(3):  # the same incidents on every rank, in the order found; none from the clean run
        assert [(i["kind"], i["reason"]) for i in drill[r]["incidents"]] == [("numerics", f) for f in FOUND]
        assert [i["id"] for i in drill[r]["incidents"]] == [i["id"] for i in drill[0]["incidents"]]
    status = drill[0]["status"]
    ids = [i["id"] for i in drill[0]["incidents"]]
    # Past events: the engine acted at the commit, nothing is open; but the device it named stays a
    # reason to look (exit 3), after its incident was handled.
    assert (status["code"], status["health"], status["incident_count"]) == (3, "suspect", 4)
    assert status["reasons"] == [
        f"suspect device named by the numerical check: ranks 1 (incident {ids[2]}); consider taking it out of the job"
    ]
    assert status["incidents"] == [
        {"n": n, "kind": "numerics", "reason": f, "open": False, "suspects": [1] if n == 3 else []}
        for n, f in enumerate(FOUND, 1)
    ]
    screen = status["screen"]
    assert screen.startswith("SUSPECT  3 ranks") and "incidents (4 in this generation, newest shown)" in screen
    assert "suspect device named by the numerical check: ranks 1" in screen, screen
    for f in FOUND:  # each row's reason, on its first line of the table
        assert f[:80] in screen, screen


def test_ncclguard_report_names_the_rank_step_bucket_parameters_and_finite_ranks(drill, capsys):
    for incident, found, done in zip(drill[0]["incidents"], FOUND, DONE, strict=True):
        assert main(["report", incident["dir"]]) == 0
        out = capsys.readouterr().out
        step = found.split(" ", 2)[1]
        kind = "NaN" if "held NaN" in found else "Inf"
        assert out.startswith(f"ncclguard incident {incident['id']}: {found}\n")
        assert "from the statements of 3/3 ranks" in out
        assert (
            f"\nIN ONE LINE\n  {found}\n\n"
            f"NON-FINITE GRADIENT (step {step}, attempt 1, phase train; each bucket checked in the backward, before its "
            "all-reduce)\n"
            f"  rank 1: {kind} in bucket 1 {NAMED}\n"
            "  ranks 0,2: finite\n\n"
            "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)\n"
            f"  {done}\n\nWHAT TO DO\n"
        ) in out
        assert "CULPRITS" not in out and "VICTIMS" not in out


def test_the_timeline_marks_the_rank_where_the_commit_named_it(drill):
    where = Path(drill[0]["incidents"][0]["dir"])
    incident, _, merged_here = load(where)
    assert not merged_here and incident.summary == FOUND[0]
    tl = timeline(incident, where)
    assert tl.marks == {1: f"NaN in bucket 1 {NAMED}"} and 0 < tl.marked_at <= tl.raised
    assert tl.title == f"{incident.incident.id} (numerics): {FOUND[0]}"
    marked = [e for e in chrome_trace(tl)["traceEvents"] if e["name"].startswith("numerical finding")]
    assert [(e["pid"], e["name"]) for e in marked] == [(1, f"numerical finding: NaN in bucket 1 {NAMED}")]
