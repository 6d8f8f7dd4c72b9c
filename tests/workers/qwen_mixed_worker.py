"""Rank side of tests/integrations/test_qwen_mixed_multirank.py: a mixed text/image step under DeepSpeed ZeRO-3.

2 ranks (torchrun, gloo, CPU), the tiny Qwen2.5-VL classifier, ZeRO stage 3, watchdog action
report. Three training steps; at step 1 rank 1's batch has no image (text only) while rank 0's
has images. Usage: ``qwen_mixed_worker.py fixed|unfixed``:

- ``fixed``: ``always_run_vision=True`` (the default). Every step completes on both ranks.
- ``unfixed``: ``always_run_vision=False``. Rank 1 skips the vision tower at step 1, so its
  ZeRO-3 parameter gathers and gradient reduce-scatters stop matching rank 0's: the job hangs
  until the group's short timeout, and the watchdog reports the incident before that.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from qwen2_5_vl_synthetic import synthetic_batch, text_only, tiny_config
from rankkit import put

from ncclguard import phase, start_watchdog
from ncclguard.integrations.models.qwen2_5_vl import Qwen2_5_VLForClassification
from ncclguard.recording.instrument import instrument

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
HEARTBEAT_S = 0.3
HANG_S = 1.5
HANG_FIXED_S = 4.5  # fixed: no collective may wait this long (below the group timeout)
PEER_S = 15.0
GROUP_TIMEOUT_S = 6.0  # gloo's own bound on the hang; the watchdog reports well before it
TEXT_ONLY_RANK, TEXT_ONLY_STEP, STEPS = 1, 1, 3


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1_000_000,
    }


def batch_of(cfg, rank: int, step: int) -> dict[str, torch.Tensor]:
    batch = synthetic_batch(cfg, 2, seed=10 * step + rank)
    return text_only(batch) if (rank, step) == (TEXT_ONLY_RANK, TEXT_ONLY_STEP) else batch


def reference_losses(cfg, world: int) -> list[list[float]]:
    """The same training in one process, no collectives: the stock path (no dummy tower pass),
    mean gradient over the ranks' batches, torch's AdamW. Returns the losses per step and rank."""
    torch.manual_seed(0)
    model = Qwen2_5_VLForClassification(cfg, always_run_vision=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(STEPS):
        losses = [model(**batch_of(cfg, r, step)).loss for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
        out.append([x.item() for x in losses])
    return out


def main() -> None:
    fixed = {"fixed": True, "unfixed": False}[sys.argv[1]]
    if not fixed:
        rankkit.fault_fired("rank 1 skips the vision tower: ZeRO-3's collectives stop matching")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    # Before deepspeed.comm starts: it keeps references to torch.distributed's functions, and the
    # watchdog's records come from wrapping those.
    instrument()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Qwen2_5_VLForClassification(cfg, always_run_vision=fixed)
    step = 0
    tower_calls: list[int] = []  # the step of each vision-tower call on this rank
    model.model.visual.register_forward_hook(lambda *_: tower_calls.append(step))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    # After the set-up, whose collectives may be slow on a loaded machine. peer_timeout_s:
    # liveness is not under test, and a loaded 2-core machine can delay a heartbeat.
    wd = start_watchdog(
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=HANG_S if not fixed else HANG_FIXED_S,
        peer_timeout_s=PEER_S,
        incident_dir=OUT / "incidents",
    )
    losses: list[float] = []
    starts: list[float] = []
    try:
        for step in range(STEPS):
            batch = batch_of(cfg, rank, step)
            starts.append(time.time())
            images = len(batch.get("image_grid_thw", ()))
            with phase("train", step=step, images=images):  # what the batch holds shows in a report
                loss = engine(**batch).loss
                engine.backward(loss)  # MARK: backward
                engine.step()
            losses.append(loss.item())
        put("error", None)
    except RuntimeError as exc:  # the desync, surfacing at gloo's timeout (or as a closed peer)
        put("error", f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        put("error_at", time.time())
        traceback.print_exc()
    put("losses", losses)
    put("starts", starts)
    put("tower_calls", tower_calls)
    put("steps_done", len(losses))
    if fixed:
        put("reference", reference_losses(cfg, dist.get_world_size()))
    # Unfixed: the report was merged before gloo gave up; waiting here only collects it.
    put("incidents", wd.wait_for_incident(0.01 if fixed else 5, merged=True))
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
