"""What the check for NaN and Inf costs (gloo, 2 ranks on this host, CPU tensors), side by side in one run.

    .venv/bin/python benchmarks/finite_check_cost.py [--iters-small 200] [--iters-large 8] [--ddp-iters 10]

Every iteration runs each case once, in a rotating order, after a barrier; an iteration's time is the
slowest rank's; the table gives the median (p50) and the minimum over iterations, and each case's
ratio to its baseline on both.

``safe_all_reduce`` at 1e6 and at 1e8 float32 elements (the tensor holds zeros, so repeated sums stay
finite):

- ``plain``: ``dist.all_reduce(t)``;
- ``verify``: ``safe_all_reduce(t, verify=True, check_finite=False)``: the cross-rank check, no scan
  (the baseline of the next);
- ``verify+check``: ``safe_all_reduce(t, verify=True, check_finite=True)``: the same round, carrying
  each rank's scan of its input (what the check adds where the cross-rank check runs anyway);
- ``default``: ``safe_all_reduce(t)`` as shipped (``Config.check_finite="never"``: not scanned; the
  cross-rank check runs at or above 1e8 elements only), the baseline of the next;
- ``checked``: ``safe_all_reduce(t, check_finite=True)``: what turning the check on costs against the
  default (at 1e6 elements the cross-rank round too, which it implies);
- ``scan``: the scan alone (``ncclguard.collectives.finite.nonfinite_kind``), against ``plain``.

A DDP step (``--ddp-iters``): forward, backward and the optimizer's step of a 25.2M-parameter MLP
(3 x Linear(2048, 4096)-sized layers, batch 16), DDP's own path (``ddp``) against the recovery
engine's comm hook (``ddp+check``: every bucket scanned before its all-reduce, the scans read after
the backward, as the commit reads them).

Results: ``benchmarks/results/finite_check_cost.json``; docs/numerics.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results" / "finite_check_cost.json"


def _times(cases: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict[str, dict[str, float]] | None:
    """Runs ``cases`` interleaved on every rank; on rank 0 the p50 and min of the slowest rank's time (s)."""
    import torch
    import torch.distributed as dist

    from ncclguard.bench.formulas import slowest_per_iteration

    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    token = torch.zeros(1)
    for it in range(iters + warmup):
        for k in range(len(names)):
            name = names[(it + k) % len(names)]
            dist.all_reduce(token)
            start = time.perf_counter()
            cases[name]()
            if it >= warmup:
                times[name].append(time.perf_counter() - start)
    mine = torch.tensor([times[n] for n in names], dtype=torch.float64)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    if dist.get_rank() != 0:
        return None
    out = {}
    for i, n in enumerate(names):
        slowest = slowest_per_iteration([p[i].tolist() for p in parts])
        out[n] = {"p50_ms": statistics.median(slowest) * 1e3, "min_ms": min(slowest) * 1e3}
    return out


def _ok(res: Any) -> None:
    if not res:
        raise SystemExit(f"a guarded call failed: {res.error}")


def _all_reduce_cases(numel: int) -> dict[str, Callable[[], object]]:
    import torch
    import torch.distributed as dist

    from ncclguard import safe_all_reduce
    from ncclguard.collectives.finite import nonfinite_kind

    t = torch.zeros(numel)
    return {
        "plain": lambda: dist.all_reduce(t),
        "verify": lambda: _ok(safe_all_reduce(t, verify=True, check_finite=False, timeout=120)),
        "verify+check": lambda: _ok(safe_all_reduce(t, verify=True, check_finite=True, timeout=120)),
        "default": lambda: _ok(safe_all_reduce(t, timeout=120)),
        "checked": lambda: _ok(safe_all_reduce(t, check_finite=True, timeout=120)),
        "scan": lambda: nonfinite_kind(t),
    }


def _ddp_cases() -> dict[str, Callable[[], object]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ncclguard.recovery._numerics.hook import GradCheck

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 4096),
        )  # fmt: skip

    x = torch.randn(16, 2048)
    plain_module, checked_module = mlp(), mlp()
    plain, checked = DistributedDataParallel(plain_module), DistributedDataParallel(checked_module)
    check = GradCheck()
    check.install(checked, checked_module)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-6) for m in (plain_module, checked_module)}

    def step(model: torch.nn.Module, module: torch.nn.Module, read: bool) -> None:
        opt = opts[id(module)]
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if read:
            said = check.said()  # what the commit reads: the scans, one sync on a GPU
            check.clear()
            assert said.checked > 0 and not said.nonfinite
        opt.step()

    return {"ddp": lambda: step(plain, plain_module, False), "ddp+check": lambda: step(checked, checked_module, True)}


def _ratios(t: dict[str, dict[str, float]], pairs: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    return {
        f"{a}/{b}": {
            "p50": round(t[a]["p50_ms"] / t[b]["p50_ms"], 4),
            "min": round(t[a]["min_ms"] / t[b]["min_ms"], 4),
        }
        for a, b in pairs
    }


def end_rank() -> None:
    """A benchmark rank's end: a barrier, the group destroyed, out at once (no interpreter teardown)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def launch_two(script: str) -> int:
    """Runs ``script`` with this process's arguments on 2 ranks (ncclguard's launcher); its status."""
    from ncclguard.testing.launch import spawn

    res = spawn([sys.executable, script, *sys.argv[1:]], 2, timeout_s=1200, capture=False)
    return 0 if res.ok else 1


def _rank(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    doc: dict[str, Any] = {"sizes": {}}
    pairs = [("verify+check", "verify"), ("checked", "default"), ("scan", "plain")]
    for numel, iters, warmup in ((10**6, ns.iters_small, 20), (10**8, ns.iters_large, 2)):
        t = _times(_all_reduce_cases(numel), iters, warmup)
        if t is not None:
            doc["sizes"][f"{numel:.0e}"] = {"iters": iters, "ms": t, "ratios": _ratios(t, pairs)}
            print(f"{numel:.0e} elements:", json.dumps(doc["sizes"][f"{numel:.0e}"]), flush=True)
    if ns.ddp_iters:
        t = _times(_ddp_cases(), ns.ddp_iters, 2)
        if t is not None:
            doc["ddp_step"] = {"iters": ns.ddp_iters, "ms": t, "ratios": _ratios(t, [("ddp+check", "ddp")])}
            print("DDP step:", json.dumps(doc["ddp_step"]), flush=True)
    if dist.get_rank() == 0:
        doc["machine"] = {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "ranks": dist.get_world_size(),
            "threads_per_rank": 1,
            "loadavg_1min_after": round(os.getloadavg()[0], 2),
        }
        doc["command"] = " ".join([Path(sys.executable).name, "benchmarks/finite_check_cost.py", *sys.argv[1:]])
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
    end_rank()


def main() -> int:
    from ncclguard.testing.launch import under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters-small", type=int, default=200)
    ap.add_argument("--iters-large", type=int, default=8)
    ap.add_argument("--ddp-iters", type=int, default=10)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns)
    return launch_two(__file__)


if __name__ == "__main__":
    sys.exit(main())
