"""Issue 59's rule, kept by tests/harness.py on every launch: a run in which no fault fired ends with
no rebuild (world generation 0) and no lost snapshot take on every rank; a run with faults, up to
its first. Here the check itself, on results written by tests/workers/rankkit.py in this process
(no ranks launched): it fails on a rebuild or a lost take, passes a fault-free launch, and holds a
launch with a fault only to what came before the fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import rankkit
from harness import FAULTS_FILE, HEALTH_KEY, Job, _read_back, check_health, launch_faults

from ncclguard import world as world_module
from ncclguard.recovery.snapshots.agreement import TakeLosses, takes_lost
from ncclguard.world import World


def ran(results: dict[int, tuple[int, int]], faults: list[dict[str, Any]] | None = None, **job: Any) -> Job:
    """A finished launch whose ranks saved ``(generation, failed takes)``, every rank exiting 0."""
    return Job(
        results={r: {HEALTH_KEY: {"generation": g, "failed_takes": n, "faults": []}} for r, (g, n) in results.items()},
        returncodes={r: 0 for r in results},
        faults=faults or [],
        **job,
    )


def fault(rank: int, at: float, generation: int = 0, failed_takes: int = 0) -> dict[str, Any]:
    return {"rank": rank, "pid": 1, "what": "SIGKILL", "at": at, "generation": generation, "failed_takes": failed_takes}


def test_a_fault_free_launch_with_no_rebuild_and_no_lost_take_passes() -> None:
    job = ran({0: (0, 0), 1: (0, 0), 2: (0, 0)})
    check_health(job)
    assert job.health == "fault-free: 3 rank(s) checked"


def test_a_fault_free_launch_that_rebuilt_fails_naming_the_rank_and_its_numbers() -> None:
    with pytest.raises(AssertionError, match=r"fault-free launch rebuilt .*rank 1: generation 1, 0 failed take"):
        check_health(ran({0: (0, 0), 1: (1, 0)}))


def test_a_fault_free_launch_that_lost_a_take_fails() -> None:
    with pytest.raises(AssertionError, match=r"rank 0: generation 0, 1 failed take\(s\); rank 1: generation 0, 1"):
        check_health(ran({0: (0, 1), 1: (0, 1)}))


def test_a_launch_with_a_fault_is_held_only_to_what_came_before_its_first_fault() -> None:
    # The rebuild and the lost take came after rank 1's kill: that is the recovery, not a fault.
    job = ran({0: (1, 1), 2: (1, 1)}, faults=[fault(2, at=20.0, generation=1), fault(1, at=10.0)])
    check_health(job)
    assert job.health == "checked up to its first fault (rank 1: SIGKILL)"
    # Before the first fault the fault-free part had rebuilt: a real failure, or a fault not marked.
    with pytest.raises(AssertionError, match=r"before the launch's first fault \(rank 1: SIGKILL\) .* generation 1"):
        check_health(ran({0: (1, 0)}, faults=[fault(1, at=10.0, generation=1)]))


@pytest.mark.parametrize(
    "shown",
    [
        {"returncodes": {0: 0, 1: -9}},
        {"restarts": ["rank 1 exited -9; restart 1"]},
        {"lives": {0: [0], 1: [-9, 0]}},
        {"output": "ncclguard.supervise: the rank (pid 12) exited -9; restart 1 of 1\n"},
    ],
)
def test_a_launch_with_a_death_or_a_restart_is_not_held_to_the_rule_at_its_end(shown: dict[str, Any]) -> None:
    job = ran({0: (1, 0), 1: (1, 0)})
    for name, value in shown.items():
        setattr(job, name, value)
    assert launch_faults(job)
    check_health(job)  # no fault line to look before: nothing is checked
    assert job.health.startswith("not checked")


def test_a_fault_the_test_injects_from_outside_is_declared() -> None:
    job = ran({0: (1, 0), 1: (1, 0)})
    check_health(job, fault_free=False)
    assert job.health == "not checked: the test says it injects a fault (fault_free=False)"
    with pytest.raises(AssertionError, match="declared fault-free had faults: rank 1: SIGKILL"):
        check_health(ran({0: (0, 0)}, faults=[fault(1, at=1.0)]), fault_free=True)


@pytest.fixture
def rank_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """rankkit in this process as rank 1 of a launch writing to ``tmp_path``, its records fresh."""
    monkeypatch.setenv("NCCLGUARD_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(rankkit.RESTART_VAR, raising=False)
    monkeypatch.setattr(rankkit, "_results", {})
    monkeypatch.setattr(rankkit, "_fired", [])
    monkeypatch.setattr(TakeLosses, "in_process", 0)
    return tmp_path


def test_a_rank_records_its_generation_and_lost_takes_and_the_harness_reads_them(
    rank_side: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (HEALTH_KEY, FAULTS_FILE) == (rankkit.HEALTH_KEY, rankkit.FAULTS_FILE)  # the harness's own copies
    rankkit.save()
    job = Job(out_dir=rank_side, returncodes={1: 0})
    _read_back(job)
    assert job.results[1][HEALTH_KEY] == {"generation": 0, "failed_takes": 0, "faults": []}
    check_health(job)
    # The same rank in generation 1 with a take lost: the fault-free launch fails.
    monkeypatch.setattr(world_module._worlds, "current", World(generation=1))
    monkeypatch.setattr(TakeLosses, "in_process", 1)
    assert takes_lost() == 1
    rankkit.save()
    job = Job(out_dir=rank_side, returncodes={1: 0})
    _read_back(job)
    with pytest.raises(AssertionError, match="rank 1: generation 1, 1 failed take"):
        check_health(job)


def test_a_fault_fired_is_written_at_once_with_the_numbers_before_it(rank_side: Path) -> None:
    rankkit.stall(1, 0.0)  # the vocabulary's faults mark themselves; rank 0's stall is not this rank's
    rankkit.stall(0, 0.0)
    (line,) = (rank_side / rankkit.FAULTS_FILE).read_text().splitlines()
    assert json.loads(line) | {"at": 0} == {
        "rank": 1,
        "pid": json.loads(line)["pid"],
        "what": "stall 0.0 s",
        "at": 0,
        "generation": 0,
        "failed_takes": 0,
    }
    rankkit.save()
    job = Job(out_dir=rank_side, returncodes={1: 0})
    _read_back(job)
    assert job.results[1][HEALTH_KEY]["faults"] == ["stall 0.0 s"] and len(job.faults) == 1
    check_health(job)
    assert job.health == "checked up to its first fault (rank 1: stall 0.0 s)"


def test_a_restarted_process_marks_its_launch(rank_side: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rankkit.RESTART_VAR, "1")
    rankkit.save()
    job = Job(out_dir=rank_side, returncodes={1: 0})
    _read_back(job)
    assert [f["what"] for f in job.faults] == [f"a restarted process ({rankkit.RESTART_VAR}=1)"]
    assert "generation" not in job.faults[0]  # after its first life's end: not a fault-free part
    check_health(job)
    assert job.health.startswith("not checked")
