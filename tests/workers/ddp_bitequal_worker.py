"""Rank side of tests/recovery/test_ddp_bitequal_multirank.py: 3 gloo ranks under ncclguard's launcher.
Usage: ddp_bitequal_worker.py SCENARIO.

The job: a BERT classifier of 2,054,274 parameters (``transformers.BertConfig``, hidden 128, 2 layers,
vocabulary 12,800, the default dropout of 0.1), AdamW, a linear schedule with 3 warm-up steps, gradient
clipping at norm 1.0, and shuffled data (``DistributedSampler(shuffle=True)``, two epochs in the 10
steps), trained through ``RecoveringStep(heal=True)`` with the DDP wrapper it builds itself (every
default). A fresh wrapper reduces the gradients in one bucket (41 parameters, 7.84 MiB); from the
second step on, DDP's rebuilt buckets hold 23 parameters (the first bucket, about 1 MiB) and 18.

``clean``: 10 steps, no fault.
``kill``: rank 2 SIGKILLs itself at step 4 of its first life, before its forward. The launcher
restarts it; it rejoins the survivors' rebuild, is healed from rank 0 and redoes step 4 with them.

fp16 as a user runs it on a GPU: the forward under ``torch.autocast`` (float16, here on the CPU) and a
``GradScaler`` passed as ``scaler=`` (its first scale, 2^20, overflows float16 gradients, so the first
steps are skipped and the scale backs off: a restarted process must get the scale, not start again).
As a user writes it: one seed on every rank (dropout draws from the global generator, the same on
every rank); the schedule passed as ``scheduler=``; the data position from the step (a restarted
process starts at ``resume_step``). The heal sends the restarted rank the scheduler's state and the
generators as the redone step found them, from the live peer.
Every rank saves sha256 digests of its final parameters, and the buckets (parameters in each) that
each step's backward reduced in.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import rankkit
import torch
import torch.distributed as dist
import transformers
from rankkit import put
from torch.utils.data import DistributedSampler, TensorDataset

import ncclguard
from ncclguard import RecoveringStep
from ncclguard.recovery._step.state import bucket_layout
from ncclguard.recovery.records import StepResult

rankkit.rank = lambda: int(os.environ["RANK"])  # results go by launch rank, whatever the world
ME = int(os.environ["RANK"])
LIFE = ncclguard.restart_count()

GROUP_TIMEOUT_S = 60.0  # DDP's constructor broadcasts under it (a late rank on a loaded host)
BOUND_STEP_S = 5.0  # collective_timeout: a survivor left waiting on the dead rank gives up here
COMMIT_S = 30.0  # hang guards: the launcher's death notice settles the commit at once,
REBUILD_S = 90.0  # the restarted process (importing torch and transformers again) ends the rebuild,
HEAL_S = 60.0  # and the transfer takes well under a second
STEPS, K, KILLED = 10, 4, 2
WORLD, BATCH, SEQ, SAMPLES = 3, 4, 16, 60  # 20 samples per rank: 5 steps per epoch
WARMUP = 3


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = transformers.BertConfig(
        vocab_size=12_800,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    torch.manual_seed(7)
    module = transformers.BertForSequenceClassification(config)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)


def dataset(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 12_800, (samples, SEQ), generator=g)
    return TensorDataset(ids, torch.randint(0, 2, (samples,), generator=g))


def batch(data: TensorDataset, step: int, world: int = WORLD, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """This launch rank's batch of ``step``: its shard of the shuffled epoch, from the step alone
    (also the FSDP2 heal's, tests/workers/sharded_heal_worker.py: 4 ranks, 2 a batch)."""
    sampler = DistributedSampler(data, num_replicas=world, rank=ME, shuffle=True, seed=17)
    per_epoch = len(sampler) // size
    sampler.set_epoch(step // per_epoch)
    at = (step % per_epoch) * size
    ids, labels = data[list(sampler)[at : at + size]]
    return ids, labels


def digests(module: torch.nn.Module) -> dict[str, str]:
    return {name: hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for name, p in module.named_parameters()}


def summary(res: StepResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "attempts": res.attempts,
        "generation": res.generation,
        "world_size": dist.get_world_size(),
        "healed": res.healed.role if res.healed is not None else None,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    scenario = sys.argv[1]
    put("life", LIFE)
    if LIFE == 0:
        dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    module, opt = make()
    schedule = transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    stepper = RecoveringStep(
        module,
        opt,
        scheduler=schedule,  # a restarted process gets its state (and the scaler's) from the live peer
        scaler=scaler,
        collective_timeout=BOUND_STEP_S,
        commit_timeout=COMMIT_S,
        rebuild_timeout=REBUILD_S,
        heal=True,
        heal_timeout=HEAL_S,
    )
    first = stepper.resume_step or 0
    data = dataset()
    results: list[dict[str, Any]] = []
    buckets: dict[int, list[int]] = {}
    for step in range(first, STEPS):
        ids, labels = batch(data, step)

        def step_fn(model: torch.nn.Module, step: int = step, ids: torch.Tensor = ids, labels: torch.Tensor = labels):
            if scenario == "kill" and step == K and LIFE == 0:
                put("results", results)
                rankkit.kill(KILLED)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            # The buckets this backward reduced in (a forward rebuilds them, after a wrapper's first step).
            buckets[step] = [len(b) for b in bucket_layout(model) or []]
            scaler.unscale_(opt)  # clipping sees the true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        res = stepper(step_fn, step=step)
        results.append({"step": step, **summary(res), "scale": scaler.get_scale()})
        if not res:
            break
        schedule.step()
    put("results", results)
    put("resume_step", stepper.resume_step)
    put("buckets", buckets)  # JSON: the step numbers become strings
    put("comm_hooks", len(getattr(stepper.model, "_comm_hooks", [])))
    put("lr", opt.param_groups[0]["lr"])
    put("digests", digests(module))
    put("parameters", sum(p.numel() for p in module.parameters()))
    put("final", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    # Rank 0 hosts the job's store under this launcher: it waits here for the last rank to have read
    # the last commit's outcome (seen once in a full run here: the restarted rank lost the store reading it).
    dist.barrier()
    rankkit.done()


if __name__ == "__main__":
    main()
