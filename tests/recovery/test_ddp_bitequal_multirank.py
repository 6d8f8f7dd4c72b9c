"""A killed rank healed under RecoveringStep's own DDP wrapper ends bit-equal to the run without the
fault, for a model whose gradients DDP spreads over several buckets.

Two launches of tests/workers/ddp_bitequal_worker.py, each 3 gloo ranks under ncclguard's launcher
(a BERT classifier of 2.05M parameters with its default dropout, fp16 autocast with a GradScaler,
AdamW with a warm-up schedule, gradient clipping, shuffled data, 10 steps):
``clean``: no fault.
``kill``: rank 2 SIGKILLs itself at step 4; the launcher restarts it, it is healed from rank 0, and
    the three redo step 4 on the rebuilt world. Every rank's new wrapper reduces that step in the
    gradient buckets DDP had rebuilt after step 0, not in a fresh wrapper's single bucket (measured
    in that: 35 of the 41 parameters ended different, by up to 2.4e-7 in float32).
The sha256 of every parameter, on every rank, is the same in both launches.

In process, on a gloo world of one: the layout read, broadcast and given to a new wrapper, and the
warnings where it cannot be kept (a wrapper that has not rebuilt its buckets yet, other parameters).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel

from ncclguard.recovery._step.state import bucket_layout, kept_layout, share_layout, wrap_in_layout

pytestmark = pytest.mark.timeout(400)  # past each launch's own hang guard

STEPS, K = 10, 4  # ddp_bitequal_worker's: rank 2 dies at step K
REBUILT = [23, 18]  # parameters in each of DDP's buckets once rebuilt (the first about 1 MiB); a fresh wrapper: [41]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_new_wrapper_takes_the_buckets_its_predecessor_rebuilt(world_of_one, caplog):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Tanh(), torch.nn.Linear(600, 600))
    x = torch.randn(2, 600)
    old = DistributedDataParallel(module)
    first = [[0, 1, 2, 3]]  # one bucket, in the parameters' order
    assert bucket_layout(old) == first and bucket_layout(module) is None
    old(x).sum().backward()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert kept_layout(old, steps=1) == first  # the rebuild waits for the next forward
    assert "had not rebuilt its gradient buckets yet" in caplog.text
    old(x).sum().backward()  # that forward rebuilt them, in the order the gradients became ready
    rebuilt = [[3, 2], [1, 0]]  # 1 MiB first, then the rest
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert kept_layout(old, steps=2) == rebuilt
        assert share_layout(rebuilt, 0, module) == rebuilt and share_layout(None, 0, module) is None
        assert bucket_layout(wrap_in_layout(module, rebuilt)) == rebuilt
        assert bucket_layout(wrap_in_layout(module, None)) == first
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert bucket_layout(wrap_in_layout(module, [[3, 2]])) == first  # other parameters: DDP's own
    assert "did not take the gradient buckets" in caplog.text


@pytest.fixture(scope="module")
def clean_job():
    # 3 ranks importing torch and transformers, 10 steps of a 2M-parameter model. With kill_job:
    # 18-62 s for both on a shared 2-core host (5 runs). Hang guard: 240 s.
    return run_ranks("ddp_bitequal_worker", 3, "clean", launcher="spawn", timeout_s=240)


@pytest.fixture(scope="module")
def kill_job():
    # As clean_job, plus a SIGKILL, a restart (importing both again), a rebuild and a heal.
    # Hang guard: 300 s.
    return run_ranks("ddp_bitequal_worker", 3, "kill", launcher="spawn", restarts=2, restart_on=[-9], timeout_s=300)


@pytest.mark.multirank
def test_a_healed_rank_under_the_default_ddp_wrapper_ends_bit_equal_to_the_run_without_the_fault(clean_job, kill_job):
    assert clean_job[0]["parameters"] == 2_054_274
    reference = clean_job[0]["digests"]
    for r in range(3):
        assert [{k: v for k, v in x.items() if k != "scale"} for x in clean_job[r]["results"]] == [
            {"step": s, "ok": True, "attempts": 1, "generation": 0, "world_size": 3, "healed": None}
            for s in range(STEPS)
        ]
        # DDP's first layout for step 0, the buckets it rebuilt in step 1's forward after.
        assert clean_job[r]["buckets"] == {str(s): [41] if s == 0 else REBUILT for s in range(STEPS)}
        assert clean_job[r]["digests"] == reference

    # fp16's first steps overflow at the scaler's first scale (2^20): it backed off before the kill.
    scales = [x["scale"] for x in clean_job[0]["results"]]
    assert scales[K - 1] < 2.0**20, scales
    assert [(x.rank, x.count, x.returncode) for x in kill_job.restarts] == [(2, 1, -9)]
    assert kill_job[2]["life"] == 1 and kill_job[2]["resume_step"] == K
    for r in range(3):
        res = kill_job[r]
        steps = res["results"]
        redo = steps[0] if r == 2 else steps[K]  # the restarted process starts at the step redone
        assert redo["step"] == K and redo["ok"] and redo["generation"] == 1
        assert redo["attempts"] == (1 if r == 2 else 2)
        assert [s["step"] for s in steps] == list(range(K if r == 2 else 0, STEPS)) and all(s["ok"] for s in steps)
        # Step K redone by new wrappers, in the buckets of the old ones (the restarted rank's too), no comm hook.
        assert res["buckets"][str(K)] == REBUILT and res["comm_hooks"] == 0
        assert res["lr"] == clean_job[r]["lr"]
        # The scaler's scale after each step, the restarted rank's too (it got the scale with the heal).
        assert [x["scale"] for x in steps] == scales[K if r == 2 else 0 :]
        # Bit for bit, every parameter, against the run without the fault.
        assert res["digests"] == reference, [n for n in reference if res["digests"][n] != reference[n]]
        assert res["final"] == [r, 3, 1]
