"""What one snapshot take costs at real size, side by side with the physical limit: one copy of the
same bytes into preallocated host memory (pinned, on a GPU), on the same machine, in one run.

A rank's state here is a module of Linear layers and Adam after one step (its moments exist), of
``--gib`` GiB in all (parameters, moments, step counters), on the CPU or on a GPU (``--device
cuda``). In a world of one (gloo; the take's swap has no peer, so what is measured is what every
take pays before its swap: the capture, the copy into host memory, the digest, the commit):

- ``copy``: every tensor copied into one preallocated buffer (pinned where the state is on a
  GPU, non-blocking copies on a side stream, one synchronisation): the limit a take can approach;
- ``alloc+copy``: the same into a buffer allocated for the copy (what a take without spare
  buffers pays: the memory is mapped as it is written);
- ``digest``: the snapshot digest alone over the copied bytes;
- ``take (lean)``: :meth:`Keeper.take` with ``spares=False`` (the default: its state twice in
  host memory in steady state);
- ``take (spares)``: with ``spares=True`` (a committed take's freed buffer takes the next one).

Each figure is the median of ``--repeat`` takes after one warm-up, in GiB/s and as a ratio to
``copy``. The host memory the keeper holds afterwards is read from its snapshots' manifests.

Usage:
    python benchmarks/snapshot_cost.py --gib 1
    python benchmarks/snapshot_cost.py --device cuda --gib 4 --json benchmarks/results/snapshot_cost_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery._step.state import StepState
from ncclguard.recovery.snapshots.keeper import Keeper
from ncclguard.recovery.snapshots.packing import digest
from ncclguard.recovery.snapshots.state import ModuleState

WIDTH = 4096  # a layer of 4096 x 4096 float32: 64 MiB of weights, 192 MiB with Adam's moments


def state_of(gib: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A module of Linear layers and Adam after one step, ``gib`` GiB in all (three copies of each parameter)."""
    layer_bytes = 3 * (WIDTH * WIDTH + WIDTH) * 4
    layers = max(1, round(gib * 2**30 / layer_bytes))
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # Adam's moments now exist, as on any rank after its first step
    return module, opt


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plain_copy(tensors: list[torch.Tensor], into: torch.Tensor, device: str) -> None:
    """Every tensor into ``into`` at its place: the limit a take can approach."""
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    offset = 0
    ctx = torch.cuda.stream(stream) if stream is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for t in tensors:
            n = t.numel() * t.element_size()
            into[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=t.is_cuda)
            offset += -(-n // 64) * 64
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if stream is not None:
        stream.synchronize()


def timed(fn: Any, repeat: int, device: str) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn`` after one warm-up."""
    fn()
    _sync(device)
    out = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def measure(gib: float, device: str, repeat: int) -> dict[str, Any]:
    """Every figure of the module doc for one state size; a world of one must be initialized."""
    module, opt = state_of(gib, device)
    codec = ModuleState(lambda: module, lambda: opt)
    tensors = [t for t in codec.capture().tensors.values()]
    nbytes = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    pinned = device == "cuda"
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    buffer.fill_(0)  # mapped (and pinned) before it is timed: the limit
    results: dict[str, list[float]] = {
        "copy": timed(lambda: plain_copy(tensors, buffer, device), repeat, device),
        "alloc+copy": timed(
            lambda: plain_copy(tensors, torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), device),
            repeat,
            device,
        ),
        "digest": timed(lambda: digest(buffer), repeat, device),
    }
    held: dict[str, int] = {}
    for name, spares in (("take (lean)", False), ("take (spares)", True)):
        keeper = Keeper(codec, every=1, spares=spares)
        step = [0]

        def take(keeper: Keeper = keeper, step: list[int] = step) -> None:
            keeper.take(step[0], StepState.take(module))
            step[0] += 1

        results[name] = timed(take, repeat, device)
        held[name] = sum(s.manifest.nbytes for s in keeper.own) + sum(
            s.manifest.nbytes for held in keeper.replicas.values() for s in held
        )
        held[name + " spare"] = sum(t.numel() for t in keeper._spare.values())
        del keeper
    limit = statistics.median(results["copy"])
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_bytes": nbytes,
        "repeat": repeat,
        "median_s": {k: round(statistics.median(v), 5) for k, v in results.items()},
        "gib_per_s": {k: round(nbytes / statistics.median(v) / 2**30, 2) for k, v in results.items()},
        "ratio_to_copy": {k: round(statistics.median(v) / limit, 3) for k, v in results.items()},
        "host_bytes_held_after": held,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, nargs="+", default=[1.0], help="state sizes to measure, in GiB")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU here")
    with tempfile.TemporaryDirectory(prefix="ncclguard-snapcost-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            runs = [measure(g, args.device, args.repeat) for g in args.gib]
        finally:
            dist.destroy_process_group()
    for r in runs:
        print(f"state {r['state_bytes'] / 2**30:.2f} GiB on {r['device']}:")
        for name, gbs in r["gib_per_s"].items():
            print(f"  {name:<14} {gbs:7.2f} GiB/s  {r['ratio_to_copy'][name]:5.2f}x the copy")
        print(f"  host bytes held after: {r['host_bytes_held_after']}")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "runs": runs,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
