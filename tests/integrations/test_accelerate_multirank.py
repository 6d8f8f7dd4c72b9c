"""ncclguard in a hand-written Accelerate loop: 2 gloo ranks under torchrun, CPU, DDP.

tests/workers/accelerate_worker.py builds an ``Accelerator(cpu=True)`` with
``InitProcessGroupKwargs(timeout=60 s)``, starts the watchdog from it, trains a small MLP and
evaluates through ``ncclguard.integrations.accelerate.guarded_evaluate`` with
``accelerator.gather_for_metrics``: a clean evaluation, one stalled on rank 1, one over uneven
shards (``even_batches=False``), a clean one again; rank 0 is slow in its training loop once.
One launch; the tests read its results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.integrations.accelerate import guarded_evaluate, start_watchdog

HEARTBEAT_S, HANG_S, EVAL_TIMEOUT_S = 0.5, 8.0, 4.0  # as in the worker
STALL_S = 60.0  # as in the worker
# Hang guards (upper bounds on when): over 3x what loaded runs took, far below the 60 s stall.
SKIP_GUARD_S = 3 * (EVAL_TIMEOUT_S + 1)  # the skip: 4.01-4.08 s after the 4 s deadline under load (load ~10)
REPORT_GUARD_S = 3 * (HANG_S + 1)  # the report: 3x the hang timeout and its merge (8.2 s under load)
EVAL_SAMPLES = 9
WORKER = "accelerate_worker.py"


def mark(name: str) -> int:
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def job():
    return run_ranks("accelerate_worker", 2, timeout_s=180)  # hang guard: over 3x the 40 s of a loaded run


@pytest.mark.multirank
def test_a_clean_evaluation_counts_every_sample_once_with_even_batches(job):
    # 9 samples, batches of 4 per rank: Accelerate pads the last batch (even_batches=True) and
    # gather_for_metrics drops the padding, inside the guard's side group.
    for r in (0, 1):
        seen, _ = job[r]["outcomes"]["clean"]
        assert seen == EVAL_SAMPLES
        assert job[r]["outcomes"]["again"][0] == EVAL_SAMPLES
    assert job[0]["outcomes"] == job[1]["outcomes"]


@pytest.mark.multirank
def test_a_rank_stalled_before_gather_for_metrics_is_skipped_together_by_the_deadline(job):
    stalled_at = job[1]["stalls"][0]
    for r in (0, 1):
        res = job[r]
        assert res["outcomes"]["stall"] is None  # the fallback, on both ranks
        skip = res["skips"]["stall"]
        assert skip["step"] == 2
        assert EVAL_TIMEOUT_S <= skip["elapsed_s"] <= SKIP_GUARD_S
        assert "rank 1: DeadlineExceeded: the evaluation ran past its" in skip["reason"]
        # Rank 0 waited in gather_for_metrics: its own failure names the gloo timeout there.
        assert "rank 0: DeadlineExceeded" in skip["reason"] and "gloo" in skip["reason"]
        # Stall to skip, on each rank's clock (one machine): the deadline plus the agreement.
        assert 0 < res["ended"]["stall"] - stalled_at <= SKIP_GUARD_S < STALL_S
        # The interrupted loader was taken out of GradientState; training mode is back.
        assert res["loaders"] == {
            "before": ["NoneType", "DataLoaderShard"],
            "after": ["NoneType", "DataLoaderShard"],
            "training": True,
        }
    assert job[0]["stalls"] == []


@pytest.mark.multirank
def test_uneven_shards_without_even_batches_are_skipped_together(job):
    # even_batches=False: rank 0 gets 2 batches, rank 1 one; rank 0's second gather_for_metrics
    # has no partner. Rank 1 finished; rank 0 failed at the deadline: both skip.
    for r in (0, 1):
        assert job[r]["outcomes"]["uneven"] is None
        skip = job[r]["skips"]["uneven"]
        assert skip["step"] == 4 and EVAL_TIMEOUT_S <= skip["elapsed_s"] <= SKIP_GUARD_S
        assert skip["reason"].startswith("attempt 1: rank 0: DeadlineExceeded") and "rank 1" not in skip["reason"]


@pytest.mark.multirank
def test_skips_go_to_the_trackers_and_training_ends_with_equal_parameters(job):
    # Trackers log on the main process only.
    failed = [[{"eval/evaluation_failed": 1.0, "eval/attempts": 1.0}, step] for step in (2, 4)]
    assert job[0]["tracked"] == failed and job[1]["tracked"] == []
    assert job[0]["digest"] == job[1]["digest"]
    assert job[0]["wrapped"] == job[1]["wrapped"] == "DistributedDataParallel"
    for r in (0, 1):
        assert job[r]["watchdog_after_stop"] is False


@pytest.mark.multirank
def test_a_rank_slow_in_its_loop_is_named_while_the_other_waits_in_ddp(job):
    (path,) = sorted((job.out_dir / "incidents").glob("*/incident.json"))
    incident = json.loads(path.read_text())
    (culprit,) = incident["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["phase"]) == (0, "behind", "train step=1")
    assert culprit["site"].endswith(f"{WORKER}:{mark('slow-train')}")
    assert incident["victims"] == [1]
    (finding,) = incident["findings"]
    # At its second iteration DDP's reducer rebuilds its buckets and broadcasts their layout
    # (5 x int32 for this model), from C++: the backend's sequence number shows it.
    assert (finding["kind"], finding["op"], finding["numel"], finding["dtype"]) == (
        "desync",
        "gloo:broadcast",
        5,
        "int32",
    )
    assert finding["site"].startswith("C++ (") and finding["phase"] == "train step=1"
    assert job[0]["slow_started"] < incident["written_at"] < job[0]["slow_ended"]
    assert incident["written_at"] - job[0]["slow_started"] <= REPORT_GUARD_S
    assert len(job[0]["incidents"]) == len(job[1]["incidents"]) == 1


# --- argument checks, no ranks --------------------------------------------------------------------


def test_guarded_evaluate_and_start_watchdog_want_an_accelerator():
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator, got object"):
        guarded_evaluate(object(), lambda: 1, eval_timeout_s=1)
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator, got str"):
        start_watchdog("accelerator")


def test_an_interrupted_evaluation_leaves_its_dataloader_registered_until_restored():
    # Accelerate's own classes, in this process: a prepared-style DataLoaderShard registers in the
    # shared GradientState when its iteration starts and only leaves when the iteration ends.
    import gc

    import torch
    from accelerate.data_loader import DataLoaderShard
    from accelerate.state import GradientState
    from torch.utils.data import TensorDataset

    from ncclguard.integrations.accelerate import dataloaders_restored_on_skip

    state = GradientState()
    loader = DataLoaderShard(TensorDataset(torch.arange(8.0)), batch_size=2)
    before = list(state.dataloader_references)  # other tests in this process may have left some
    with dataloaders_restored_on_skip(state) as restore:
        batches = iter(loader)
        next(batches)  # the evaluation is cut short here (the deadline)
        del batches
        gc.collect()
        assert state.dataloader_references[-1] is loader and state.in_dataloader  # left behind
        restore()
    assert state.dataloader_references == before
