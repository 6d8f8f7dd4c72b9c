"""Where safe-atomic's time goes at 1e8 float32 elements (gloo, 2 ranks on this host), and two
ways to hide it that were measured and dropped.

    .venv/bin/python benchmarks/atomic_cost.py [--numel 1e8] [--iters 20]

``safe_all_reduce(atomic=True)`` copies each chunk into a private buffer (kept between calls)
as it issues it, reduces there, and copies the whole buffer back into the tensor once every
chunk completed: the tensor is written only after nothing can write into the buffer any more.
This times, interleaved per iteration: plain, safe, safe-atomic; the two copies alone (no
communication); and two alternatives that are exact too:

- ``swap``: 8 chunks; as chunk i completes, swap its slices of the tensor and the buffer (the
  buffer keeps the original, to restore on a later failure), so only the last chunk's swap is
  left after the last reduction;
- ``all_gather + add``: gloo reads the tensor and writes a 2x buffer (nothing writes into the
  tensor), then one local add writes the sum (2 ranks only).

Results go to ``benchmarks/results/atomic-cost.json`` and are quoted in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from pathlib import Path

from interleaved import p50_of_slowest

OUT = Path(__file__).resolve().parent / "results" / "atomic-cost.json"


def _rank(numel: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import safe_all_reduce
    from ncclguard.collectives.chunking import chunk_bounds
    from ncclguard.config import get_config

    dist.init_process_group("gloo")
    t = torch.ones(numel)
    reused = torch.empty_like(t)
    reused.fill_(0)  # touch every page once, as a long-lived buffer would be
    bounds = chunk_bounds(numel)
    inflight = get_config().max_inflight

    def reused_copies() -> None:
        reused.copy_(t)
        t.copy_(reused)

    step = -(-numel // 8)
    swap_bounds = [(a, min(a + step, numel)) for a in range(0, numel, step)]
    gathered = torch.empty(2 * numel)
    gathered.fill_(0)

    def swap_pipeline() -> None:
        pending: deque = deque()

        def swap(i: int) -> None:
            a, b = swap_bounds[i]
            keep = t[a:b].clone()
            t[a:b].copy_(reused[a:b])
            reused[a:b].copy_(keep)

        for i, (a, b) in enumerate(swap_bounds):
            if len(pending) >= inflight:
                j, work = pending.popleft()
                work.wait()
                swap(j)
            reused[a:b].copy_(t[a:b])
            pending.append((i, dist.all_reduce(reused[a:b], async_op=True)))
        while pending:
            j, work = pending.popleft()
            work.wait()
            swap(j)

    def gather_and_add() -> None:
        dist.all_gather_into_tensor(gathered, t)
        torch.add(gathered[:numel], gathered[numel:], out=t)

    cases = {
        "plain": lambda: dist.all_reduce(t),
        "safe": lambda: safe_all_reduce(t, timeout=600).raise_for_error(),
        "safe-atomic": lambda: safe_all_reduce(t, timeout=600, atomic=True).raise_for_error(),
        "copy in + copy back alone (no comm)": reused_copies,
        "alternative: swap pipeline, 8 chunks": swap_pipeline,
        "alternative: all_gather + local add": gather_and_add,
    }
    p50 = p50_of_slowest(cases, iters, warmup=2)
    if p50 is not None:
        names = list(p50)
        rows = [
            {"case": n, "p50_ms": round(p50[n] * 1e3, 2), "x_plain": round(p50[n] / p50["plain"], 3)} for n in names
        ]
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(
            json.dumps(
                {
                    "numel": numel,
                    "dtype": "float32",
                    "iters": iters,
                    "chunks": len(bounds),
                    "max_inflight": inflight,
                    "loadavg_1min_after": round(os.getloadavg()[0], 2),
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
        for r in rows:
            print(f"{r['case']:46s} p50 {r['p50_ms']:9.1f} ms  x{r['x_plain']:.2f}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    from ncclguard.bench.sizes import parse_numel
    from ncclguard.testing.launch import spawn, under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=parse_numel, default=100_000_000)
    ap.add_argument("--iters", type=int, default=20)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns.numel, ns.iters)
    res = spawn(
        [sys.executable, __file__, "--numel", str(ns.numel), "--iters", str(ns.iters)], 2, timeout_s=900, capture=False
    )
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
