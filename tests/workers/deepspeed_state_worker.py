"""Rank side of tests/integrations/test_deepspeed_state_multirank.py: DeepSpeedState on real DeepSpeed ZeRO 1, 2
and 3 engines, 2 gloo ranks on CPU under torchrun, one launch for the three stages.

Per stage (results under ``z<stage>.``):

- a capture right after ``deepspeed.initialize`` (``cap0``), K steps, a capture (``cap``, copied to
  CPU clones, as the caller of ``capture`` does), M steps recorded (losses and the gathered full
  parameters); ``apply(cap)`` and the same M steps again: the records must be equal bit for bit;
- ``apply(cap0)`` on the trained engine and K steps: equal to the first K;
- a FRESH engine (another seed) built in the same process, ``apply(cap)``, the M steps: equal;
- the same in bf16 (results under ``bf16.z<stage>.``);
- ``check`` of a capture from an engine of another shape, and of the other rank's capture (its
  tensors all-gathered, its meta through the store as JSON): refused, and ``apply`` raises
  before copying anything (the engine's state is unchanged, bit for bit).

Then ``padding``: a ZeRO-3 parameter of 35 elements on 2 ranks is partitioned 18 + 17; rank 1's
partition ends in one element DeepSpeed leaves as ``torch.empty`` made it. NaN written there (in the
master weights, the low-precision flat, and Adam's state), as garbage memory can hold: a capture
holds none of it.
"""

from __future__ import annotations

import hashlib
import json
import sys

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard.integrations.deepspeed.state import DeepSpeedState, OwnState

K, M = 2, 3


def engine(
    stage: int, seed: int, hidden: int = 16, accumulation: int = 1, bf16: bool = False
) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(seed)
    # BatchNorm: buffers of each rank's own (running statistics of its own batches). Under bf16
    # DeepSpeed casts the parameters and not the buffers, which BatchNorm refuses: LayerNorm there.
    norm = torch.nn.LayerNorm(hidden) if bf16 else torch.nn.BatchNorm1d(hidden)
    model = torch.nn.Sequential(torch.nn.Linear(6, hidden), norm, torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
        # 0.weight (96 elements) stays partitioned, the smaller ones are persistent (gathered for good)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": bf16},
    }
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return eng


def train(eng: deepspeed.DeepSpeedEngine, steps: range, rank: int) -> dict:
    """Trains ``steps`` and returns the losses and a digest of the full parameters after each."""
    losses, digests = [], []
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(4, 6, generator=g)
        out = eng(x.bfloat16() if eng.bfloat16_enabled() else x).float()
        loss = torch.nn.functional.mse_loss(out, x.sum(1, keepdim=True).tanh())
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        # Gathers the partitioned ones only: the exit partitions what it gathered, and the persistent
        # ones must stay whole as in training (a no-op below ZeRO-3)
        partitioned = [p for p in eng.module.parameters() if getattr(p, "ds_status", None) is not None]
        partitioned = [p for p in partitioned if p.ds_status.name != "AVAILABLE"]
        with deepspeed.zero.GatheredParameters(partitioned):
            h = hashlib.sha256()
            for name, p in [*eng.module.named_parameters(), *eng.module.named_buffers()]:
                h.update(name.encode() + p.detach().float().contiguous().numpy().tobytes())
            digests.append(h.hexdigest())
    return {"losses": losses, "digests": digests, "global_steps": eng.global_steps}


def copied(state: OwnState) -> OwnState:
    """What the caller of capture() does: CPU clones, the meta through JSON."""
    return OwnState(
        {k: v.detach().to("cpu", copy=True) for k, v in state.tensors.items()}, json.loads(json.dumps(state.meta))
    )


