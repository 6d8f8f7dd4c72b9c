"""Where the guarded call's fixed cost goes at 1 element (gloo, 2 ranks on this host).

    .venv/bin/python benchmarks/small_call_cost.py [--iters 1500]

Times, interleaved per iteration after a barrier, steps from a plain synchronous
``dist.all_reduce`` towards ``safe_all_reduce``: the same op issued asynchronously and waited on
with a deadline, then on a view of the tensor (what the chunk loop passes), then ncclguard's
chunk loop alone (``ncclguard.collectives.wire.run_chunks``, internal: this is a diagnosis, not an
API), then the whole call. Results: ``benchmarks/results/small-call-cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from interleaved import p50_of_slowest

OUT = Path(__file__).resolve().parent / "results" / "small-call-cost.json"


def _rank(iters: int) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard.collectives.all_reduce import safe_all_reduce
    from ncclguard.collectives.groups import group_info
    from ncclguard.collectives.wire import run_chunks

    dist.init_process_group("gloo")
    t = torch.ones(1)
    flat = t.view(-1)
    wait = timedelta(seconds=60)
    info = group_info()
    cases = {
        "dist.all_reduce(t)": lambda: dist.all_reduce(t),
        "dist.all_reduce(t, async_op=True).wait(timeout)": lambda: dist.all_reduce(t, async_op=True).wait(timeout=wait),
        "the same on a view t.view(-1)[0:1]": lambda: dist.all_reduce(flat[0:1], async_op=True).wait(timeout=wait),
        "ncclguard's chunk loop (run_chunks)": lambda: run_chunks(
            info, t, dist.ReduceOp.SUM, [(0, 1)], time.monotonic() + 60, False
        ),
        "safe_all_reduce(t)": lambda: safe_all_reduce(t, timeout=60),
    }
    p50 = p50_of_slowest(cases, iters, warmup=50)
    if p50 is not None:
        names = list(p50)
        rows = [
            {"case": n, "p50_us": round(p50[n] * 1e6, 1), "x_plain": round(p50[n] / p50[names[0]], 3)} for n in names
        ]
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(
            json.dumps(
                {"numel": 1, "iters": iters, "loadavg_1min_after": round(os.getloadavg()[0], 2), "rows": rows}, indent=1
            )
            + "\n"
        )
        for r in rows:
            print(f"{r['case']:50s} p50 {r['p50_us']:7.1f} us  x{r['x_plain']:.2f}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    from ncclguard.testing.launch import spawn, under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1500)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns.iters)
    res = spawn([sys.executable, __file__, "--iters", str(ns.iters)], 2, timeout_s=600, capture=False)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
