"""What switching ncclguard on without a code change costs at start-up: ``ncclguard run`` and
``NCCLGUARD_AUTO=1 torchrun`` against a plain ``torchrun``, the same job each time.

The job (written to a temporary directory) imports torch, makes the default group
(``init_process_group("gloo")``), runs one ``barrier`` and exits: nothing but start-up. Per launch:

- ``job_s``: from the launcher's start to its exit (the whole job, as a user waits for it);
- ``ready_s``: from the launcher's start to rank 0 past ``init_process_group`` and the barrier (when
  training could start);
- ``init_s``: rank 0's ``init_process_group`` alone (under ncclguard: the watchdog's start with it).

The three variants run interleaved, in a rotating order, ``--rounds`` times, so that the load of a
shared machine lands on all of them alike; medians are reported, with the median of the per-round
differences to plain torchrun. Also timed: the ``.pth`` line every Python process runs at start-up,
with ``NCCLGUARD_AUTO`` unset.

    .venv/bin/python benchmarks/startup_cost.py --rounds 9 --json benchmarks/results/startup_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = """\
import os, sys, time
import torch
import torch.distributed as dist
t = time.time()
dist.init_process_group("gloo")
init_s = time.time() - t
dist.barrier()
if dist.get_rank() == 0:
    print("READY", time.time(), init_s, flush=True)
dist.destroy_process_group()
"""
VARIANTS = ("torchrun", "ncclguard run", "NCCLGUARD_AUTO=1 torchrun")


def command(variant: str, job: Path, nproc: int) -> tuple[list[str], dict[str, str]]:
    """The launch command and its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCLGUARD")}
    common = ["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.1"]
    if variant == "ncclguard run":
        return [sys.executable, "-m", "ncclguard", "run", *common, str(job)], env
    if variant == "NCCLGUARD_AUTO=1 torchrun":
        env["NCCLGUARD_AUTO"] = "1"
    return [sys.executable, "-m", "torch.distributed.run", *common, str(job)], env


def launch(variant: str, job: Path, nproc: int, cwd: Path) -> dict[str, float]:
    """One launch: its job_s, ready_s and init_s."""
    cmd, env = command(variant, job, nproc)
    start = time.time()
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    job_s = time.time() - start
    if out.returncode != 0:
        raise RuntimeError(f"{variant} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("READY ")]
    _, ready_at, init_s = line.split()
    return {"job_s": job_s, "ready_s": float(ready_at) - start, "init_s": float(init_s)}


def pth_line_ns() -> float:
    """Nanoseconds the .pth line takes with NCCLGUARD_AUTO unset (what every process pays)."""
    line = (REPO / "autostart" / "ncclguard-autostart.pth").read_text().strip()
    saved = os.environ.pop("NCCLGUARD_AUTO", None)
    try:
        n = 200_000
        return min(timeit.repeat(line, number=n, repeat=5)) / n * 1e9
    finally:
        if saved is not None:
            os.environ["NCCLGUARD_AUTO"] = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9, help="launches of each variant (default 9)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per launch (default 2)")
    ap.add_argument("--json", type=Path, help="write the raw times and the medians here")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    load = []
    with tempfile.TemporaryDirectory(prefix="ncclguard-startup-") as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        launch("torchrun", job, args.nproc, Path(tmp))  # warm the page cache: not counted
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                runs[variant].append(launch(variant, job, args.nproc, Path(tmp)))
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {runs[v][-1]['job_s']:.2f} s" for v in VARIANTS))
    summary: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        summary[variant] = {k: statistics.median(x[k] for x in runs[variant]) for k in ("job_s", "ready_s", "init_s")}
        if variant != "torchrun":
            for k in ("job_s", "ready_s", "init_s"):
                diffs = [a[k] - b[k] for a, b in zip(runs[variant], runs["torchrun"], strict=True)]
                summary[variant][f"{k}_minus_torchrun"] = statistics.median(diffs)
    pth_ns = pth_line_ns()
    print(f"\n{args.rounds} rounds, {args.nproc} ranks, load average {min(load):.1f}-{max(load):.1f}; medians, s")
    print(f"{'':28} {'job_s':>8} {'ready_s':>8} {'init_s':>8}   minus torchrun (median of per-round differences)")
    for variant in VARIANTS:
        s = summary[variant]
        extra = ""
        if variant != "torchrun":
            extra = "   " + "  ".join(f"{k} {s[f'{k}_minus_torchrun']:+.2f}" for k in ("job_s", "ready_s", "init_s"))
        print(f"{variant:28} {s['job_s']:8.2f} {s['ready_s']:8.2f} {s['init_s']:8.3f}{extra}")
    print(f"the .pth line with NCCLGUARD_AUTO unset: {pth_ns:.0f} ns per process")
    if args.json is not None:
        record = {
            "command": " ".join(["python", "benchmarks/startup_cost.py", *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_1m": load},
            "nproc": args.nproc,
            "rounds": args.rounds,
            "medians": summary,
            "pth_line_unset_ns": pth_ns,
            "runs": runs,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
