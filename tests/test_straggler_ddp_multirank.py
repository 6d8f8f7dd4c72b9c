"""Straggler detection in a loop that only calls DDP (tests/workers/straggler_ddp_worker.py), one launch
of 3 gloo ranks: DDP's bucket all_reduce is issued from C++, so ncclguard's records hold no collective
in the loop, and the windows take each rank's compute and wait from torch's flight recorder (the time
each rank reached each op). 40 s healthy (a step of a 40 ms sleep, about 10 ms of matmuls, and a small
model's forward and backward), then rank 2 does 30% more of the sleep and the matmuls. The healthy
part must raise nothing; the slow part one ``straggler`` incident naming rank 2, cause compute, from
the backend. The watchdog runs at its straggler defaults but for a 4 s window, as in
tests/test_straggler_multirank.py.
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

HEALTHY_S = 40.0
WINDOW_S = 4.0
SLOW = 1.3
# Hang guard on the launch: 40 s healthy + the incident (2 to 3 windows, 12 s) + start-up and the
# stop took 63 s to 70 s of launch on the 2-core machine, beside a busy loop too (docs/stragglers.md);
# the worker's own bound on the slow part is 90 s.
LAUNCH_GUARD_S = 300.0
REPORT_GUARD_S = 40.0  # from the slowdown to the incident (a hang guard): 3x the 13 s of 3 windows


@pytest.fixture(scope="module")
def job():
    return run_ranks("straggler_ddp_worker", 3, str(HEALTHY_S), "2", str(SLOW), str(WINDOW_S), timeout_s=LAUNCH_GUARD_S)


def incident_dirs(job):
    return sorted(p for p in (job.out_dir / "incidents").iterdir() if p.is_dir())


def test_the_loop_makes_no_python_collective_and_the_windows_carry_the_backends_arrivals(job) -> None:
    for r in range(3):
        assert job[r]["python_ops"] == 0  # nothing for ncclguard's records: DDP issues from C++
        # Whole windows of the loop (not the first, partial one, nor one closed as the loop stopped).
        full = [w for w in job[r]["windows"] if w["length_s"] >= WINDOW_S - 1e-6 and w["end"] <= job[r]["end"] - 2]
        assert len(full) >= 9, job[r]["windows"]
        for w in full:
            assert w["ops"] == 0 and len(w["arrivals"]) == 32 and w["backend_op"] == "gloo:all_reduce"
            assert all(w["end"] - WINDOW_S <= t < w["end"] for _, t in w["arrivals"])  # on time.time()'s clock


def test_the_healthy_part_raises_nothing_though_every_rank_assessed_its_windows(job) -> None:
    for r in range(3):
        # 10 windows of 4 s; the first needs a peer's window to compare with: >= 7 leaves start-up room.
        assert job[r]["healthy_assessed"] >= 7, job[r]
        assert job[r]["healthy_score"] is not None and job[r]["healthy_score"] > 1 / 1.15
    slow_from = job[2]["slow_from"]
    for where in incident_dirs(job):
        doc = json.loads((where / "incident.json").read_text())["incident"]
        assert doc["created"] > slow_from, f"an incident in the healthy part: {doc['reason']}"


def reasons(job) -> list[str]:
    return [json.loads((p / "incident.json").read_text())["incident"]["reason"] for p in incident_dirs(job)]


def test_the_compute_straggler_is_named_from_torchs_flight_recorder(job) -> None:
    assert len(incident_dirs(job)) == 1, reasons(job)
    (where,) = incident_dirs(job)
    doc = json.loads((where / "incident.json").read_text())["incident"]
    report = doc["straggler"]
    assert (doc["kind"], doc["signature"], doc["by"], doc["ranks"]) == ("straggler", "straggler/compute/2", 2, [2])
    assert (report["rank"], report["cause"]) == (2, "compute")
    # 30% more of 50 ms; the transfer and DDP's own step count as everyone's compute: toward 1.
    assert 1.15 <= report["slowdown"] <= 1.6
    assert report["where"].startswith("compute in phase 'train'")
    assert "its peers wait for it in gloo:all_reduce" in report["where"]
    assert "torch's flight recorder" in report["where"]
    assert len(report["windows"]) == 2
    for w in report["windows"]:
        assert (w["source"], w["op"], w["common_ops"]) == ("backend", "gloo:all_reduce", w["common_ops"])
        assert w["common_ops"] >= 4
        assert w["work_frac"] > w["peers_work_frac"] and w["wait_frac"] < w["peers_wait_frac"]
        assert w["end"] > job[2]["slow_from"]
    assert doc["created"] - job[2]["slow_from"] <= REPORT_GUARD_S
    assert "rank 2 is a compute straggler" in (where / "summary.txt").read_text()
    # Reported, never escalated though the ladder goes on to raise.
    assert [c["kind"] for c in job[2]["incidents"]] == ["straggler"]
    for r in range(3):
        for case in job[r]["incidents"]:
            assert [a["rung"] for a in case["actions"]] in (["report"], ["report", "resolved"])
