"""What the replica check costs (gloo, 2 ranks on this host, CPU tensors), side by side in one run.

    .venv/bin/python benchmarks/replica_check_cost.py [--iters 20] [--every 100]

A 25.2M-parameter MLP (3 x Linear(2048, 4096)-sized layers, batch 16) under DDP with AdamW, after one
step (so AdamW holds its two moments: 75.5M elements digested in all). Cases, interleaved in a rotating
order after a barrier, an iteration's time the slowest rank's (p50 and min over iterations):

- ``ddp``: one DDP step: forward, backward, AdamW's step;
- ``digest``: what a rank computes at a check's commit: the digest of its parameters and of AdamW's
  state (``ncclguard.recovery._numerics.digest.replica_digests``), read on the host;
- ``digest_params``: the parameters' digest alone.

The check runs once per ``replica_check_every`` steps, so its cost per step is ``digest / (every *
ddp)``: given for ``--every`` (the default, 100) and for a period of 1. Its statement adds 2 x 16
hex digits to the commit's JSON (nothing measurable beside the store round the commit makes anyway).

Results: ``benchmarks/results/replica_check_cost.json``; docs/numerics.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finite_check_cost import _ratios, _times  # the same interleaved timing, next to this file

OUT = Path(__file__).resolve().parent / "results" / "replica_check_cost.json"
SIZES: dict[str, int] = {}  # what the digest reads, counted in _cases


def _cases() -> dict[str, Callable[[], object]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ncclguard.recovery._numerics.digest import replica_digests

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 4096),
    )  # fmt: skip
    model = DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-6)
    x = torch.randn(16, 2048)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()  # AdamW's moments exist from here: the digest reads them too
    SIZES["params"] = sum(p.numel() for p in module.parameters())
    SIZES["optimizer_state_elements"] = sum(v.numel() for s in opt.state.values() for v in s.values())
    return {
        "ddp": step,
        "digest": lambda: replica_digests(module, opt),
        "digest_params": lambda: replica_digests(module, None),
    }


def _rank(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    t = _times(_cases(), ns.iters, 2)
    if dist.get_rank() == 0 and t is not None:
        ratios = _ratios(t, [("digest", "ddp"), ("digest_params", "ddp")])
        per_step = {
            f"every_{every}": {
                "p50": round(t["digest"]["p50_ms"] / (every * t["ddp"]["p50_ms"]), 6),
                "min": round(t["digest"]["min_ms"] / (every * t["ddp"]["min_ms"]), 6),
            }
            for every in (1, ns.every)
        }
        doc: dict[str, Any] = {
            **SIZES,
            "iters": ns.iters,
            "ms": t,
            "ratios": ratios,
            "per_step": per_step,
        }
        print(json.dumps(doc, indent=1), flush=True)
        doc["machine"] = {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "ranks": dist.get_world_size(),
            "threads_per_rank": 1,
            "loadavg_1min_after": round(os.getloadavg()[0], 2),
        }
        doc["command"] = " ".join([Path(sys.executable).name, "benchmarks/replica_check_cost.py", *sys.argv[1:]])
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    from ncclguard.testing.launch import spawn, under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--every", type=int, default=100)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns)
    res = spawn([sys.executable, __file__, *sys.argv[1:]], 2, timeout_s=1200, capture=False)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
