"""Demo act 1: safe_all_reduce on 2 ranks, then a stalled rank caught within its deadline."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

TITLE = "Act 1: guarded collectives (2 ranks, gloo): a healthy all_reduce, then a stalled rank caught"
DEADLINE_S = 2.0
STALL_S = 4.0


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import safe_all_reduce, safe_barrier

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    out: dict = {"rank": rank}
    t = torch.full((1_000_000,), float(rank + 1))
    res = safe_all_reduce(t, timeout=10)
    out["healthy"] = {"ok": res.ok, "value": t[0].item(), "elapsed_s": round(res.elapsed_s, 4), "chunks": res.chunks}
    safe_barrier(timeout=10)
    if rank == 1:
        time.sleep(STALL_S)  # rank 1 is "elsewhere": a long evaluation, a checkpoint save...
    start = time.monotonic()
    res = safe_all_reduce(torch.ones(4), timeout=DEADLINE_S)
    out["stall"] = {
        "ok": res.ok,
        "elapsed_s": round(time.monotonic() - start, 3),
        "error": str(res.error) if res.error else None,
        "missing": getattr(res.error, "missing_ranks", None),
    }
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the timed-out op is still queued in gloo; normal shutdown would wait on it


def run(args: argparse.Namespace) -> int:
    from ncclguard.testing.launch import spawn

    res = spawn([sys.executable, "-m", "ncclguard.cli.demo_collectives"], 2, timeout_s=60)
    results = res.json_lines()
    if res.timed_out or len(results) != 2:
        print("the demo ranks did not report:\n" + res.output()[-4000:])
        return 1
    h = results[0]["healthy"]
    print(
        f"healthy: safe_all_reduce of 1e6 x float32 on 2 ranks -> {h['value']} (1+2) in {h['elapsed_s'] * 1e3:.1f} ms, ok={h['ok']}"
    )
    s = results[0]["stall"]
    print(f"stall:   rank 1 sleeps {STALL_S:g} s before the collective; rank 0's deadline is {DEADLINE_S:g} s")
    print(f"         rank 0 returned after {s['elapsed_s']:.2f} s, ok={s['ok']}, missing ranks {s['missing']}")
    print(f"         error: {s['error']}")
    good = h["ok"] and h["value"] == 3.0 and not s["ok"] and s["missing"] == [1] and s["elapsed_s"] < DEADLINE_S + 1
    return 0 if good else 1


if __name__ == "__main__":
    _rank_main()
