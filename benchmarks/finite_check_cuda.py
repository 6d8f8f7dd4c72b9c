"""What the NaN/Inf check costs on a GPU (issue 61), side by side in one run.

    python benchmarks/finite_check_cuda.py [--iters 50] [--json out.json]

A world of one NCCL group on GPU 0 (one process). Cases, each iteration running every case once in a
rotating order, each timed from its start to a ``torch.cuda.synchronize()`` (the one sync a commit
makes):

- ``scan 1e8``: :func:`ncclguard.collectives.finite.extremes` of 1e8 float32 values (its least and
  greatest value, left on the device), against ``copy 1e8``: a device-to-device copy of the same
  tensor (a memory-bound pass of the same bytes, read once and written once);
- ``ddp``: a DDP step (forward, backward, Adam) of a 25.2M-parameter MLP (3 Linear layers
  2048 <-> 4096, batch ``--batch``), DDP's own path; ``ddp+check``: the same with the recovery engine's comm
  hook (every bucket scanned before its all-reduce, the scans read after the backward, as the commit
  reads them).

A world of one reduces nothing over a wire, so the check's share of a real multi-GPU step is smaller
than the ratio here: the ratio is an upper bound for this model. Needs a CUDA GPU; exits 2 without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _cases(batch: int) -> dict[str, Callable[[], object]]:
    from torch.nn.parallel import DistributedDataParallel

    from ncclguard.collectives.finite import extremes
    from ncclguard.recovery._numerics.hook import GradCheck

    big = torch.zeros(10**8, device="cuda")
    dst = torch.empty_like(big)

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 4096),
        ).cuda()  # fmt: skip

    x = torch.randn(batch, 2048, device="cuda")
    plain_module, checked_module = mlp(), mlp()
    plain, checked = DistributedDataParallel(plain_module), DistributedDataParallel(checked_module)
    check = GradCheck()
    check.install(checked, checked_module)
    opts = {id(m): torch.optim.Adam(m.parameters(), lr=1e-6) for m in (plain_module, checked_module)}

    def step(model: torch.nn.Module, module: torch.nn.Module, read: bool) -> None:
        opt = opts[id(module)]
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if read:
            said = check.said()  # the scans read: the one sync, where the commit syncs already
            check.clear()
            assert said.checked > 0 and not said.nonfinite
        opt.step()

    return {
        "scan 1e8": lambda: extremes(big),
        "copy 1e8": lambda: dst.copy_(big),
        "ddp": lambda: step(plain, plain_module, False),
        "ddp+check": lambda: step(checked, checked_module, True),
    }


def _times(cases: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict[str, dict[str, float]]:
    names = list(cases)
    got: dict[str, list[float]] = {n: [] for n in names}
    for it in range(iters + warmup):
        for name in names[it % len(names) :] + names[: it % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            cases[name]()
            torch.cuda.synchronize()
            if it >= warmup:
                got[name].append(time.perf_counter() - start)
    return {n: {"p50_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3} for n, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64, help="the DDP step's batch (the step's length)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("finite_check_cuda: no CUDA GPU here; nothing run")
        return 2
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="ncclguard-finite-") as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            t = _times(_cases(args.batch), args.iters, 5)
        finally:
            dist.destroy_process_group()
    doc: dict[str, Any] = {
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "iters": args.iters,
        "batch": args.batch,
        "ms": t,
        "ratios": {
            f"{a}/{b}": {k: round(t[a][f"{k}_ms"] / t[b][f"{k}_ms"], 4) for k in ("p50", "min")}
            for a, b in (("scan 1e8", "copy 1e8"), ("ddp+check", "ddp"))
        },
        "command": " ".join(["python", "benchmarks/finite_check_cuda.py", *sys.argv[1:]]),
    }
    print("finite_check_cuda:", json.dumps(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
