"""guard_trainer on a real ``transformers.Trainer``: 2 gloo ranks under torchrun, CPU, DDP and DeepSpeed ZeRO-2.

tests/workers/hf_worker.py trains a tiny BERT classifier (from a config) for 6 steps, evaluating
every 2 steps, saving at step 4, with ``guard_trainer(eval_timeout_s=4, watchdog=...)``. In one
launch per framework: rank 1's first evaluation stalls (skipped on both ranks by the deadline),
then rank 0 is slow after the save of step 4 (named by the watchdog while rank 1 waits in the
framework's gradient reduction). The pure parts run in this process: bad input, the timeout
order, and a real Trainer on one process (phases, watchdog, a skip with ``metric_for_best_model``).

Launches (tests/workers/hf_worker.py), each 2 ranks under torchrun, the story above:
``ddp``: ``TrainingArguments(use_cpu=True, ddp_backend="gloo")``; rank 1 waits in DDP's C++ all_reduce.
``deepspeed``: ``TrainingArguments(deepspeed=<ZeRO-2 dict>)``; rank 1 waits in ZeRO-2's gradient reduction. A drill
    (`make drills`): the same callback's story stays in the suite in ``ddp``; an evaluation skipped on every rank by the
    deadline on DeepSpeed engines (ZeRO 0 and 2) in tests/integrations/test_deepspeed_eval_multirank.py; a wait in
    ZeRO-2's gradient reduction named in tests/watching/test_watching_stacks_multirank.py (its ``deepspeed`` stack).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from harness import run_ranks
from tiny_trainer import tiny_trainer

import ncclguard
from ncclguard.integrations.hf import TrainerGuardCallback, find_guard, guard_trainer, timeout_warnings
from ncclguard.recording.phase import current_phase

# The DeepSpeed launch's guard (420 s, below) is over pytest-timeout's 300 s default.
pytestmark = pytest.mark.timeout(500)
HANG_S, HEARTBEAT_S, EVAL_TIMEOUT_S, STALL_S = 8.0, 0.5, 4.0, 60.0  # as in the worker
GRACE_S = 2.0  # the guard's default verdict grace: max(2, timeout / 20)
# Hang guards (upper bounds on when): over 3x what loaded runs took, far below the 60 s stall.
SKIP_GUARD_S = 3 * (EVAL_TIMEOUT_S + GRACE_S)  # the skip: 4.02-4.03 s after the 4 s deadline under load
REPORT_GUARD_S = 3 * (HANG_S + 1)  # the report: 3x the hang timeout and its merge (8.2-8.3 s under load)
WORKER = "hf_worker.py"
FRAMEWORKS = ["ddp", pytest.param("deepspeed", marks=pytest.mark.drill)]  # deepspeed: a drill (the module doc)


def mark(name: str) -> int:
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def ddp():
    return run_ranks("hf_worker", 2, "ddp", timeout_s=200)  # hang guard: over 3x the 60 s of a loaded run


@pytest.fixture(scope="module")
def deepspeed():
    # Room for a JIT rebuild of DeepSpeed's shared-memory op besides the run (44 s without one):
    # here the launch rebuilt it twice (3.3 and 4.2 min at load average 8), past the old 180 s.
    return run_ranks("hf_worker", 2, "deepspeed", timeout_s=420)


def incidents(job) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((job.out_dir / "incidents").glob("*/incident.json"))]


@pytest.mark.multirank
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_stalled_evaluation_is_skipped_on_every_rank_by_the_deadline(framework, request):
    job = request.getfixturevalue(framework)
    stalled_at = job[1]["stalls"][0]
    for r in (0, 1):
        res = job[r]
        (skip,) = res["skipped"]
        assert skip["step"] == 2
        assert EVAL_TIMEOUT_S <= skip["elapsed_s"] <= SKIP_GUARD_S
        assert "rank 1: DeadlineExceeded: the evaluation ran past its" in skip["reason"]
        # Rank 0 was waiting for rank 1 in the next batch's gather_for_metrics, on the side group.
        assert "rank 0: DeadlineExceeded" in skip["reason"] and "Timed out waiting" in skip["reason"]
        # From the stall to the skip logged on this rank: the deadline, not the 60 s stall.
        (logged,) = res["skip_logged"]
        assert 0 < logged - stalled_at <= SKIP_GUARD_S
        evals = [e for e in res["log_history"] if any(k.startswith("eval_") for k in e)]
        assert [(e["step"], "eval_evaluation_failed" in e, "eval_loss" in e) for e in evals] == [
            (2, True, False),
            (4, False, True),
            (6, False, True),
        ]
        assert evals[0]["eval_evaluation_failed"] == 1.0 and evals[0]["eval_attempts"] == 1.0
    assert job[0]["log_history"] == job[1]["log_history"] or _same_but_timing(job)


def _same_but_timing(job) -> bool:
    """log_history agrees across ranks except for runtimes and throughputs."""

    def strip(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k} for e in history]

    return strip(job[0]["log_history"]) == strip(job[1]["log_history"])


@pytest.mark.multirank
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_after_the_skip_training_reaches_max_steps_with_equal_parameters(framework, request):
    job = request.getfixturevalue(framework)
    assert job[0]["wrapped"] == {"ddp": "DistributedDataParallel", "deepspeed": "DeepSpeedEngine"}[framework]
    for r in (0, 1):
        res = job[r]
        assert res["global_step"] == 6
        # The interrupted evaluation's dataloader was taken off Accelerate's GradientState again:
        # at every step only the training dataloader is registered.
        assert res["loaders"] == [["NoneType", "DataLoaderShard"]] * 6
        assert res["watchdog_running"] == [True] * 6 and res["watchdog_after_train"] is False
    assert job[0]["digest"] == job[1]["digest"]


@pytest.mark.multirank
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_rank_slow_after_a_save_is_named_by_the_watchdog_before_it_comes_back(framework, request):
    job = request.getfixturevalue(framework)
    (inc,) = incidents(job)  # nothing else: the skipped evaluation raised no incident
    (culprit,) = inc["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["phase"]) == (0, "behind", "train step=4 > save step=4")
    assert culprit["site"].endswith(f"{WORKER}:{mark('upload')}")
    assert inc["victims"] == [1]
    (finding,) = inc["findings"]
    assert (finding["kind"], finding["waiting"], finding["phase"]) == ("desync", [1], "train step=4")
    if framework == "ddp":
        # The Trainer builds DDP with find_unused_parameters=True for a PreTrainedModel without
        # activation checkpointing, so the reducer first all-reduces its map of used parameters
        # (one int32 per parameter tensor), from C++: seen through the backend's numbers.
        assert (inc["incident"]["kind"], finding["op"], finding["backend"]) == ("desync", "gloo:all_reduce", True)
        assert (finding["numel"], finding["dtype"]) == (job[0]["n_tensors"], "int32")
        assert finding["site"].startswith("C++ (not a torch.distributed Python call")
    else:
        # ZeRO-2 reduces the whole gradient (one bucket: every parameter) through torch.distributed
        # in Python: recorded with its call site.
        assert (inc["incident"]["kind"], finding["op"], finding["backend"]) == ("hang", "all_reduce(SUM)", False)
        assert (finding["numel"], finding["dtype"]) == (job[0]["n_params"], "float32")
    started, back = job[0]["upload"]
    # Rank 1 trains on once the upload has begun (the worker waits for it): from there, the hang
    # timeout, then the report (how soon is a latency: a hang guard here), before rank 0 came back.
    assert HANG_S <= inc["written_at"] - started <= REPORT_GUARD_S
    assert inc["written_at"] < back
    for r in (0, 1):
        assert [i["id"] for i in job[r]["incidents"]] == [inc["incident"]["id"]]


@pytest.mark.multirank
def test_every_rank_is_labelled_with_its_phase(ddp):
    for r in (0, 1):
        phases = ddp[r]["phases"]
        # Seen from the model's forward in training: the step of every training forward.
        assert phases["train_forward"] == [f"train step={s}" for s in range(6)]
        assert "train step=4 > eval step=4" in phases["eval"]
        assert phases["save"] == ["train step=4 > save step=4", "train step=6 > save step=6"]
        assert "train step=1 > log" in phases["log"]
        assert "train step=2 > eval step=2 > log" in phases["log"]  # the skip, logged through trainer.log


# --- in this process ---------------------------------------------------------------------------------


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(TypeError, match="must be a transformers.Trainer"):
        guard_trainer(object())
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(ValueError):
        guard_trainer(trainer, eval_timeout_s=0)
    with pytest.raises(TypeError):
        guard_trainer(trainer, eval_timeout_s="soon")
    with pytest.raises(ValueError, match="retries needs eval_timeout_s"):
        guard_trainer(trainer, retries=1)
    with pytest.raises(TypeError, match="watchdog must be a WatchdogConfig"):
        guard_trainer(trainer, watchdog="on")
    assert find_guard(trainer) is None and "evaluate" not in vars(trainer)  # nothing half-done
    guard_trainer(trainer, eval_timeout_s=5)
    with pytest.raises(ValueError, match="guarded already"):
        guard_trainer(trainer, eval_timeout_s=5)


def test_timeout_warnings_name_what_is_not_below_ddp_timeout(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), ddp_timeout=600, use_cpu=True, report_to=[])
    assert timeout_warnings(args, eval_timeout_s=300, hang_timeout_s=120) == []
    assert timeout_warnings(args) == []
    (eval_problem,) = timeout_warnings(args, eval_timeout_s=600)
    assert eval_problem.startswith("evaluation deadline (600 s) is not below the process-group timeout (600 s)")
    assert eval_problem.endswith("(TrainingArguments.ddp_timeout=600)")
    (hang_problem,) = timeout_warnings(args, hang_timeout_s=900)
    assert hang_problem.startswith("watchdog hang timeout (900 s) is not below the process-group timeout (600 s)")
    with pytest.raises(TypeError, match="ddp_timeout"):
        timeout_warnings(object())


def test_alone_phases_and_the_watchdog_run_from_train_begin_to_end(tmp_path, caplog):
    seen: list[tuple[str, str, bool]] = []

    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kw):
            seen.append(("eval", current_phase(), ncclguard.current_watchdog() is not None))

        def on_save(self, args, state, control, **kw):
            seen.append(("save", current_phase(), ncclguard.current_watchdog() is not None))

    trainer = tiny_trainer(tmp_path, [Probe()], ddp_timeout=60)
    guard_trainer(trainer, eval_timeout_s=30, watchdog={"heartbeat_s": 0.2, "hang_timeout_s": 90})
    with caplog.at_level("WARNING", logger="ncclguard"):
        trainer.train()
    assert ("eval", "train step=2 > eval step=2", True) in seen
    assert ("save", "train step=4 > save step=4", True) in seen
    # The hang timeout (90 s) is not below ddp_timeout (60 s): said when training begins.
    assert any("watchdog hang timeout (90 s)" in r.getMessage() for r in caplog.records)
    guard = find_guard(trainer)
    assert isinstance(guard, TrainerGuardCallback) and guard.watchdog is None
    assert ncclguard.current_watchdog() is None and current_phase() == ""
    assert guard.last_eval_report.ok and guard.skipped == []
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2, 4]


def test_alone_a_stalled_evaluation_is_skipped_and_is_never_a_new_best(tmp_path):
    from transformers import TrainerCallback

    class Stall(TrainerCallback):
        def on_prediction_step(self, args, state, control, **kw):
            if state.global_step == 2:
                time.sleep(STALL_S)

    trainer = tiny_trainer(tmp_path, [Stall()], metric_for_best_model="loss", load_best_model_at_end=True, save_steps=2)
    # The deadline must also pass the evaluation at step 4 (two batches of a tiny BERT, tens of ms):
    # at 0.5 s a fresh-clone run at load 80 skipped that one too.
    guard_trainer(trainer, eval_timeout_s=3.0, watchdog=False)
    start = time.monotonic()
    trainer.train()
    assert time.monotonic() - start < STALL_S / 2
    (skip,) = find_guard(trainer).skipped
    assert skip.step == 2 and 3.0 <= skip.elapsed_s < 12.0  # hang guard (3x a loaded run's), below the stall
    assert "ran past its 3 s deadline" in skip.reason
    failed = [e for e in trainer.state.log_history if "eval_evaluation_failed" in e]
    assert [(e["step"], e["eval_evaluation_failed"]) for e in failed] == [(2, 1.0)]
    assert all("eval_loss" not in e for e in failed)  # the worst value is returned, never logged
    # The evaluation at step 4 went through; the skipped one did not become the best.
    assert trainer.state.best_global_step == 4 and trainer.state.best_metric < float("inf")
    assert trainer.state.global_step == 4


def test_the_callback_alone_labels_training_steps_and_uses_a_running_watchdog(tmp_path):
    seen: list[tuple[str, object]] = []
    trainer = tiny_trainer(tmp_path, eval_strategy="no", save_strategy="no", max_steps=2)
    trainer.model.register_forward_pre_hook(
        lambda module, args: seen.append((current_phase(), ncclguard.current_watchdog()))
    )
    mine = ncclguard.start_watchdog(heartbeat_s=0.2, hang_timeout_s=5)
    try:
        callback = TrainerGuardCallback()
        trainer.add_callback(callback)
        trainer.train()
        assert [p for p, _ in seen] == ["train step=0", "train step=1"]
        assert {id(w) for _, w in seen} == {id(mine)}  # used, not replaced
        assert callback.watchdog is None and ncclguard.current_watchdog() is mine  # left running
        assert "evaluate" not in vars(trainer)  # the callback alone wraps nothing
        assert current_phase() == ""
    finally:
        mine.stop()
