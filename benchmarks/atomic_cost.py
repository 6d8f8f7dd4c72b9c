"""Where safe-atomic's time goes at 1e8 float32 elements (gloo, 2 ranks on this host).

    .venv/bin/python benchmarks/atomic_cost.py [--numel 1e8] [--iters 25]

``safe_all_reduce(atomic=True)`` reduces a private copy (``tensor.contiguous().clone()``) and
copies it back when every chunk completed. This times, interleaved per iteration, the real
calls and the pieces: the fresh private copy and its copy-back alone (no communication), the
same two copies into a buffer allocated once, and an emulated atomic call on such a reused
buffer (same chunks, same in-flight bound as ncclguard's policy). Results go to
``benchmarks/results/atomic-cost.json`` and are quoted in benchmarks/README.md.
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

    from ncclguard import get_config, safe_all_reduce
    from ncclguard.collectives.chunking import chunk_bounds

    dist.init_process_group("gloo")
    t = torch.ones(numel)
    reused = torch.empty_like(t)
    reused.fill_(0)  # touch every page once, as a long-lived buffer would be
    bounds = chunk_bounds(numel)
    inflight = get_config().max_inflight

    def reduce_chunks(buf: torch.Tensor) -> None:
        pending: deque = deque()
        for a, b in bounds:
            if len(pending) >= inflight:
                pending.popleft().wait()
            pending.append(dist.all_reduce(buf[a:b], async_op=True))
        while pending:
            pending.popleft().wait()

    def fresh_copies() -> None:
        private = t.contiguous().clone()
        t.copy_(private)

    def reused_copies() -> None:
        reused.copy_(t)
        t.copy_(reused)

    def atomic_on_reused_buffer() -> None:
        reused.copy_(t)
        reduce_chunks(reused)
        t.copy_(reused)

    cases = {
        "plain": lambda: dist.all_reduce(t),
        "safe": lambda: safe_all_reduce(t, timeout=600).raise_for_error(),
        "safe, one chunk": lambda: safe_all_reduce(t, timeout=600, chunk_numel=numel).raise_for_error(),
        "safe-atomic": lambda: safe_all_reduce(t, timeout=600, atomic=True).raise_for_error(),
        "fresh private copy + copy-back (no comm)": fresh_copies,
        "reused buffer: copy in + copy-back (no comm)": reused_copies,
        "atomic emulated on a reused buffer": atomic_on_reused_buffer,
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
    ap.add_argument("--iters", type=int, default=25)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns.numel, ns.iters)
    res = spawn(
        [sys.executable, __file__, "--numel", str(ns.numel), "--iters", str(ns.iters)], 2, timeout_s=900, capture=False
    )
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
