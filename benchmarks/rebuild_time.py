"""How long from a failed world collective to the first good collective on the rebuilt world?

Cases (gloo, ranks on this host, launched with ncclguard's launcher):

- ``timeout``: the last rank skips a ``safe_all_reduce`` (deadline 1 s) and calls
  ``rebuild_world`` at once; the others, when their call has returned its ``CollectiveTimeout``,
  call ``rebuild_world`` and then ``dist.all_reduce``. Measured on those ranks: from the return of
  the failed call to the return of the first good all_reduce. Repeated ``--reps`` times per launch.
- ``kill``: the last rank dies by SIGKILL; the others' ``safe_all_reduce`` fails, then
  ``rebuild_world(timeout=2, allow_shrink=True)`` waits the 2 s for it and goes on without it.
- ``restart``: what a restart costs at the least: N fresh processes import torch and ncclguard,
  join a gloo group and run one all_reduce; measured from the launch to that all_reduce's return
  (no checkpoint to load, no launcher restart delay).

Usage: python benchmarks/rebuild_time.py [--reps 10] [--out benchmarks/results/rebuild_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

RESULT = "RESULT "


def _rank_timeout(reps: int) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import rebuild_world, safe_all_reduce, safe_barrier

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    samples = []
    for _ in range(reps):
        assert safe_barrier(timeout=30)
        failed_at = None
        if rank != size - 1:
            res = safe_all_reduce(torch.ones(4), timeout=1.0)
            assert not res.ok
            failed_at = time.monotonic()
        start = time.monotonic()
        rebuilt = rebuild_world(timeout=30)
        assert rebuilt.ok, rebuilt.error
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == size
        done = time.monotonic()
        if failed_at is not None:
            samples.append(
                {
                    "failure_to_good_s": done - failed_at,
                    "rebuild_s": rebuilt.elapsed_s,
                    "first_collective_s": done - start - rebuilt.elapsed_s,
                }
            )
    print(RESULT + json.dumps({"rank": rank, "samples": samples}), flush=True)
    os._exit(0)


def _rank_kill() -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import rebuild_world, safe_all_reduce

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(1))
    if rank == size - 1:
        os.kill(os.getpid(), 9)
    res = safe_all_reduce(torch.ones(4), timeout=1.0)
    assert not res.ok
    failed_at = time.monotonic()
    rebuilt = rebuild_world(timeout=2, allow_shrink=True)
    assert rebuilt.ok and rebuilt.world_size == size - 1, rebuilt
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == size - 1
    sample = {"failure_to_good_s": time.monotonic() - failed_at, "rebuild_s": rebuilt.elapsed_s}
    print(RESULT + json.dumps({"rank": rank, "samples": [sample]}), flush=True)
    os._exit(0)


def _rank_restart(launched_at: float) -> None:
    import torch
    import torch.distributed as dist

    import ncclguard  # noqa: F401 - a restarted job imports it too

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.ones(1)
    dist.all_reduce(t)
    sample = {"launch_to_good_s": time.time() - launched_at}
    print(RESULT + json.dumps({"rank": dist.get_rank(), "samples": [sample]}), flush=True)
    os._exit(0)


def _launch(case: str, nproc: int, *args: str, expect_dead: int | None = None) -> list[dict[str, Any]]:
    from ncclguard.testing.launch import spawn

    res = spawn([sys.executable, __file__, "--rank", case, *args], nproc, timeout_s=300)
    rows = res.json_lines()
    alive = [r for r in range(nproc) if r != expect_dead]
    if res.timed_out or sorted(rows) != alive:
        raise SystemExit(f"{case} on {nproc} ranks did not report:\n{res.output()[-4000:]}")
    # A sample per repetition: the slowest rank's (the world is usable when every rank is through).
    per_rank = [rows[r]["samples"] for r in alive if rows[r]["samples"]]
    return [
        {key: max(rank_samples[i][key] for rank_samples in per_rank) for key in per_rank[0][i]}
        for i in range(len(per_rank[0]))
    ]


def _summary(samples: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [s[key] for s in samples]
    return {
        "n": len(values),
        "median_s": statistics.median(values),
        "min_s": min(values),
        "max_s": max(values),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="repetitions of the timeout case per launch")
    ap.add_argument("--kills", type=int, default=3, help="launches of the kill case")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rebuild_time.json"))
    ns = ap.parse_args()

    import torch

    out: dict[str, Any] = {
        "command": "python benchmarks/rebuild_time.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg_before": os.getloadavg(),
        },
        "cases": {},
    }
    for nproc in (2, 3):
        samples = _launch("timeout", nproc, str(ns.reps))
        out["cases"][f"timeout_{nproc}_ranks"] = {
            "samples": samples,
            "failure_to_good": _summary(samples, "failure_to_good_s"),
            "rebuild": _summary(samples, "rebuild_s"),
            "first_collective": _summary(samples, "first_collective_s"),
        }
        kills = [s for _ in range(ns.kills) for s in _launch("kill", nproc + 1, expect_dead=nproc)]
        out["cases"][f"kill_{nproc + 1}_to_{nproc}_ranks"] = {
            "samples": kills,
            "failure_to_good": _summary(kills, "failure_to_good_s"),
        }
        restarts = [s for _ in range(3) for s in _launch("restart", nproc, repr(time.time()))]
        out["cases"][f"restart_{nproc}_ranks"] = {
            "samples": restarts,
            "launch_to_good": _summary(restarts, "launch_to_good_s"),
        }
    out["machine"]["loadavg_after"] = os.getloadavg()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, case in out["cases"].items():
        key = next(k for k in case if k != "samples")
        s = case[key]
        print(
            f"{name:24s} {key:16s} median {s['median_s'] * 1e3:8.1f} ms  "
            f"min {s['min_s'] * 1e3:8.1f}  max {s['max_s'] * 1e3:8.1f}  (n={s['n']})"
        )
    print(f"written to {ns.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        case = sys.argv[2]
        if case == "timeout":
            _rank_timeout(int(sys.argv[3]))
        elif case == "kill":
            _rank_kill()
        else:
            _rank_restart(float(sys.argv[3]))
    else:
        main()
