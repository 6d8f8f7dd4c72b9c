"""The straggler drill: does the watchdog name the right rank and the right cause, soon, and never a
healthy rank, on a loaded host?

Real gloo ranks (tests/workers/straggler_drill_worker.py), one per host of a star of network namespaces
(tests/netns.py: three hosts on a bridge, so that one host's link can be slowed with ``tc ... tbf``
while the others keep theirs), the watchdog at its straggler defaults but for ``--window-s``. Beside
the ranks, on the same 2 cores, the noise: ``--hogs`` Python busy loops; a burst of ``--burst-threads``
busy threads for 2 s out of every 5; and a busy neighbour, a process multiplying large matrices on
two threads with random pauses. Nothing is sent anywhere but between the namespaces.

- **Healthy launches** (``--healthy-min`` minutes in all): no slowdown; every straggler incident is a
  false one.
- **Drill launches**: after a healthy lead, episodes one after the other, each on a random rank, a
  random cause and factor, then a pause for the rank to recover: ``compute`` (its model takes
  ``(factor - 1)`` steps more), ``input`` (its data loader does), ``link`` (its host's link is
  rate-limited so that the all_reduce takes about as much more). An episode counts as **detected**
  when an incident names its rank (for a link, the rank's host) and its cause while it runs (or within
  one window after it ends, as the evidence lags); **windows to detection** is the number of the
  incident's last evidence window less that of the window the episode began in, plus one. Any other
  incident, in the healthy lead, in a pause, or naming another rank or cause, is a false one.

Every launch's raw windows and incidents are kept under ``--keep`` (replayable: the rules are pure).
Needs root (network namespaces), as the netns tests do.

Usage: python benchmarks/straggler_drill.py [--healthy-min 10] [--trials 20] [--factors 1.1 1.2 1.5]
       [--causes compute input link] [--window-s 4] [--json benchmarks/results/straggler_drill.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from netns import STAR_ADDRS, make_star, remove_star, run_star_ranks, slow_host, unslow_host  # noqa: E402

WORKER = TESTS / "workers" / "straggler_drill_worker.py"
BURST = "import threading,time\ndef spin(e):\n    while time.time() < e: pass\nwhile True:\n    e = time.time() + 2\n    ts = [threading.Thread(target=spin, args=(e,)) for _ in range({n})]\n    [t.start() for t in ts]; [t.join() for t in ts]\n    time.sleep(3)\n"
NEIGHBOUR = "import random,time,torch\ntorch.set_num_threads(2)\na=torch.randn(768,768)\nwhile True:\n    e=time.time()+random.uniform(0.5,3)\n    while time.time()<e: a=torch.tanh(a@a)\n    time.sleep(random.uniform(0.2,2))\n"


class Noise:
    """The load beside the ranks, started and stopped around each launch."""

    def __init__(self, hogs: int, burst_threads: int, neighbour: bool) -> None:
        self.specs = [["-c", "while True: pass"]] * hogs
        if burst_threads:
            self.specs.append(["-c", BURST.format(n=burst_threads)])
        if neighbour:
            self.specs.append(["-c", NEIGHBOUR])
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Noise:
        self.procs = [subprocess.Popen([sys.executable, *spec]) for spec in self.specs]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)


def link_rate(elements: int, hosts: int, extra_s: float) -> str:
    """The rate of a host's link that makes a ring all_reduce of ``elements`` float32 take ``extra_s``
    more: each link carries 2 (n - 1) / n of the data a step."""
    moved = 4 * elements * 2 * (hosts - 1) / hosts
    return f"{max(1, int(moved * 8 / max(extra_s, 1e-4) / 1000))}kbit"


def launch(star: Any, plan: dict[str, Any], noise: Noise, port: int, keep: Path, name: str) -> dict[str, Any]:
    """Runs one launch of the worker with ``plan`` beside the noise, applying link episodes from here."""
    out = Path(tempfile.mkdtemp(prefix=f"ncclguard-drill-{name}-"))
    (out / "plan.json").write_text(json.dumps(plan))
    links = [e for e in plan["episodes"] if e["cause"] == "link"]
    applied: list[dict[str, Any]] = []
    stop = threading.Event()

    def shape() -> None:
        while not stop.is_set() and not ((out / "t0").exists() and (out / "step_s").exists()):
            time.sleep(0.05)
        if stop.is_set():
            return
        t0, step_s = float((out / "t0").read_text()), float((out / "step_s").read_text())
        for e in links:
            if stop.wait(max(0.0, t0 + e["start"] - time.time())):
                return
            rate = link_rate(plan["elements"], len(star.hosts), (e["factor"] - 1) * step_s)
            slow_host(star, e["rank"], rate)
            applied.append({**e, "rate": rate, "at": time.time() - t0})
            stop.wait(max(0.0, t0 + e["end"] - time.time()))
            unslow_host(star, e["rank"])

    shaper = threading.Thread(target=shape, daemon=True)
    bound = plan["duration_s"] + 240
    with noise:
        shaper.start()
        t_start = time.monotonic()
        try:
            ranks = run_star_ranks(star, [sys.executable, str(WORKER), str(out / "plan.json")], out, port, bound)
        finally:
            stop.set()
            shaper.join(10)
            for h in range(len(star.hosts)):
                unslow_host(star, h)
        wall = time.monotonic() - t_start
    load = os.getloadavg()
    failed = [r for r in ranks if r.returncode != 0]
    if failed:
        tail = "\n".join(r.stderr[-3000:] for r in failed)
        (keep / f"{name}.failed.txt").parent.mkdir(parents=True, exist_ok=True)
        (keep / f"{name}.failed.txt").write_text(tail)
        return {"name": name, "plan": plan, "failed": tail[-1500:], "load": [round(x, 2) for x in load]}
    data = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(len(star.hosts))}
    docs = []
    for d in sorted(p for p in (out / "incidents").iterdir() if p.is_dir()) if (out / "incidents").exists() else []:
        docs.append(json.loads((d / "incident.json").read_text())["incident"])
    result = {"name": name, "plan": plan, "applied": applied, "ranks": data, "incidents": docs}
    result |= {"wall_s": round(wall, 1), "load": [round(x, 2) for x in load]}
    keep.mkdir(parents=True, exist_ok=True)
    (keep / f"{name}.json").write_text(json.dumps(result))
    return result


def named(doc: dict[str, Any], episode: dict[str, Any]) -> bool:
    """Whether an incident names the episode's rank (its host for a link) and its cause."""
    s = doc.get("straggler") or {}
    if s.get("cause") != episode["cause"]:
        return False
    if episode["cause"] == "link":
        return s.get("culprit") == f"host {STAR_ADDRS[episode['rank']]}"
    return s.get("rank") == episode["rank"]


