"""A sensor of the user's, registered with one line, on real gloo ranks: its figures travel in the
heartbeats, its finding is an incident of kind ``sensor`` that stays a report, and a broken sensor
stops neither the watchdog nor the other sensors.

One launch (tests/workers/sensor_worker.py): torchrun, 2 ranks, sensors ``queue`` and ``broken``.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def job():
    return run_ranks("sensor_worker", 2, timeout_s=120)


def test_registered_sensors_are_built_after_the_straggler_one_and_a_name_is_taken_once(job):
    for r in (0, 1):
        assert job[r]["registered"] == ["straggler", "queue", "broken"]
        assert "a sensor named 'queue' is registered already" in job[r]["taken"]


def test_a_sensors_figures_reach_the_peers_heartbeats(job):
    assert job[0]["peer_readings"]["queue"]["depth"] >= 5  # rank 1's queue, read by rank 0
    assert job[1]["peer_readings"] == {"queue": {"depth": 0}}  # rank 0's; the broken sensor added nothing


def test_a_sensors_finding_is_one_incident_on_every_rank_and_never_climbs_past_report(job):
    for r in (0, 1):
        (incident,) = job[r]["incidents"]
        assert incident["kind"] == "sensor"
        assert incident["settled"] is True
        assert [a["rung"] for a in incident["actions"]] == ["report"]
        assert job[r]["reason"].startswith("rank 1's queue is ")


def test_a_broken_sensor_is_called_and_logged_and_the_watchdog_goes_on(job):
    for r in (0, 1):
        assert job[r]["broken_calls"] >= 5
        assert job[r]["queue_ticks"] >= 5
        assert job[r]["beats"] >= 5
    # Its first failure is logged with the traceback, once per rank; later ones are counted, not logged.
    assert job.output.count("the sensor 'broken' failed; going on without its figures this time") == 2
