"""Straggler detection on real gloo ranks (tests/workers/straggler_worker.py), one launch of 3 ranks:
48 s of a healthy, noisy run (3 ranks on a loaded 2-core machine, a step of a 40 ms sleep and 10 ms of
matmuls), then rank 2 does 30% more of both per step. The healthy part must raise nothing; the slow part
one ``straggler`` incident naming rank 2, kind compute. The watchdog runs at its straggler defaults but
for a 4 s window (12 windows in the healthy part).
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

HEALTHY_S = 48.0
WINDOW_S = 4.0
SLOW = 1.3
# Hang guard on the launch: 48 s healthy + the incident (2 to 3 windows, 12 s) + start-up took 74 s
# beside two busy loops on the 2-core machine; the worker's own bound on the slow part is 90 s.
LAUNCH_GUARD_S = 300.0
REPORT_GUARD_S = 40.0  # from the slowdown to the incident (a hang guard): 3x the 13 s of 3 windows


@pytest.fixture(scope="module")
def job():
    args = (str(HEALTHY_S), "2", str(SLOW), "1", "mixed", str(WINDOW_S))
    return run_ranks("straggler_worker", 3, *args, timeout_s=LAUNCH_GUARD_S)


def incident_dirs(job):
    return sorted(p for p in (job.out_dir / "incidents").iterdir() if p.is_dir())


def test_the_healthy_part_raises_nothing_though_every_rank_assessed_its_windows(job) -> None:
    for r in range(3):
        # 12 windows of 4 s; the first needs a peer's window to compare with: >= 9 leaves start-up room.
        assert job[r]["healthy_assessed"] >= 9, job[r]
        assert job[r]["healthy_score"] is not None and job[r]["healthy_score"] > 1 / 1.15
        # Linux tells each window's run delay (the time the rank waited for a CPU): the rule uses it.
        assert job[r]["windows"] and all(w["run_delay_s"] is not None for w in job[r]["windows"])
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
        assert w["work_frac"] > w["peers_work_frac"] and w["wait_frac"] < w["peers_wait_frac"]
        assert w["slowdown"] == pytest.approx(w["work_frac"] / w["peers_work_frac"], abs=2e-3)
        assert w["end"] > job[2]["slow_from"]
    # How soon is a latency (the lockstep unit tests assert "within 3 windows"); a hang guard here.
    assert doc["created"] - job[2]["slow_from"] <= REPORT_GUARD_S
    assert "rank 2 is a compute straggler" in (where / "summary.txt").read_text()


def test_each_rank_states_its_score_and_step(job) -> None:
    (where,) = incident_dirs(job)
    statements = {r: json.loads((where / f"rank{r}.json").read_text())["statement"] for r in range(3)}
    assert statements[2]["straggler_score"] <= 1 / 1.15
    assert min(statements[r]["straggler_score"] for r in (0, 1)) > 1 / 1.15
    stepped = [statements[r]["step"] for r in range(3)]
    assert all(isinstance(s, int) for s in stepped) and max(stepped) - min(stepped) <= 5
    assert all(statements[r]["window"] is not None and len(job[r]["windows"]) >= 12 for r in range(3))
    # Reported, never escalated though the ladder goes on to raise: report, then settled at once.
    assert [c["kind"] for c in job[2]["incidents"]] == ["straggler"]
    for r in range(3):
        assert [c["kind"] for c in job[r]["incidents"]] in ([], ["straggler"])
        for case in job[r]["incidents"]:
            assert [a["rung"] for a in case["actions"]] in (["report"], ["report", "resolved"])
    rank_dump = json.loads((where / "rank2.json").read_text())
    assert rank_dump["ladder"] == ["report", "raise"]
