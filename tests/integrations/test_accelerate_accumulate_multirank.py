"""``recovering_step`` with ``Accelerator(gradient_accumulation_steps=3)``: 3 gloo ranks under torchrun,
CPU, DDP, one launch (rank side: tests/workers/accelerate_accumulate_worker.py). A window of
micro-batches is one transaction: a stall in a window's first micro-batch (under ``no_sync``) and an
exception in another's second are redone, the whole window each time, bit-equal to Accelerate's own
loop. The same launch shows what Accelerate does with its FSDP plugin on the CPU (DDP) and that
``recovering_step`` refuses it. The argument checks and the accumulation's semantics run in this process.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

ACC, WINDOWS = 3, 6


@pytest.fixture
def fresh_accelerate():
    """Accelerate's state is one per process (``AcceleratorState``, ``GradientState``: shared dicts), and
    an Accelerator made earlier in this process (another test file's Trainer, in the same pytest worker)
    keeps its accumulation settings: ``GradientState`` reads its plugin only once. Reset before and after."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def job():
    # Two loops of 6 windows, a 9 s stall, a 3 s bound twice: 40 s here alone. Hang guard: over 3x that.
    return run_ranks("accelerate_accumulate_worker", 3, timeout_s=240)


@pytest.mark.multirank
def test_a_failed_window_is_redone_whole_and_the_loop_ends_bit_equal_to_accelerates_own(job):
    windows = [[w, m] for w in range(WINDOWS) for m in range(ACC)]
    for r in range(3):
        res = job[r]
        # One result per micro-batch: pending on the first two of a window, the verdict on the third.
        results = res["results"]
        assert [x[0] for x in results] == list(range(WINDOWS * ACC))
        assert [x[1:3] for x in results] == [[True, m != ACC - 1] for _, m in windows]
        assert [x[3:] for x in results if not x[2]] == [[1, 0], [1, 0], [2, 1], [1, 1], [2, 2], [1, 2]]
        assert res["recoveries"] == [[2 * ACC, 2, 1, 3], [4 * ACC, 2, 2, 3]]  # named by the window's first
        seen = res["seen"]
        assert seen[: 2 * ACC + 1] == [[w, m, 0] for w, m in windows[: 2 * ACC + 1]]
        redo = seen.index([2, 0, 1])
        # What else of window 2 ran on the first try depends on where each rank's collectives failed.
        assert seen[2 * ACC + 1 : redo] in ([], [[2, 1, 0]], [[2, 1, 0], [2, 2, 0]])
        # Rank 1 raised in window 4's second micro-batch: its third never ran before the redo.
        first_try_4 = [[4, 0, 1], [4, 1, 1]] + ([] if r == 1 else [[4, 2, 1]])
        assert seen[redo:] == (
            [[w, m, 1] for w in (2, 3) for m in range(ACC)]
            + first_try_4
            + [[w, m, 2] for w in (4, 5) for m in range(ACC)]
        )
        assert res["lr"][0] == res["lr"][1]  # the prepared scheduler stepped once per window, as in the reference
        assert res["params_equal_to_reference"] is True  # bit for bit
        assert res["buffers_equal_to_reference"] is True  # BatchNorm's, DDP's forward broadcasts included
        assert res["adam_equal_to_reference"] is True
        assert res["equal_across_ranks"] is True
        assert res["final"] == [r, 3, 2]


@pytest.mark.multirank
def test_accelerate_drops_its_fsdp_plugin_on_the_cpu_and_recovering_step_refuses_it(job):
    for r in range(3):
        seen = job[r]["fsdp_plugin"]
        # accelerate/state.py sets DistributedType.FSDP only for GPU-like devices: on the CPU the
        # plugin's variable is set and the model is wrapped in DDP all the same.
        assert (seen["distributed_type"], seen["model"], seen["use_fsdp_variable"]) == (
            "MULTI_CPU",
            "DistributedDataParallel",
            "true",
        )
        assert seen["refused"].startswith("recovering_step cannot recover Accelerate's FSDP plugin: ")
        assert "on MULTI_CPU it dropped it and wraps the model in DDP" in seen["refused"]
        assert "wrap=ncclguard.FSDP2(shard), heal=True" in seen["refused"]


# --- in this process (a world of one, no process group) ----------------------------------------------


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    module = torch.nn.Linear(2, 1).double()
    return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(6)]


def test_with_accumulation_the_optimizer_steps_once_per_window_as_in_accelerates_own_loop(fresh_accelerate):
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    ref, ref_opt = tiny()
    ref_model, ref_opt = accelerator.prepare(ref, ref_opt)
    for x in batches():
        with accelerator.accumulate(ref_model):
            accelerator.backward(ref_model(x).square().sum())
            ref_opt.step()
            ref_opt.zero_grad()
    module, opt = tiny()
    model, opt = accelerator.prepare(module, opt)
    stepper = recovering_step(accelerator, model, opt, collective_timeout=None)

    def micro_step(model: torch.nn.Module, x: torch.Tensor) -> None:
        accelerator.backward(model(x).square().sum())

    results = [stepper(micro_step, x, step=i) for i, x in enumerate(batches())]
    assert [(r.ok, r.pending, r.attempts) for r in results] == [(True, True, 1), (True, False, 1)] * 3
    assert torch.equal(module.weight, ref.weight) and torch.equal(module.bias, ref.bias)
    assert not torch.equal(module.weight, tiny()[0].weight)  # it trained


def test_a_lambda_over_the_loops_batch_is_refused_before_the_window_commits(fresh_accelerate):
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    module, opt = tiny()
    model, opt = accelerator.prepare(module, opt)
    stepper = recovering_step(accelerator, model, opt, collective_timeout=None)
    before = module.weight.detach().clone()
    with pytest.raises(ValueError, match="micro-batch 0 of this window reads x from outside, which changed"):
        for x in batches()[:2]:
            stepper(lambda m: accelerator.backward(m(x).sum()))  # noqa: B023 - the mistake under test
    assert torch.equal(module.weight, before)  # nothing applied


def test_heal_with_accumulation_and_what_is_not_an_accelerator_are_refused(fresh_accelerate):
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    module, opt = tiny()
    with pytest.raises(TypeError, match="must be an accelerate.Accelerator"):
        recovering_step(object(), module, opt)
    with pytest.raises(ValueError, match="heal=True cannot go with gradient_accumulation_steps=2"):
        recovering_step(Accelerator(cpu=True, gradient_accumulation_steps=2), module, opt, heal=True)
