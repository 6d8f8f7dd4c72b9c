"""A mixed text/image batch under DeepSpeed ZeRO-3: the hang without always_run_vision, none with it.

Real ranks (tests/workers/qwen_mixed_worker.py, torchrun, 2 gloo ranks, CPU), the tiny
Qwen2.5-VL classifier, ``deepspeed.initialize`` with ZeRO stage 3, watchdog action report.
At step 1 rank 1's batch has no image while rank 0's has two (hiyouga/LLaMA-Factory#5616,
QwenLM/Qwen3-VL#1832). The single-process exactness of the zero-cost pass is in
tests/integrations/test_qwen2_5_vl.py.

Launches (tests/workers/qwen_mixed_worker.py), each 2 ranks under torchrun, 3 training steps:
``fixed``: ``always_run_vision=True``: every rank runs the vision tower every step and all 3 steps finish,
    no incident; steps 0-1's losses match the stock model trained in one process.
``unfixed``: ``always_run_vision=False``: rank 1 skips the tower at step 1, its ZeRO-3 collectives stop
    matching rank 0's; the watchdog writes the incident before gloo's 6 s group timeout ends the step. A drill
    (`make drills`): two ranks at one sequence number in different collectives named a mismatch stays in the suite
    in tests/incidents/test_incident.py::test_ranks_that_disagree_at_the_same_number_are_a_mismatch, a rank away
    from a DeepSpeed step's collectives named within the hang bound in
    tests/watching/test_watching_stacks_multirank.py (its ``deepspeed`` stack), and this model under ZeRO-3 in
    ``fixed``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank
HANG_S = 1.5  # as in the worker
HEARTBEAT_S = 0.3
WORKER = "qwen_mixed_worker.py"


def mark(name: str) -> int:
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


def test_with_always_run_vision_a_mixed_batch_trains_on_under_zero3():
    job = run_ranks("qwen_mixed_worker", 2, "fixed", timeout_s=240)
    for r in (0, 1):
        res = job[r]
        assert res["error"] is None and res["steps_done"] == 3
        assert res["incidents"] == []  # no collective waited HANG_FIXED_S (4.5 s) on either rank
        # The tower ran once per step on both ranks, the text-only step included.
        assert res["tower_calls"] == [0, 1, 2]
        assert all(math.isfinite(x) for x in res["losses"])
        # Steps 0 and 1 against the stock model trained in one process (no dummy pass; mean
        # gradient of both ranks' batches): step 1's loss on rank 1 is the text-only batch's.
        reference = [step[r] for step in res["reference"][:2]]
        assert res["losses"][:2] == pytest.approx(reference, abs=1e-4)


# A drill (`make drills`): what stays in the suite is in the module doc (``unfixed``).
@pytest.mark.drill
def test_without_it_the_mixed_batch_desyncs_zero3_and_the_watchdog_reports_it_before_gloo_gives_up():
    job = run_ranks("qwen_mixed_worker", 2, "unfixed", timeout_s=240)
    # Rank 1 skipped the vision tower at step 1.
    assert job[0]["tower_calls"] == [0, 1] and job[1]["tower_calls"] == [0]
    for r in (0, 1):
        assert job[r]["steps_done"] == 1  # step 1 never finished
        assert job[r]["error"].startswith("RuntimeError: ")  # gloo's timeout, or its peer leaving
    # The incident of step 1 (on a loaded machine a slow collective of step 0 may be one too).
    (inc,) = [inc for inc in incidents(job) if any("step=1 " in (f.get("phase") or "") for f in inc["findings"])]
    # Rank 1 (no image) still all-gathers parameters at step 1 while rank 0 (two images) has gone
    # on into its gradient reduce-scatter. Both are in collectives at the same sequence number: a
    # mismatch, with two ranks no majority, so both are suspects; the phase says which batch had
    # no image. (On a slow machine rank 0 may not have reached its reduce-scatter when the hang
    # timeout fires: then it is reported behind, not in an op.)
    seen = ranks_in(inc)
    assert seen[1] == ("train step=1 images=0", "all_gather_into_tensor")
    assert seen[0][0] == "train step=1 images=2" and seen[0][1] in ("reduce_scatter_tensor(SUM)", None)
    if seen[0][1] is not None:
        assert inc["summary"].startswith("ranks disagree at reduce_scatter_tensor(SUM) #")
    for finding in inc["findings"]:
        assert finding["site"].endswith(f"{WORKER}:{mark('backward')}")
    # The report is on disk before gloo's own timeout ends the step.
    for r in (0, 1):
        assert job[r]["starts"][1] + HANG_S <= inc["written_at"] < job[r]["error_at"]


def incidents(job) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((job.out_dir / "incidents").glob("*/incident.json"))]


def ranks_in(inc: dict) -> dict[int, tuple[str, str | None]]:
    """Each named rank's (phase, collective it is in, or None) from a merged incident."""
    (finding,) = inc["findings"]
    if finding["kind"] == "mismatch":
        assert finding["suspects"] == [0, 1]
        return {v["ranks"][0]: (v["phase"], v["op"]) for v in finding["variants"]}
    assert finding["kind"] == "desync", finding["kind"]
    (waiting,) = finding["waiting"]
    (culprit,) = inc["culprits"]
    return {waiting: (finding["phase"], finding["op"]), culprit["rank"]: (culprit["phase"], None)}
