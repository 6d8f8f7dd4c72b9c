"""Rank side of tests/test_netns_faults.py: one rank per network namespace, the store in A.

Usage: netfault_worker.py linkdown|slowlink. Each rank writes ``started.rank<r>`` into the test's
directory when it enters the large call, so the test can act on the link while the call runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

import ncclguard

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])


def _start() -> int:
    init = ncclguard.init_process_group("gloo", timeout=30)
    put("interface", init.plan.interface if init.plan else None)
    rank = dist.get_rank()
    ncclguard.start_watchdog(
        heartbeat_s=0.3, hang_timeout_s=1.5, peer_timeout_s=1.5, incident_dir=str(OUT / "incidents"), action="report"
    )
    warm = torch.ones(4)
    put("warm_ok", bool(ncclguard.safe_all_reduce(warm, timeout=10)) and warm.tolist() == [2.0] * 4)
    return rank


def _big_call(numel: int, chunk_numel: int, timeout: float) -> tuple[torch.Tensor, ncclguard.CollectiveResult, float]:
    rank = dist.get_rank()
    t = torch.full((numel,), float(rank + 1))
    (OUT / f"started.rank{rank}").write_text(str(time.time()))
    t0 = time.monotonic()
    res = ncclguard.safe_all_reduce(t, timeout=timeout, chunk_numel=chunk_numel)
    return t, res, time.monotonic() - t0


def linkdown() -> None:
    _start()
    _, res, took = _big_call(numel=12_000_000, chunk_numel=500_000, timeout=5.0)
    put("ok", bool(res))
    put("took_s", took)
    put("error_type", type(res.error).__name__ if res.error else None)
    put("error", str(res.error) if res.error else None)
    put("missing_ranks", getattr(res.error, "missing_ranks", None))
    put("chunk", list(res.error.chunk) if getattr(res.error, "chunk", None) else None)
    put("reduced_numel", res.reduced_numel)
    wd = ncclguard.current_watchdog()
    assert wd is not None
    seen = wd.wait_for_incident(timeout=6.0)
    put("incidents", [{"kind": i.get("kind"), "doc": i.get("doc")} for i in seen])
    rankkit.done()


def slowlink() -> None:
    _start()
    t, res, took = _big_call(numel=6_000_000, chunk_numel=500_000, timeout=20.0)
    put("ok", bool(res))
    put("took_s", took)
    put("exact", bool(res) and bool((t == 3.0).all()))
    put("chunks", res.chunks)
    rankkit.done()


if __name__ == "__main__":
    {"linkdown": linkdown, "slowlink": slowlink}[sys.argv[1]]()