def score(result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Each episode's outcome, the false incidents, and the healthy seconds the launch had."""
    plan, t0 = result["plan"], result["ranks"][0]["t0"]
    w = plan["window_s"]
    step_s = result["ranks"][0]["step_s"]
    starts = result["ranks"][0]["starts"]
    claimed: set[int] = set()
    outcomes = []
    for e in plan["episodes"]:
        n0 = int((t0 + e["start"]) // w)
        inside = [
            (i, d) for i, d in enumerate(result["incidents"]) if t0 + e["start"] <= d["created"] <= t0 + e["end"] + w
        ]
        hit = [(i, d) for i, d in inside if named(d, e)]
        # The step's slowdown as measured: its median in the episode (past its first window) over its
        # median in the three healthy windows before it (the host's load moves the step time).
        pairs = list(zip(starts, starts[1:], strict=False))
        gaps = [b - a for a, b in pairs if e["start"] + w <= a < e["end"]]
        before = [b - a for a, b in pairs if e["start"] - 3 * w <= a < e["start"]] or [step_s]
        slowed = statistics.median(gaps) / statistics.median(before) if gaps and before[0] else None
        out = {**e, "slowdown_measured": None if slowed is None else round(slowed, 3), "detected": bool(hit)}
        if hit:
            i, d = hit[0]
            claimed.add(i)
            last = max(ev["n"] for ev in d["straggler"]["windows"])
            out |= {"windows": last - n0 + 1, "seconds": round(d["created"] - t0 - e["start"], 1)}
            out["reported_slowdown"] = d["straggler"]["slowdown"]
        outcomes.append(out)
    # A later incident naming the same culprit and cause during the episode repeats it (another rank
    # raised it after a window without it): counted apart, neither a detection nor a false one.
    repeats = {
        i
        for e in plan["episodes"]
        for i, d in enumerate(result["incidents"])
        if i not in claimed and t0 + e["start"] <= d["created"] <= t0 + e["end"] + w and named(d, e)
    }
    false = [
        {"reason": d["reason"], "at": round(d["created"] - t0, 1), "repeat": i in repeats}
        for i, d in enumerate(result["incidents"])
        if i not in claimed
    ]
    # Healthy: the launch less each episode and the window after it (the evidence lags a window).
    healthy = plan["duration_s"] - sum(e["end"] - e["start"] + w for e in plan["episodes"])
    return outcomes, false, max(0.0, healthy)


def table(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cause in sorted({o["cause"] for o in outcomes}):
        for factor in sorted({o["factor"] for o in outcomes if o["cause"] == cause}):
            cell = [o for o in outcomes if o["cause"] == cause and o["factor"] == factor]
            hit = [o for o in cell if o["detected"]]
            win = sorted(o["windows"] for o in hit)
            measured = [o["slowdown_measured"] for o in cell if o["slowdown_measured"] is not None]
            rows.append(
                {
                    "cause": cause,
                    "factor": factor,
                    "episodes": len(cell),
                    "detected": len(hit),
                    "within_3_windows": sum(x <= 3 for x in win),
                    "windows_median": statistics.median(win) if win else None,
                    "windows_max": win[-1] if win else None,
                    "step_slowdown_measured_median": round(statistics.median(measured), 3) if measured else None,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--healthy-min", type=float, default=10.0, help="minutes of healthy launches")
    p.add_argument("--healthy-launch-s", type=float, default=200.0)
    p.add_argument("--trials", type=int, default=10, help="episodes per cause and factor")
    p.add_argument("--trials-1-2", type=int, default=20, help="episodes per cause at 1.2x (the target's factor)")
    p.add_argument("--factors", type=float, nargs="+", default=[1.1, 1.2, 1.5])
    p.add_argument("--causes", nargs="+", default=["compute", "input", "link"])
    p.add_argument("--per-launch", type=int, default=8, help="episodes per drill launch")
    p.add_argument("--window-s", type=float, default=4.0)
    p.add_argument("--episode-windows", type=int, default=5, help="an episode's length, in windows")
    p.add_argument("--pause-windows", type=int, default=4, help="the pause after an episode, in windows")
    p.add_argument("--mode", choices=("records", "ddp"), default="records")
    p.add_argument("--model-s", type=float, default=0.04)
    p.add_argument("--input-s", type=float, default=0.008)
    p.add_argument("--elements", type=int, default=262144)
    p.add_argument("--hogs", type=int, default=1)
    p.add_argument("--burst-threads", type=int, default=2)
    p.add_argument("--no-neighbour", action="store_true")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--keep", default=None, help="folder for every launch's raw data")
    p.add_argument("--json", default=str(HERE / "results" / "straggler_drill.json"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    keep = Path(args.keep or tempfile.mkdtemp(prefix="ncclguard-drill-raw-"))
    noise = Noise(args.hogs, args.burst_threads, not args.no_neighbour)
    w = args.window_s
    base = {
        "window_s": w,
        "mode": args.mode,
        "model_s": args.model_s,
        "input_s": args.input_s,
        "elements": args.elements,
    }
    cells = [
        (c, f) for c in args.causes for f in args.factors for _ in range(args.trials_1_2 if f == 1.2 else args.trials)
    ]
    rng.shuffle(cells)
    star = make_star(f"ncd{os.getpid() % 100000}")
    results: list[dict[str, Any]] = []
    t_begin = time.time()
    try:
        port = 29710
        healthy_left = args.healthy_min * 60
        k = 0
        while healthy_left > 0:
            dur = min(args.healthy_launch_s, max(60.0, healthy_left))
            plan = {**base, "duration_s": dur, "episodes": []}
            results.append(launch(star, plan, noise, port + k, keep, f"healthy{k}"))
            print(
                f"healthy{k}: {len(results[-1].get('incidents', []))} incidents, load {results[-1]['load']}", flush=True
            )
            healthy_left -= dur
            k += 1
        for j in range(0, len(cells), args.per_launch):
            t = 8 * w  # a healthy lead: the calibration and a baseline of windows
            episodes = []
            for cause, factor in cells[j : j + args.per_launch]:
                end = t + args.episode_windows * w
                episodes.append({"start": t, "end": end, "rank": rng.randrange(3), "cause": cause, "factor": factor})
                t = end + args.pause_windows * w
            plan = {**base, "duration_s": t, "episodes": episodes, "lead_s": 8 * w}
            results.append(launch(star, plan, noise, port + k, keep, f"drill{k}"))
            print(
                f"drill{k}: {len(results[-1].get('incidents', []))} incidents, load {results[-1]['load']}", flush=True
            )
            k += 1
    finally:
        remove_star(star)
    outcomes, false, healthy_s, loads = [], [], 0.0, []
    for r in results:
        loads.append(r["load"][0])
        if "failed" in r:
            continue
        o, f, h = score(r)
        outcomes += o
        false += [{**x, "launch": r["name"]} for x in f]
        healthy_s += h
    summary = {
        "command": "python benchmarks/straggler_drill.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "wall_min": round((time.time() - t_begin) / 60, 1),
        "load_1min_at_launch_ends": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "healthy_minutes": round(healthy_s / 60, 1),
        "launches": len(results),
        "failed_launches": [{"name": r["name"], "tail": r["failed"]} for r in results if "failed" in r],
        "false_incidents": [f for f in false if not f["repeat"]],
        "repeated_incidents": [f for f in false if f["repeat"]],
        "table": table(outcomes),
        "episodes": outcomes,
        "raw": str(keep),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "episodes"}, indent=1))


if __name__ == "__main__":
    main()
