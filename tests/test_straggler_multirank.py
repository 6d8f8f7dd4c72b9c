"""Straggler detection on real gloo ranks (tests/workers/straggler_worker.py), one launch of 3 ranks:
40 s of a healthy, noisy run (3 ranks on a loaded 2-core machine), then rank 2 does 30% more work per
step. The healthy part must raise nothing; the slow part one ``straggler`` incident naming rank 2, kind
compute. The watchdog runs at its straggler defaults but for a 2 s window (20 windows in the healthy part).
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

# Out of `make test`, run by `make test-alone`: with other real-rank tests beside them on 2 cores
# (3 test files at once), the healthy part raised a false compute straggler (score 0.82 with 2 s
# windows) and the link test a straggler before the link was slowed. Straggler detection needs
# hardening against a loaded host before these can run in the shared suite (docs/stragglers.md).
pytestmark = [pytest.mark.multirank, pytest.mark.alone]

HEALTHY_S = 40.0
WINDOW_S = 2.0  # as in the worker
SLOW = 1.3
# Hang guard on the launch: 40 s healthy + the incident (about 3 windows, 6 s) + start-up took 56 s on
# the loaded 2-core machine; the worker's own bound on the slow part is 90 s.
LAUNCH_GUARD_S = 300.0
REPORT_GUARD_S = 46.0  # from the slowdown to the incident: 3x the 15.4 s of the most loaded run seen


@pytest.fixture(scope="module")
def job():
    return run_ranks("straggler_worker", 3, str(HEALTHY_S), "2", str(SLOW), timeout_s=LAUNCH_GUARD_S)


def incident_dirs(job):
    return sorted(p for p in (job.out_dir / "incidents").iterdir() if p.is_dir())


def test_the_healthy_part_raises_nothing_though_every_rank_assessed_its_windows(job) -> None:
    for r in range(3):
        # 20 windows of 2 s; the first needs a peer's window to compare with: >= 15 leaves start-up room.
        assert job[r]["healthy_assessed"] >= 15, job[r]
        assert job[r]["healthy_score"] is not None and job[r]["healthy_score"] > 1 / 1.15
    slow_from = job[2]["slow_from"]
    for where in incident_dirs(job):
        doc = json.loads((where / "incident.json").read_text())["incident"]
        assert doc["created"] > slow_from, f"an incident in the healthy part: {doc['reason']}"


def test_the_compute_straggler_is_named_with_its_evidence(job) -> None:
    (where,) = incident_dirs(job)
    merged = json.loads((where / "incident.json").read_text())
    doc = merged["incident"]
    report = doc["straggler"]
    assert (doc["kind"], doc["signature"], doc["by"], doc["ranks"]) == ("straggler", "straggler/compute/2", 2, [2])
    assert (report["rank"], report["cause"]) == (2, "compute")
    assert 1.15 <= report["slowdown"] <= 1.6  # 30% more work; the all_reduce's own time dilutes it
    assert report["where"].startswith("compute in phase 'train'")
    assert "its peers wait for it in all_reduce(MAX)" in report["where"]
    assert len(report["windows"]) == 2
    for w in report["windows"]:  # the physics: it computes more and waits less than its peers
        assert w["compute_frac"] > w["peers_compute_frac"] and w["wait_frac"] < w["peers_wait_frac"]
        assert w["end"] > job[2]["slow_from"]
    # How soon is a latency (the lockstep unit tests assert "within 3 windows"): 5.5 s to 9.6 s after the
    # slowdown (rank 2's clock) in three runs, 15.4 s at load ~150 on 2 cores (measured 1.17x). Guard: 3x that.
    assert doc["created"] - job[2]["slow_from"] <= REPORT_GUARD_S
    assert "rank 2 is a compute straggler" in (where / "summary.txt").read_text()


def test_each_rank_states_its_score_and_step(job) -> None:
    (where,) = incident_dirs(job)
    statements = {r: json.loads((where / f"rank{r}.json").read_text())["statement"] for r in range(3)}
    assert statements[2]["straggler_score"] <= 1 / 1.15
    assert min(statements[r]["straggler_score"] for r in (0, 1)) > 1 / 1.15
    stepped = [statements[r]["step"] for r in range(3)]
    assert all(isinstance(s, int) for s in stepped) and max(stepped) - min(stepped) <= 5
    assert all(statements[r]["window"]["n"] >= 20 for r in range(3))
    # Reported, never escalated though the ladder goes on to raise: report, then settled at once.
    assert [c["kind"] for c in job[2]["incidents"]] == ["straggler"]
    for r in range(3):
        assert [c["kind"] for c in job[r]["incidents"]] in ([], ["straggler"])
        for case in job[r]["incidents"]:
            assert [a["rung"] for a in case["actions"]] in (["report"], ["report", "resolved"])
    rank_dump = json.loads((where / "rank2.json").read_text())
    assert rank_dump["ladder"] == ["report", "raise"]
