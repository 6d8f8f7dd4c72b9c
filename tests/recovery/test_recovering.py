"""RecoveringStep in a world of one: bad input, a clean step, a failed step redone. The multi-rank
cases on real gloo ranks (a stall, a rank stuck for good): tests/recovery/test_recovering_multirank.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ncclguard
from ncclguard import RecoveringStep
from ncclguard.errors import CommitFailed
from ncclguard.recording.ddp import record_ddp
from ncclguard.recording.flight import recorder
from ncclguard.recovery.records import StepResult


@pytest.fixture
def parts():
    assert not dist.is_initialized()
    recorder.clear()
    ncclguard.should_commit()  # earlier tests' problems are counted already
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
    return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def test_bad_input_is_refused(parts):
    module, opt = parts
    with pytest.raises(TypeError, match="torch.nn.Module"):
        RecoveringStep("model", opt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        RecoveringStep(module, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_attempts"):
        RecoveringStep(module, opt, max_attempts=0)
    with pytest.raises(TypeError, match="allow_shrink"):
        RecoveringStep(module, opt, allow_shrink=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RecoveringStep(module, opt, rebuild_timeout=0)
    with pytest.raises(TypeError, match="step_fn"):
        RecoveringStep(module, opt)(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collective_timeout must be a positive duration"):
        RecoveringStep(module, opt, collective_timeout=-1)
    with pytest.raises(ValueError, match="left_out must be 'exit' or 'raise'"):
        RecoveringStep(module, opt, left_out="stay")  # type: ignore[arg-type]
    # FSDP2: a rank left out would take its shards with it.
    with pytest.raises(ValueError, match="allow_shrink=True cannot go with FSDP2"):
        RecoveringStep(module, opt, wrap=ncclguard.FSDP2(), allow_shrink=True)
    with pytest.raises(TypeError, match="fully_shard"):
        ncclguard.FSDP2(shard="layers")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="initialized process group"):
        RecoveringStep(module, opt, wrap=ncclguard.FSDP2())
    with pytest.raises(TypeError, match="record_ddp needs a DistributedDataParallel model, got Sequential"):
        record_ddp(module)
    # Models the adapter cannot wrap again on a rebuilt world: refused with what to pass instead.
    with pytest.raises(ValueError, match="torch.compile'd module.*pass the module before torch.compile"):
        RecoveringStep(torch.compile(module), opt)


def test_a_deepspeed_engine_and_fsdp1_are_refused_with_the_adapter_to_use() -> None:
    from ncclguard.recovery.recovering import cannot_rewrap

    DeepSpeedEngine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    FullyShardedDataParallel = type("FullyShardedDataParallel", (torch.nn.Module,), {})
    assert "CommittedEngineStep" in cannot_rewrap(DeepSpeedEngine())
    assert "wrap=ncclguard.FSDP2" in cannot_rewrap(FullyShardedDataParallel())
    assert cannot_rewrap(torch.nn.Linear(2, 2)) is None


def test_a_failed_attempt_is_redone_from_the_same_state(parts):
    module, opt = parts
    x = torch.randn(5, 3, dtype=torch.float64)
    reference = [t.detach().clone() for t in module.state_dict().values()]
    calls = []

    def step_fn(model: torch.nn.Module) -> float:
        loss = model(x).pow(2).mean()  # moves BatchNorm's running stats
        loss.backward()
        calls.append(torch.rand(1).item())  # the RNG is put back before a redo
        if len(calls) == 1:
            raise RuntimeError("Connection closed by peer")
        return float(loss.detach())

    res = RecoveringStep(module, opt)(step_fn, step=0)
    assert isinstance(res, StepResult) and res.ok and bool(res)
    assert (res.attempts, res.rebuilds, res.error) == (2, 0, None)
    assert [c.ok for c in res.commits] == [False, True]
    assert res.commits[0].reasons == {0: ["the caller reported: RuntimeError: Connection closed by peer"]}
    assert calls[0] == calls[1]

    # The same step done once, cleanly, from the same start, ends in the same state bit for bit.
    torch.manual_seed(0)
    clean = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
    assert all(torch.equal(a, b) for a, b in zip(clean.state_dict().values(), reference, strict=True))
    clean_opt = torch.optim.SGD(clean.parameters(), lr=0.1, momentum=0.9)
    clean(x).pow(2).mean().backward()
    clean_opt.step()
    assert all(
        torch.equal(a, b) for a, b in zip(clean.state_dict().values(), module.state_dict().values(), strict=True)
    )


def test_a_step_that_keeps_failing_is_falsy_after_max_attempts(parts):
    module, opt = parts
    before = [p.detach().clone() for p in module.parameters()]

    def step_fn(model: torch.nn.Module) -> None:
        model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        raise ValueError("loss is nan")

    res = RecoveringStep(module, opt, max_attempts=2)(step_fn)
    assert not res and res.attempts == 2 and [c.ok for c in res.commits] == [False, False]
    with pytest.raises(CommitFailed, match="loss is nan"):
        res.raise_for_error()
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # never stepped


def test_a_step_state_puts_back_the_buffers_and_the_generators_as_they_were() -> None:
    from ncclguard.recovery._step.state import StepState

    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5)).train()
    kept = StepState.take(module)
    first = module(torch.randn(8, 4))  # moves BatchNorm's statistics and draws dropout's mask
    assert not torch.equal(module[1].running_mean, kept.buffers[0])
    kept.restore(module)
    assert all(torch.equal(b, k) for b, k in zip(module.buffers(), kept.buffers, strict=True))
    assert torch.equal(module(torch.randn(8, 4)), first)  # the same input draw and dropout mask: the same output
    assert kept.cuda_rng == ()  # no CUDA here: nothing taken, nothing put back
    import random

    import numpy

    drawn = (random.random(), numpy.random.rand())  # Python's and NumPy's generators are put back too
    kept.restore(module)
    assert (random.random(), numpy.random.rand()) == drawn
    with pytest.raises(ValueError):  # another module's buffers do not fit
        kept.restore(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.multirank
def test_a_step_the_frameworks_loop_runs_again_starts_without_the_failed_attempts_gradients() -> None:
    from harness import run_ranks

    job = run_ranks("engine_worker", 1, "reenter", launcher="spawn", timeout_s=120)
    res = job[0]
    assert res["grad_after_the_failed_attempt"] == [[1.0, 1.0]]
    assert res["raised"] == "Reenter: the framework's loop runs the next attempt"
    # Without this, the HF Trainer's redo after a heal summed the survivors' failed local backward
    # into its gradients: equal across ranks, not equal to a fault-free run (the failure drill).
    assert res["grads_when_the_loop_goes_on"] is True
    assert res["next_attempt"] == [True, 2, 1, [[1.0, 1.0]]]
    assert res["recovered"] == [[0, 2, 1]]


def test_a_scheduler_loaded_from_memory_puts_its_rate_back_into_the_optimizer() -> None:
    from ncclguard.recovery._step.state import load_scheduler

    module = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=5e-5)
    linear = lambda k: 1 - k / 60  # noqa: E731 - the HF Trainer's default schedule, 60 steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    for _ in range(43):
        opt.step()
        sched.step()
    saved, rate = sched.state_dict(), opt.param_groups[0]["lr"]
    assert rate == pytest.approx(5e-5 * (1 - 43 / 60))
    # A scheduler made anew (the HF Trainer's loop entered again) writes the schedule's first rate.
    again = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    assert opt.param_groups[0]["lr"] == 5e-5
    again.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 5e-5  # torch's load restores the counters only
    load_scheduler(again, saved)
    assert opt.param_groups[0]["lr"] == rate and again.last_epoch == 43


def test_a_loop_that_does_not_go_back_with_a_restore_is_told_the_line_to_write(parts):
    """After a restore sent every rank back to a snapshot's step (the engine's ``rewind_to``, set
    by the restore in tests/recovery/test_sharded_heal_multirank.py), a loop that passes another
    step ends at that step's commit, with the fix, and is not rebuilt or redone."""
    from ncclguard.errors import LoopDiverged

    module, opt = parts
    stepper = RecoveringStep(module, opt)
    runs: list[int] = []

    def step_fn(model: torch.nn.Module) -> None:
        runs.append(1)
        model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()

    assert stepper(step_fn, step=6)
    stepper.engine.rewind_to = 3  # every rank went back to step 3; a range() loop goes on to 7
    with pytest.raises(
        LoopDiverged,
        match=r"rank 0 the caller reported: LoopDiverged: this rank's loop passed step=7 after every rank went back to step 3",
    ) as caught:
        stepper(step_fn, step=7)
    assert "for step in stepper.steps(STOP):" in str(caught.value)
    assert (caught.value.failed_ranks, len(runs)) == ([0], 1)  # step 7 neither run nor redone
    assert stepper.engine.rewind_to is None and stepper.recoveries == []
    assert stepper(step_fn, step=8)  # a loop that goes on rightly is not held back
    # The loop that follows: steps() goes back, and passes the step it went back to.
    stepper.engine.rewind_to = 5
    assert list(zip(range(3), stepper.steps(20, start=9), strict=False)) == [(0, 9), (1, 5), (2, 6)]