def state_digest(state: DeepSpeedState) -> str:
    live = state.capture()
    h = hashlib.sha256(json.dumps(live.meta, sort_keys=True).encode())
    for name in sorted(live.tensors):
        h.update(name.encode() + live.tensors[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def other_ranks(cap: OwnState, stage: int, rank: int) -> OwnState:
    """The other rank's capture: its tensors all-gathered (same names and shapes on both ranks), its meta by the store."""
    store = rankkit._job_store()
    store.set(f"ds-state/{stage}/{rank}", json.dumps(cap.meta))
    tensors = {}
    for name in sorted(cap.tensors):
        t = cap.tensors[name].contiguous()
        out = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(out, t)
        tensors[name] = out[1 - rank]
    return OwnState(tensors, json.loads(store.get(f"ds-state/{stage}/{1 - rank}")))


def refusals(stage: int, rank: int, eng: deepspeed.DeepSpeedEngine, cap: OwnState) -> None:
    state = DeepSpeedState(eng)
    wider = engine(stage, seed=0, hidden=17)
    put(f"z{stage}.other_shape", DeepSpeedState(wider).check(cap))
    theirs = other_ranks(cap, stage, rank)
    put(f"z{stage}.other_rank", state.check(theirs))
    before = state_digest(state)
    try:
        state.apply(theirs)
        put(f"z{stage}.other_rank_applied", True)
    except ValueError as exc:
        put(f"z{stage}.other_rank_apply_error", str(exc))
    put(f"z{stage}.unchanged_after_refusal", state_digest(state) == before)
    wrong_dtype = OwnState({**cap.tensors, "master.0": cap.tensors["master.0"].double()}, cap.meta)
    put(f"z{stage}.wrong_dtype", state.check(wrong_dtype))
    # A malformed meta (a replica from a peer): refused before anything is copied
    malformed = {**cap.meta, "params": "x", "loss_scaler": {"__class__": 1}, "param_groups": []}
    put(f"z{stage}.malformed", state.check(OwnState(cap.tensors, malformed)))


def run_stage(stage: int, rank: int) -> None:
    eng = engine(stage, seed=0)
    state = DeepSpeedState(eng)
    cap0 = copied(state.capture())
    first_k = train(eng, range(K), rank)
    cap = copied(state.capture())
    put(f"z{stage}.meta", cap.meta)
    put(f"z{stage}.tensors", {k: [list(v.shape), str(v.dtype)] for k, v in cap.tensors.items()})
    first = train(eng, range(K, K + M), rank)
    state.apply(cap)
    put(f"z{stage}.global_steps_applied", eng.global_steps)
    put(f"z{stage}.gathered_at_apply", [n for n, p in eng.module.named_parameters() if p.data.numel() > 0])
    again = train(eng, range(K, K + M), rank)
    put(f"z{stage}.first", first)
    put(f"z{stage}.again", again)
    state.apply(cap0)
    put(f"z{stage}.first_k", first_k)
    put(f"z{stage}.from_start", train(eng, range(K), rank))
    fresh = engine(stage, seed=123)
    DeepSpeedState(fresh).apply(cap)
    put(f"z{stage}.fresh", train(fresh, range(K, K + M), rank))
    refusals(stage, rank, eng, cap)


def run_bf16(stage: int, rank: int) -> None:
    """Mixed precision: bf16 parameters (the flat), fp32 master weights and optimizer state."""
    eng = engine(stage, seed=0, bf16=True)
    state = DeepSpeedState(eng)
    train(eng, range(K), rank)
    cap = copied(state.capture())
    put(f"bf16.z{stage}.tensors", {k: [list(v.shape), str(v.dtype)] for k, v in cap.tensors.items()})
    first = train(eng, range(K, K + M), rank)
    state.apply(cap)
    put(f"bf16.z{stage}.first", first)
    put(f"bf16.z{stage}.again", train(eng, range(K, K + M), rank))
    fresh = engine(stage, seed=123, bf16=True)
    DeepSpeedState(fresh).apply(cap)
    put(f"bf16.z{stage}.fresh", train(fresh, range(K, K + M), rank))


def mid_window() -> None:
    """A capture inside a gradient accumulation window is refused (the window's gradients are not state)."""
    eng = engine(2, seed=0, accumulation=2)
    loss = eng(torch.ones(4, 6)).sum()
    eng.backward(loss)
    eng.step()  # the first micro step of 2: nothing applied yet
    try:
        DeepSpeedState(eng).capture()
    except ValueError as exc:
        put("mid_window_error", str(exc))


def padding(rank: int) -> None:
    """The pad of a ZeRO-3 partition never reaches a capture as NaN (see the module doc)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1_000_000,
    }
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    eng.backward(eng(torch.ones(4, 5)).sum())
    eng.step()  # Adam's state exists
    opt = eng.optimizer
    master, flat = opt.fp32_partitioned_groups_flat[0], opt.fp16_partitioned_groups_flat[0]
    pads, at = [], 0
    for p in opt.fp16_groups[0]:  # DeepSpeed's own numbers: a partition's size, the parameter's elements
        size = p.ds_tensor.numel()
        valid = max(0, min(p.ds_numel - size * rank, size))
        pads += [[at + valid, at + size]] if valid < size else []
        at += size
    with torch.no_grad():
        for a, b in pads:
            for t in (master, flat, *opt.optimizer.state[master].values()):
                if torch.is_tensor(t) and t.numel() == master.numel():
                    t[a:b] = float("nan")
    cap = DeepSpeedState(eng).capture()
    put("padding.ranges", pads)
    put(
        "padding.nonfinite",
        sorted(n for n, t in cap.tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()),
    )


def main() -> None:
    rank = rankkit.init(timeout_s=60)
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (int(s) for s in sys.argv[1].split(",")):
        run_stage(stage, rank)
        run_bf16(stage, rank)
    mid_window()
    padding(rank)
    dist.barrier()
    dist.destroy_process_group()
    rankkit.done()


if __name__ == "__main__":
    main()
