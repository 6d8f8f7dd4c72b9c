"""What the check for NaN and Inf costs a DeepSpeed ZeRO step (gloo, 2 ranks on this host, CPU), side by side in one run.

    .venv/bin/python benchmarks/deepspeed_check_cost.py [--iters 10] [--stage 2]

Two engines of the same 25.2M-parameter MLP (3 x Linear(2048, 4096)-sized layers, batch 16, AdamW,
``deepspeed.initialize`` with ZeRO ``--stage``): ``zero`` is DeepSpeed's own step (forward,
``engine.backward``, ``engine.step()``); ``zero+check`` carries the check ``CommittedEngineStep`` puts
on each parameter with ``on_nonfinite`` set (``ncclguard/recovery/_numerics/param_check.py``: one
scan of each gradient as autograd hands it over, before ZeRO reduces it), and reads the scans after
the backward, as the commit reads them. Every iteration runs both once, in a rotating order, after a
barrier; an iteration's time is the slowest rank's; the table gives the median (p50) and the minimum
over iterations and the ratio of the two.

Results: ``benchmarks/results/deepspeed_check_cost_zero<stage>.json``; docs/numerics.md quotes them.
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

from finite_check_cost import _ratios, _times, end_rank, launch_two

RESULTS = Path(__file__).resolve().parent / "results"


def _cases(stage: int) -> dict[str, Callable[[], object]]:
    import deepspeed
    import torch

    from ncclguard.recovery._numerics import param_check
    from ncclguard.recovery._numerics.hook import GradCheck

    def engine() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 4096),
        )  # fmt: skip
        config = {
            "train_micro_batch_size_per_gpu": 16,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 1_000_000,
        }
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return eng

    x = torch.randn(16, 2048)
    plain, checked = engine(), engine()
    check = GradCheck()
    assert param_check.install(check, checked.module) == 6

    def step(eng: Any, read: bool) -> None:
        eng.backward(eng(x).square().mean())
        if read:
            said = check.said()  # what the commit reads: the scans, one sync on a GPU
            check.clear()
            assert said.checked == 6 and not said.nonfinite
        eng.step()

    return {"zero": lambda: step(plain, False), "zero+check": lambda: step(checked, True)}


def _rank(ns: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    t = _times(_cases(ns.stage), ns.iters, 2)
    if t is not None:
        doc: dict[str, Any] = {
            "stage": ns.stage,
            "iters": ns.iters,
            "ms": t,
            "ratios": _ratios(t, [("zero+check", "zero")]),
            "machine": {
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__,
                "python": platform.python_version(),
                "ranks": dist.get_world_size(),
                "threads_per_rank": 1,
                "loadavg_1min_after": round(os.getloadavg()[0], 2),
            },
            "command": " ".join([Path(sys.executable).name, "benchmarks/deepspeed_check_cost.py", *sys.argv[1:]]),
        }
        print("ZeRO step:", json.dumps(doc), flush=True)
        out = RESULTS / f"deepspeed_check_cost_zero{ns.stage}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    end_rank()


def main() -> int:
    from ncclguard.testing.launch import under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns)
    return launch_two(__file__)


if __name__ == "__main__":
    sys.exit(main())
