"""A numerical finding told to the watchdog (recovery/_numerics/told.py): the incident's report built
from the commit's outcome, cut to its bounds (pure); nothing without a watchdog; and, in a gloo world
of one in this process with a watchdog running, a finding under ``on_nonfinite="raise"`` reported
before the raise returns. The launches on real ranks: tests/recovery/test_numerics_multirank.py,
tests/recovery/test_replicas_multirank.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from ncclguard import start_watchdog
from ncclguard.errors import NonFiniteGradient
from ncclguard.incidents.files import INCIDENT_FILE, SUMMARY_FILE
from ncclguard.recording.phase import phase
from ncclguard.recovery._numerics.drift import ReplicaDrift
from ncclguard.recovery._numerics.findings import bucket_finding
from ncclguard.recovery._numerics.told import drift_report, nonfinite_report, tell
from ncclguard.recovery.recovering import RecoveringStep
from ncclguard.watching.watchdog import current_watchdog


def test_the_report_names_the_ranks_their_buckets_and_the_finite_ranks_within_its_bounds() -> None:
    flagged = {r: [bucket_finding(0, "NaN", ["w"]), bucket_finding(3, "Inf", [])] for r in (9, 2, *range(10, 18))}
    with phase("train", epoch=1):
        report = nonfinite_report(7, 2, flagged, [0, 1, *range(3, 9)], "skip", suspects=[9], commit=12)
    assert (report.step, report.attempt, report.commit) == (7, 2, 12)
    assert (report.phase, report.action) == ("train epoch=1", "skip")
    assert (report.ranks, report.finite, report.suspects) == ("2,9-17", "0-1,3-8", [9])
    assert [n.rank for n in report.named] == [2, 9, 10, 11, 12, 13, 14, 15]  # the first 8, in order
    assert [b.model_dump() for b in report.named[0].buckets] == [
        {"index": 0, "kind": "NaN", "params": ["w"], "more_params": 0},
        {"index": 3, "kind": "Inf", "params": [], "more_params": 0},
    ]
    drift = ReplicaDrift(ranks=[2], majority=[0, 1], parts={"parameters": [2], "optimizer": [2]})
    healed = drift_report(8, 1, drift, "healed", source=0)
    assert (healed.ranks, healed.named, healed.majority, healed.source, healed.outcome, healed.phase) == (
        "2",
        [2],
        "0-1",
        0,
        "healed",
        "",
    )
    assert healed.parts == {"parameters": "2", "optimizer": "2"}


def test_without_a_watchdog_nothing_is_told() -> None:
    assert current_watchdog() is None
    tell(nonfinite_report(1, 1, {0: [bucket_finding(0, "NaN", ["w"])]}, [], "raise"), "test", wait=True)


@pytest.fixture
def watched_world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    wd = start_watchdog(heartbeat_s=0.2, hang_timeout_s=60, incident_dir=tmp_path, incident_plot=False)
    try:
        yield wd
    finally:
        wd.stop(finished=False)
        dist.destroy_process_group()


def test_a_raise_is_reported_before_it_returns(watched_world_of_one) -> None:
    wd = watched_world_of_one
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    stepper = RecoveringStep(
        module, torch.optim.SGD(module.parameters(), lr=0.1), collective_timeout=30, on_nonfinite="raise"
    )

    def step_fn(model: torch.nn.Module) -> None:
        (model(torch.ones(3, 4)).sum() * float("nan")).backward()

    with pytest.raises(NonFiniteGradient), phase("train"):
        stepper(step_fn, step=4)
    (case,) = wd.incidents  # no store in this world: the rank's own incident, merged by itself
    where = case["dir"]
    with open(f"{where}/{INCIDENT_FILE}") as f:  # written before the raise returned
        merged = json.load(f)
    words = (
        "step 4 (phase train): rank 0's gradient held NaN in bucket 0 (0.weight, 0.bias, 2.weight, 2.bias); no "
        "other rank's gradient was checked; the step was not applied: NonFiniteGradient raised on every rank"
    )
    assert (case["kind"], merged["summary"], merged["incident"]["reason"]) == ("numerics", words, words)
    with open(f"{where}/{SUMMARY_FILE}") as f:
        assert "  rank 0: NaN in bucket 0 (0.weight, 0.bias, 2.weight, 2.bias)\n" in f.read()