def test_a_step_redone_after_its_scaler_unscaled_starts_clean_and_ends_as_one_clean_step() -> None:
    """fp16 with a GradScaler: the failed attempt called ``unscale_`` (before clipping); the redo
    calls it again, which a scaler refuses until ``update()`` unless the stepper cleared it."""
    assert not dist.is_initialized()

    def run(fail_first: bool, base: int) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        stepper = RecoveringStep(module, opt, scaler=scaler)
        x = torch.randn(4, 8)
        attempts = []

        def step_fn(model: torch.nn.Module) -> None:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            stepper.scaler.scale(loss).backward()
            stepper.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            attempts.append(1)
            if fail_first and len(attempts) == 1:
                raise RuntimeError("Connection closed by peer")

        for step in range(base, base + 3):  # the world's commits count on: each run's steps above the last
            res = stepper(step_fn, step=step)
            assert res and res.attempts == (2 if fail_first and step == base else 1)
        return [p.detach().clone() for p in module.parameters()], scaler.get_scale()

    redone, clean = run(fail_first=True, base=100), run(fail_first=False, base=200)
    assert redone[1] == clean[1]
    assert all(torch.equal(a, b) for a, b in zip(redone[0], clean[0], strict=True))
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        RecoveringStep(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), scaler=object())


def test_a_commit_whose_ranks_passed_different_steps_is_a_diverged_loop_on_every_rank() -> None:
    """The outcome is the same on every rank, so each reads the same LoopDiverged from it; a failure
    of any other kind is left to the rebuild."""
    from ncclguard.errors import LoopDiverged
    from ncclguard.recovery._step.guards import diverged
    from ncclguard.recovery.commit import CommitResult

    differ = CommitResult(False, 7, 1, [2], {2: ["passed step=2, where ranks 0-1 passed step=6"]})
    got = diverged(differ)
    assert isinstance(got, LoopDiverged) and got.failed_ranks == [2]
    assert "rank 2 passed step=2, where ranks 0-1 passed step=6" in str(got) and "stepper.steps(STOP)" in str(got)
    assert (
        diverged(CommitResult(False, 7, 1, [1], {1: ["did not reach should_commit for commit 7 within 5 s"]})) is None
    )
    assert diverged(CommitResult(True, 7, 1)) is None
