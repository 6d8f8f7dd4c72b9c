"""One drill step on CUDA tensors: FSDP2 shards on a GPU, NCCL, snapshots taken through pinned
memory on a side stream, and a state put back from one, bit for bit.

A world of one on one GPU (NCCL refuses two ranks on one GPU, so a multi-rank NCCL drill needs two
GPUs): ``RecoveringStep(module, Adam, wrap=FSDP2(...), heal=True, snapshot_every=1)`` runs
``--steps`` steps of a module of Linear layers ``--width`` wide; then the keeper takes one more
snapshot, its tensors are compared with the live shards, the live state is zeroed, and the snapshot
is put back (``ModuleState.apply``): the parameters and Adam's state must equal what they were.

Usage (on a machine with a GPU):
    python benchmarks/cuda_snapshot_step.py --width 4096 --layers 8 --json benchmarks/results/cuda_snapshot_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import FSDP2, RecoveringStep
from ncclguard.recovery._step.state import StepState
from ncclguard.recovery.snapshots.packing import unpack
from ncclguard.recovery.snapshots.state import ModuleState


def shard_layers(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(width: int, layers: int, steps: int, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    stepper = RecoveringStep(module, opt, wrap=FSDP2(shard_layers), heal=True, snapshot_every=1)
    x = torch.randn(16, width, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = []
    for step in stepper.steps(steps):
        res = stepper(lambda model: model(x).square().mean().backward(), step=step)
        results.append(bool(res))
    keeper = stepper.engine.keeper
    assert keeper is not None
    sync()
    start = time.perf_counter()
    keeper.take(steps, StepState.take(stepper.module))
    take_s = time.perf_counter() - start
    snap = keeper.own[-1]
    codec = ModuleState(lambda: stepper.module, lambda: stepper.optimizer)
    live = {k: v.detach().cpu().clone() for k, v in codec.capture().tensors.items()}
    kept = unpack(snap).tensors
    equal_at_take = all(torch.equal(live[k], kept[k]) for k in live)
    with torch.no_grad():  # the live state lost: every shard and Adam's moments zeroed
        for p in stepper.module.parameters():
            local(p).zero_()
        for s in stepper.optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    local(v).zero_()
    codec.apply(unpack(snap))
    sync()
    after = {k: v.detach().cpu() for k, v in codec.capture().tensors.items()}
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in module.parameters()),
        "steps_committed": results,
        "snapshot_bytes": snap.manifest.nbytes,
        "payload_pinned": snap.payload.is_pinned(),
        "take_s": round(take_s, 4),
        "take_gib_per_s": round(snap.manifest.nbytes / take_s / 2**30, 2),
        "takes": keeper.takes,
        "spent_s": round(keeper.spent_s, 4),
        "equal_at_take": equal_at_take,
        "equal_after_put_back": all(torch.equal(after[k], live[k]) for k in live),
        "held": _held(keeper, device),
    }


def _held(keeper: Any, device: str) -> dict[str, Any]:
    """The host memory the snapshots hold, against what the caching host allocator reserved for
    them: torch rounds each pinned block up to a power of two and keeps freed blocks (issue 59)."""
    kept = sum(s.payload.numel() for s in keeper.own) + sum(
        s.payload.numel() for held in keeper.replicas.values() for s in held
    )
    out: dict[str, Any] = {"snapshots": len(keeper.own), "payload_bytes": kept}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device == "cuda" and stats is not None:
        got = stats()
        out["host_allocator"] = {k: v for k, v in got.items() if "bytes" in k and ("current" in k or "peak" in k)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same on gloo (a dry run)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no GPU: this drill step runs on CUDA tensors (--device cpu for a dry run)")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="ncclguard-cudastep-") as tmp:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            result = run(args.width, args.layers, args.steps, args.device)
        finally:
            dist.destroy_process_group()
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), **result}, indent=1) + "\n")
    return 0 if result["equal_at_take"] and result["equal_after_put_back"] and all(result["steps_committed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
