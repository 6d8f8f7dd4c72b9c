"""How much a healthy rank's compute varies against its peers' on a loaded host, with and without its
run delay (the time it was runnable but got no CPU), window by window.

Runs tests/workers/straggler_worker.py (3 gloo ranks, every rank the same work, the watchdog at its
straggler defaults but for ``--window-s``) for ``--healthy-s`` seconds beside ``--busy`` Python busy loops,
and reads back every window each rank closed. Per window, over the ranks: the largest slowdown of one
rank against its peers' median, of the wall-clock compute share (the rule before run delays were told)
and of the compute share less the run delay (the rule now); also over 2 and 5 windows pooled. The
worker stops at the first straggler incident (a false one: nobody is slower), which is reported.

Usage: python benchmarks/straggler_noise.py [--healthy-s 100] [--window-s 2] [--compute matmul]
       [--busy 2] [--json benchmarks/results/straggler_noise.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ncclguard.testing.launch import spawn

HERE = Path(__file__).resolve().parent
WORKERS = HERE.parent / "tests" / "workers"


def worst(shares: dict[int, float]) -> float:
    """The largest share of one rank over the median of the others'."""
    out = 0.0
    for r, v in shares.items():
        ref = statistics.median(x for q, x in shares.items() if q != r)
        out = max(out, v / ref if ref > 0 else 0.0)
    return out


def analyse(windows: dict[int, list[dict[str, Any]]], pool: int) -> dict[str, Any]:
    """Over every run of ``pool`` consecutive windows all ranks closed: the worst slowdowns."""
    by = {r: {w["n"]: w for w in ws} for r, ws in windows.items()}
    common = sorted(set.intersection(*(set(v) for v in by.values())))
    raw, less = [], []
    for i in range(len(common) - pool + 1):
        group = common[i : i + pool]

        def share(r: int, delay: bool, group: list[int] = group) -> float:
            wins = [by[r][n] for n in group]
            busy = sum(w["compute_s"] - ((w["run_delay_s"] or 0.0) if delay else 0.0) for w in wins)
            return max(0.0, busy) / sum(w["length_s"] for w in wins)

        raw.append(worst({r: share(r, False) for r in by}))
        less.append(worst({r: share(r, True) for r in by}))
    if not raw:
        return {"runs": 0}
    q = sorted(raw), sorted(less)
    return {
        "runs": len(raw),
        "wall_clock_max": round(q[0][-1], 3),
        "wall_clock_p90": round(q[0][int(0.9 * (len(raw) - 1))], 3),
        "less_run_delay_max": round(q[1][-1], 3),
        "less_run_delay_p90": round(q[1][int(0.9 * (len(less) - 1))], 3),
        "over_1_15_wall_clock": sum(x >= 1.15 for x in raw),
        "over_1_15_less_run_delay": sum(x >= 1.15 for x in less),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--healthy-s", type=float, default=100.0)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--compute", choices=("matmul", "sleep", "mixed"), default="matmul")
    p.add_argument("--busy", type=int, default=2, help="Python busy loops beside the ranks")
    p.add_argument("--json", default=str(HERE / "results" / "straggler_noise.json"))
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="ncclguard-straggler-noise-"))
    bound = args.healthy_s + 200
    busy = [
        subprocess.Popen(["timeout", str(int(bound)), sys.executable, "-c", "while True: pass"])
        for _ in range(args.busy)
    ]
    try:
        env = {"NCCLGUARD_TEST_OUT": str(out), "PYTHONPATH": str(WORKERS), "PYTHONUNBUFFERED": "1"}
        argv = [str(args.healthy_s), "-1", "1", "1", args.compute, str(args.window_s)]
        t0 = time.monotonic()
        res = spawn([sys.executable, str(WORKERS / "straggler_worker.py"), *argv], 3, timeout_s=bound, env=env)
        wall = time.monotonic() - t0
        load = os.getloadavg()
    finally:
        for b in busy:
            b.terminate()  # timeout passes SIGTERM on to the loop (a SIGKILL would orphan it)
            b.wait(10)
    if res.timed_out or any(r.returncode != 0 for r in res.ranks):
        raise SystemExit(f"the ranks failed:\n{res.output()[-6000:]}")
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(3)}
    windows = {r: ranks[r]["windows"] for r in ranks}
    incidents = [c["doc"]["reason"] for c in ranks[0]["incidents"] if c.get("doc")]
    delay = [w["run_delay_s"] / w["length_s"] for ws in windows.values() for w in ws if w["run_delay_s"] is not None]
    result = {
        "command": f"python benchmarks/straggler_noise.py --healthy-s {args.healthy_s} --window-s {args.window_s} "
        f"--compute {args.compute} --busy {args.busy}",
        "cpus": os.cpu_count(),
        "load_at_end": [round(x, 2) for x in load],
        "wall_s": round(wall, 1),
        "windows_per_rank": [len(w) for w in windows.values()],
        "run_delay_share_median": round(statistics.median(delay), 3) if delay else None,
        "false_incidents": incidents,
        "per_window": analyse(windows, 1),
        "pooled_2_windows": analyse(windows, 2),
        "pooled_5_windows": analyse(windows, 5),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
