"""Two or more trees of ncclguard measured in one sitting, runs alternating (issue 29's comparisons).

    .venv/bin/python benchmarks/side_by_side.py --tree main=/tmp/main-ref --tree new=. \\
        [--rounds 4] [--what recording,ratio1,zero3] [--json benchmarks/results/side_by_side_29.json]

Each round runs every measurement once per tree, the trees' order alternating from round to round,
each run with the tree first on ``PYTHONPATH`` (so its ``ncclguard`` is the one imported; the scripts
are this checkout's, and work with any tree):

- ``recording``: ``benchmarks/recording_cost.py`` (gloo world of one): the verdict, the median over
  interleaved pairs of (instrumented - plain) around a real 1-element all_reduce, in us;
- ``ratio1``: ``python -m ncclguard.bench --nproc 2 --backend gloo --numel 1 --iters 3000 --modes
  plain safe``: safe / plain of the minima, of the 5th percentiles and of the medians;
- ``zero3``: ``benchmarks/zero3_step_cost.py``: the ZeRO-3 step's on/off ratio and its noise floor.

Every run's own ratio is side by side inside it (plain and guarded interleaved); the alternation
between trees only puts them under the same load. Each run's 1-minute load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WHAT = ("recording", "ratio1", "zero3")


def _run(cmd: list[str], tree: Path, timeout_s: float, ok: tuple[int, ...] = (0,)) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode not in ok:
        raise SystemExit(f"{cmd} in {tree} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _commit(tree: Path) -> str:
    """The tree's commit, which names it without a path of this machine (``git describe``'s form)."""
    proc = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def _command(trees: dict[str, str]) -> str:
    """This run's command line, each tree's path replaced by its name in capitals."""
    words = [Path(sys.executable).name, *sys.argv]
    for name, path in trees.items():
        words = [w.replace(f"{name}={path}", f"{name}={name.upper()}_TREE") for w in words]
    return " ".join(words)


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(what: str, tree: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One run of ``what`` with ``tree``'s ncclguard; its headline numbers."""
    py = sys.executable
    if what == "recording":
        # recording_cost.py exits 1 when over its budget: a result all the same
        _run(
            [py, str(HERE / "recording_cost.py"), "--pairs", str(args.pairs), "--json", str(out)], tree, 900, ok=(0, 1)
        )
        doc = json.loads(out.read_text())
        g = doc["gloo_world_of_one"]
        return {
            "verdict_us": doc["verdict_us"],
            "difference_of_minima_us": g["difference_of_minima_us"],
            "plain_p50_us": g["plain_p50_us"],
        }
    if what == "ratio1":
        cmd = [py, "-m", "ncclguard.bench", "--nproc", "2", "--backend", "gloo", "--numel", "1"]
        cmd += ["--iters", str(args.iters), "--warmup", "100", "--modes", "plain", "safe", "--json", str(out)]
        _run(cmd, tree, 1200)
        doc = json.loads(out.read_text())
        rows = {r["mode"]: r for r in doc["results"]}

        def iteration_times(mode: str) -> list[float]:
            per_rank = rows[mode]["rank_times_us"]
            return [max(t) for t in zip(*per_rank, strict=True)]

        plain, safe = iteration_times("plain"), iteration_times("safe")
        return {
            "min_ratio": min(safe) / min(plain),
            "p5_ratio": _percentile(safe, 0.05) / _percentile(plain, 0.05),
            "p50_ratio": statistics.median(safe) / statistics.median(plain),
            "plain_min_us": min(plain),
        }
    cmd = [py, str(HERE / "zero3_step_cost.py"), "--rounds", str(args.zero3_rounds), "--steps", str(args.zero3_steps)]
    _run([*cmd, "--json", str(out)], tree, 3600)
    got = json.loads(out.read_text())["analysis"]
    return {
        "on/off": got["on/off"]["median"],
        "off2/off": got["off2/off"]["median"],
        "on/off cpu": got["on/off cpu"]["median"],
        "collectives_per_step": got["backend_per_step"],
        "recorded_per_step": got["recorded_per_step"],
        "step_ms": got["step_s_off"] * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (twice or more)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--what", default="recording,ratio1", help=f"comma-separated, of {', '.join(WHAT)}")
    ap.add_argument("--pairs", type=int, default=20_000, help="recording_cost.py --pairs")
    ap.add_argument("--iters", type=int, default=3000, help="the 1-element bench's iterations")
    ap.add_argument("--zero3-rounds", type=int, default=6)
    ap.add_argument("--zero3-steps", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    whats = [w for w in args.what.split(",") if w]
    if len(trees) < 2 or any(w not in WHAT for w in whats) or args.rounds < 1:
        ap.error(f"two --tree NAME=PATH or more, --what of {WHAT}, --rounds >= 1")
    paths = {name: Path(p).resolve() for name, p in trees.items()}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            names = list(paths) if r % 2 == 0 else list(paths)[::-1]
            for what in whats:
                for name in names:
                    load = os.getloadavg()[0]
                    got = measure(what, paths[name], Path(tmp) / f"{what}-{name}-{r}.json", args)
                    row = {"round": r, "what": what, "tree": name, "load_1min": round(load, 2), **got}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    print()
    summary: dict[str, Any] = {}
    for what in whats:
        for name in paths:
            rows = [x for x in runs if x["what"] == what and x["tree"] == name]
            keys = [k for k in rows[0] if k not in ("round", "what", "tree", "load_1min")]
            summary[f"{what} {name}"] = {
                k: {
                    "median": statistics.median(x[k] for x in rows),
                    "min": min(x[k] for x in rows),
                    "max": max(x[k] for x in rows),
                }
                for k in keys
            }
            cells = ", ".join(
                f"{k} {v['median']:.4g} ({v['min']:.4g}..{v['max']:.4g})" for k, v in summary[f"{what} {name}"].items()
            )
            loads = [x["load_1min"] for x in rows]
            print(f"{what:9s} {name:6s} {cells}; load {min(loads):.2f}..{max(loads):.2f}")
    if args.json:
        doc = {"command": _command(trees), "trees": {name: _commit(path) for name, path in paths.items()}, "runs": runs}
        doc["summary"] = summary
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
