"""What the watchdog plus instrument() cost a real training loop: step time with and without.

Issue 13's target: at most 1% of step time (DDP and DeepSpeed ZeRO-2, small model, CPU). For each
stack it launches 2 gloo ranks of ``watchdog_cost_worker.py`` (a tiny GPT-2 built from a config),
which train in blocks of steps; every round runs one block per mode, in the order of a row of a
Williams Latin square (each mode takes each place and follows each other mode equally often):

- ``off``, ``off2``: no ncclguard at all. ``off2 / off`` is the noise floor: a "difference"
  that only the machine makes;
- ``wd5``, ``wd0.2``, ...: ``instrument()`` + ``start_watchdog(heartbeat_s=H)`` + every step in
  ``phase("train", step=i)`` (default: WatchdogConfig's default heartbeat and 0.2 s).

The verdict is by CPU, which other jobs on the machine disturb far less than wall time:

1. Idle blocks (training paused, ``--idle-rounds`` rounds of one block per mode, each a whole
   number of heartbeats): the extra process CPU per second over ``off`` in the same round is the
   watchdog's whole cost (its thread, the helper thread of its store calls, the store server in
   rank 0). The watchdog runs on the clock, not per step, so its share of a step is that cost over
   the CPU a step gets: with one core per rank (the verdict), and at the share this run got.
2. Paired CPU ratio: process CPU per step of both ranks in each watchdog block over the same
   round's baseline (geometric mean of its ``off`` and ``off2`` blocks); the geometric mean of
   those ratios over rounds, with a 95% bootstrap interval (rounds resampled), read against the
   interval of ``off2 / off``.
3. The same paired ratio of the median step wall time, reported with its noise floor.

The watchdog thread's own CPU time is read from its POSIX thread clock.

Usage: python benchmarks/watchdog_cost.py [--stacks ddp,deepspeed] [--heartbeats 5,0.2]
       [--rounds 8] [--steps 20] [--json benchmarks/results/watchdog_cost.json] [--raw-json PATH]
       python benchmarks/watchdog_cost.py --from-json PATH  (re-analyse a --raw-json file)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncclguard.testing.launch import spawn
from ncclguard.watching.base.settings import WatchdogConfig

HERE = Path(__file__).resolve().parent
WORKER = HERE / "watchdog_cost_worker.py"
TARGET = 1.01  # issue 13: the watchdog plus instrument cost at most 1% of step time
BASELINES = ("off", "off2")
DEFAULT_HEARTBEAT_S = float(WatchdogConfig.model_fields["heartbeat_s"].default)


# ----------------------------------------------------------------------------- pure statistics


def geomean(xs: Sequence[float]) -> float:
    """Geometric mean of positive numbers."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def bootstrap_ci(xs: Sequence[float], n: int = 4000, seed: int = 13) -> tuple[float, float]:
    """95% percentile interval of the geometric mean of ``xs`` (resampled with replacement)."""
    rng = random.Random(seed)
    means = sorted(geomean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return means[int(0.025 * n)], means[min(int(0.975 * n), n - 1)]


def block_value(block: dict[str, Any], metric: str) -> float:
    """One block's figure: ``step`` (median step wall time, s) or ``cpu`` (process CPU s per step)."""
    if metric == "step":
        return statistics.median(block["step_s"])
    if metric == "cpu":
        return block["proc_cpu_s"] / len(block["step_s"])
    raise ValueError(f"unknown metric {metric!r}: use 'step' or 'cpu'")


def table(ranks: Sequence[dict[str, Any]], metric: str) -> dict[tuple[int, str], float]:
    """(round, mode) -> the block figure, combined over ranks (step: mean; cpu: sum)."""
    out: dict[tuple[int, str], list[float]] = {}
    for res in ranks:
        for b in res["blocks"]:
            out.setdefault((b["round"], b["mode"]), []).append(block_value(b, metric))
    combine = statistics.fmean if metric == "step" else sum
    return {k: combine(v) for k, v in out.items()}


def paired_ratios(tab: dict[tuple[int, str], float], mode: str) -> list[float]:
    """Per round: ``mode``'s figure over the round's baseline (``off2`` is compared with ``off``;
    a watchdog mode with the geometric mean of ``off`` and ``off2``)."""
    rounds = sorted({r for r, _ in tab})
    out = []
    for r in rounds:
        if mode == "off2":
            base = tab[(r, "off")]
        else:
            base = geomean([tab[(r, m)] for m in BASELINES])
        out.append(tab[(r, mode)] / base)
    return out


def summarize(tab: dict[tuple[int, str], float], mode: str, boot: int) -> dict[str, Any]:
    """The ratio of ``mode`` to the baseline: paired estimate, its interval, median, min-of-blocks."""
    ratios = paired_ratios(tab, mode)
    lo, hi = bootstrap_ci(ratios, boot)
    base_modes = ("off",) if mode == "off2" else BASELINES
    base_min = min(v for (_, m), v in tab.items() if m in base_modes)
    mode_vals = [v for (_, m), v in tab.items() if m == mode]
    return {
        "ratio": round(geomean(ratios), 4),
        "ci95": [round(lo, 4), round(hi, 4)],
        "median_of_ratios": round(statistics.median(ratios), 4),
        "min_of_blocks_ratio": round(min(mode_vals) / base_min, 4),
        "ratio_p10_p90": [round(q, 4) for q in quantiles(ratios, (0.1, 0.9))],
        "per_round": [round(x, 4) for x in ratios],
    }


def quantiles(xs: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Nearest-rank quantiles (simple and exact for small samples)."""
    s = sorted(xs)
    return [s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] for q in qs]


def verdict(ci: Sequence[float], floor: Sequence[float]) -> str:
    """Reads a ratio's interval against the 1% target, when the noise floor (the interval of
    ``off2 / off``, a ratio that should be 1) is narrow enough to tell 1% at all."""
    lo, hi = ci
    width = (floor[1] - floor[0]) / 2
    if width > TARGET - 1:
        return f"not resolved: the noise floor (off2/off) is +/-{100 * width:.1f}%, wider than the 1% to tell"
    if hi <= TARGET:
        return "within 1% (the whole interval)"
    if lo > TARGET:
        return "over 1% (the whole interval)"
    return f"not resolved: the interval straddles +1% (noise floor +/-{100 * width:.1f}%)"


def watchdog_thread_stats(ranks: Sequence[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The watchdog thread's CPU over all of ``mode``'s blocks, per rank-second and per step."""
    hb = float(mode[2:])
    poll = min(hb / 5, 0.5)  # the loop's tick (ncclguard/watching/watchdog.py, Watchdog._run)
    cpu = wall = steps = calls = 0.0
    for res in ranks:
        for b in res["blocks"]:
            if b["mode"] == mode and b["wd_cpu_s"] is not None:
                cpu += b["wd_cpu_s"]
                wall += b["wall_s"]
                steps += len(b["step_s"])
                calls += b["recorded_calls"]
    frac = cpu / wall if wall else float("nan")
    return {
        "heartbeat_s": hb,
        "tick_s": poll,
        "thread_cpu_percent_of_a_core": round(100 * frac, 3),
        "thread_cpu_us_per_tick": round(1e6 * frac * poll, 1),
        "thread_cpu_us_per_heartbeat_period": round(1e6 * frac * hb, 1),
        "thread_cpu_ms_per_step": round(1e3 * cpu / steps, 3) if steps else None,
        "recorded_collectives_per_step": round(calls / steps, 2) if steps else None,
    }


def idle_stats(ranks: Sequence[dict[str, Any]], train_cores: float) -> dict[str, Any]:
    """The watchdog's whole CPU cost with training paused: process CPU of both ranks per second,
    over the same without a watchdog, in the same idle round.

    Args:
        ranks: the ranks' results.
        train_cores: CPU-seconds per second both ranks spent training in the ``off`` blocks (the
            share of the machine they got in this run).

    Returns:
        Per watchdog mode the extra CPU (mean over idle rounds, and the rounds' lowest and highest),
        and what it comes to as step time in a job that keeps its CPUs busy: ``extra / ranks`` with
        one core per rank to itself, ``extra / train_cores`` at this run's share (the watchdog runs
        on the clock, so its share of a step grows as the share of the machine a job gets shrinks).
    """
    rate: dict[tuple[int, str], float] = {}  # (idle round, mode) -> CPU cores, both ranks summed
    thread: dict[str, list[float]] = {}
    for res in ranks:
        per_round = len({b["mode"] for b in res["idle"]})  # older results carry no round: one block per mode each
        for i, b in enumerate(res["idle"]):
            key = (b.get("round", i // per_round), b["mode"])
            rate[key] = rate.get(key, 0.0) + b["proc_cpu_s"] / b["wall_s"]
            if b["wd_cpu_s"] is not None:
                thread.setdefault(b["mode"], []).append(b["wd_cpu_s"] / b["wall_s"])
    rounds = sorted({r for r, m in rate if m == "off"})
    if not rounds:
        return {}
    n = len(ranks)
    out: dict[str, Any] = {
        "rounds": len(rounds),
        "off_cpu_cores_both_ranks": round(statistics.fmean(rate[(r, "off")] for r in rounds), 5),
        "train_cpu_cores_both_ranks": round(train_cores, 3),
    }
    for mode in sorted({m for _, m in rate if m.startswith("wd")}, key=lambda m: -float(m[2:])):
        hb = float(mode[2:])
        tick = min(hb / 5, 0.5)  # the loop's tick (ncclguard/watching/watchdog.py, Watchdog._run)
        extras = [rate[(r, mode)] - rate[(r, "off")] for r in rounds if (r, mode) in rate]
        extra = statistics.fmean(extras)
        out[mode] = {
            "extra_cpu_percent_of_a_core_both_ranks": round(100 * extra, 3),
            "extra_cpu_percent_per_round_min_max": [round(100 * min(extras), 3), round(100 * max(extras), 3)],
            "extra_cpu_us_per_tick_per_rank": round(1e6 * extra / n * tick, 1),
            "watchdog_thread_cpu_us_per_tick": round(1e6 * statistics.fmean(thread.get(mode, [math.nan])) * tick, 1),
            "step_overhead_percent_one_core_per_rank": round(100 * extra / n, 3),
            "step_overhead_percent_one_core_per_rank_min_max": [
                round(100 * min(extras) / n, 3),
                round(100 * max(extras) / n, 3),
            ],
            "step_overhead_percent_at_this_runs_share": round(100 * extra / train_cores, 3) if train_cores else None,
        }
    return out


def overall(idle: dict[str, Any] | None, cpu: dict[str, Any], cpu_floor: Sequence[float]) -> str:
    """The verdict on the 1% target, by CPU: the idle method (the watchdog's whole CPU per second
    over a core per rank) first, checked against the paired CPU ratio and its noise floor."""
    if not idle:
        return "no idle blocks: run with --idle-s > 0"
    pct, (lo, hi) = (
        idle["step_overhead_percent_one_core_per_rank"],
        idle["step_overhead_percent_one_core_per_rank_min_max"],
    )
    head = f"{pct:.2f}% of step time with a core per rank (idle rounds {lo:.2f}-{hi:.2f}%)"
    ratio_text = verdict(cpu["ci95"], cpu_floor)
    ratio = f"paired CPU ratio {cpu['ratio']:.4f} [{cpu['ci95'][0]:.4f}, {cpu['ci95'][1]:.4f}]: {ratio_text}"
    if hi <= 100 * (TARGET - 1):
        return f"within 1%: {head}; {ratio}"
    if lo > 100 * (TARGET - 1):
        return f"over 1% by {pct - 100 * (TARGET - 1):.2f} points: {head}; {ratio}"
    return f"at the 1% line: {head}; {ratio}"


def analyse(ranks: Sequence[dict[str, Any]], boot: int) -> dict[str, Any]:
    """Everything the report says about one stack's run."""
    modes = ranks[0]["modes"]
    out: dict[str, Any] = {"modes": modes, "params": ranks[0]["params"], "warmup": ranks[0]["warmup"]}
    per_mode: dict[str, Any] = {}
    for mode in modes:
        steps = [s for res in ranks for b in res["blocks"] if b["mode"] == mode for s in b["step_s"]]
        cpu = [block_value(b, "cpu") for res in ranks for b in res["blocks"] if b["mode"] == mode]
        p10, p90 = quantiles(steps, (0.1, 0.9))
        per_mode[mode] = {
            "steps": len(steps),
            "step_ms_p50": round(1e3 * statistics.median(steps), 3),
            "step_ms_p10": round(1e3 * p10, 3),
            "step_ms_p90": round(1e3 * p90, 3),
            "step_ms_min": round(1e3 * min(steps), 3),
            "cpu_ms_per_step_per_rank_p50": round(1e3 * statistics.median(cpu), 3),
            "incidents": sum(b["incidents"] for res in ranks for b in res["blocks"] if b["mode"] == mode),
            "instrumented_blocks": sum(b["instrumented"] for res in ranks for b in res["blocks"] if b["mode"] == mode),
            "recorded_calls": sum(b["recorded_calls"] for res in ranks for b in res["blocks"] if b["mode"] == mode),
            "gc_runs_per_generation": [
                sum(b.get("gc_collections", [0, 0, 0])[g] for res in ranks for b in res["blocks"] if b["mode"] == mode)
                for g in range(3)
            ],
            "gc_ms_per_step_per_rank": round(
                1e3
                * sum(b.get("gc_s", 0.0) for res in ranks for b in res["blocks"] if b["mode"] == mode)
                / max(len(steps), 1),
                4,
            ),
        }
    out["per_mode"] = per_mode
    for metric in ("step", "cpu"):
        tab = table(ranks, metric)
        out[f"ratios_{metric}"] = {m: summarize(tab, m, boot) for m in modes if m != "off"}
    out["watchdog_thread"] = {m: watchdog_thread_stats(ranks, m) for m in modes if m.startswith("wd")}
    train_cores = sum(
        statistics.fmean(b["proc_cpu_s"] / b["wall_s"] for b in res["blocks"] if b["mode"] in BASELINES)
        for res in ranks
    )
    out["idle"] = idle_stats(ranks, train_cores)
    wall_floor, cpu_floor = out["ratios_step"]["off2"]["ci95"], out["ratios_cpu"]["off2"]["ci95"]
    out["noise_floor"] = {
        "wall_off2_over_off_ci95": wall_floor,
        "wall_half_width_percent": round(50 * (wall_floor[1] - wall_floor[0]), 2),
        "cpu_off2_over_off_ci95": cpu_floor,
        "cpu_half_width_percent": round(50 * (cpu_floor[1] - cpu_floor[0]), 2),
    }
    out["verdicts"] = {
        m: {
            "overall": overall(out["idle"].get(m), out["ratios_cpu"][m], cpu_floor),
            "cpu_ratio": verdict(out["ratios_cpu"][m]["ci95"], cpu_floor),
            "wall_ratio": verdict(out["ratios_step"][m]["ci95"], wall_floor),
        }
        for m in modes
        if m.startswith("wd")
    }
    return out


# ----------------------------------------------------------------------------- the machine


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_state() -> dict[str, Any]:
    """The checkout measured: HEAD and whether the watchdog's files differ from it."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", *a], cwd=HERE.parent, capture_output=True, text=True, timeout=10
            ).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "head": git("rev-parse", "HEAD"),
        "uncommitted_in_diagnosis": git(
            "status", "--short", "--", "ncclguard/watching", "ncclguard/recording", "ncclguard/store"
        ).splitlines(),
    }


def children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


# ----------------------------------------------------------------------------- the run


def run_stack(stack: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launches the 2 ranks for ``stack``; returns the raw results, the analysis and the machine's load."""
    argv = [
        sys.executable,
        str(WORKER),
        "--stack",
        stack,
        "--heartbeats",
        args.heartbeats,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--settle",
        str(args.settle),
        "--warmup-s",
        str(args.warmup_s),
        "--idle-s",
        str(args.idle_s),
        "--idle-rounds",
        str(args.idle_rounds),
    ]
    load_before, ticks0, kids0 = os.getloadavg(), cpu_ticks(), children_cpu_s()
    res = spawn(argv, 2, timeout_s=args.timeout_s, env={"OMP_NUM_THREADS": "1"})
    load_after, ticks1, kids1 = os.getloadavg(), cpu_ticks(), children_cpu_s()
    if not res.ok:
        raise SystemExit(f"{stack}: the ranks failed (timed out: {res.timed_out})\n{res.output()[-6000:]}")
    found = res.json_lines()
    ranks = [found[r] for r in sorted(found)]
    if len(ranks) != 2:
        raise SystemExit(f"{stack}: expected a RESULT line from 2 ranks, got {sorted(found)}\n{res.output()[-4000:]}")
    machine: dict[str, Any] = {
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "wall_s": round(res.wall_s, 1),
    }
    if ticks0 and ticks1:
        hz = os.sysconf("SC_CLK_TCK")
        busy_cores = (ticks1[0] - ticks0[0]) / hz / res.wall_s
        ours = (kids1 - kids0) / res.wall_s
        machine["busy_cores_all"] = round(busy_cores, 2)
        machine["busy_cores_this_benchmark"] = round(ours, 2)
        machine["busy_cores_others"] = round(max(busy_cores - ours, 0.0), 2)
    return {"stack": stack, "machine": machine, "analysis": analyse(ranks, args.bootstrap), "raw": ranks}


def compact_json(doc: Any) -> str:
    """``doc`` as indented JSON with every list of plain numbers or strings on one line (a few
    hundred lines in all, not one line per number)."""
    import re

    text = json.dumps(doc, indent=1)

    def join(m: re.Match[str]) -> str:
        items = [x.strip() for x in m.group(1).split(",\n")]
        return "[" + ", ".join(items) + "]"

    return re.sub(
        r"\[\n((?:\s*(?:-?[0-9.eE+-]+|\"[^\"\n]*\"|null|true|false),\n)*\s*(?:-?[0-9.eE+-]+|\"[^\"\n]*\"|null|true|false))\n\s*\]",
        join,
        text,
    )


def write_results(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """Writes the summary to ``--json`` (no per-step data) and, with ``--raw-json``, everything."""
    if args.raw_json is not None:
        args.raw_json.parent.mkdir(parents=True, exist_ok=True)
        args.raw_json.write_text(json.dumps(doc) + "\n")
    slim = {**doc, "stacks": {k: {kk: vv for kk, vv in v.items() if kk != "raw"} for k, v in doc["stacks"].items()}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(compact_json(slim) + "\n")


def print_table(result: dict[str, Any]) -> None:
    """The stack's table: per mode, step times, ratios to the baseline and the watchdog thread's CPU."""
    a, m = result["analysis"], result["machine"]
    print(
        f"\n{result['stack']}: tiny GPT-2 ({a['params']:,} parameters), 2 gloo ranks; "
        f"load {m['loadavg_before'][0]} -> {m['loadavg_after'][0]}, other jobs used {m.get('busy_cores_others', '?')} cores"
    )
    print(
        f"{'mode':<7} {'steps':>5} {'p50 ms':>8} {'p10-p90 ms':>15} {'wall ratio [95% CI]':>26} "
        f"{'min-of-blocks':>13} {'CPU ratio [95% CI]':>26} {'wd thread %core':>15}"
    )
    for mode in a["modes"]:
        pm = a["per_mode"][mode]
        rs, rc = a["ratios_step"].get(mode), a["ratios_cpu"].get(mode)
        wt = a["watchdog_thread"].get(mode)
        ws = f"{rs['ratio']:.4f} [{rs['ci95'][0]:.4f}, {rs['ci95'][1]:.4f}]" if rs else "1 (baseline)"
        cs = f"{rc['ratio']:.4f} [{rc['ci95'][0]:.4f}, {rc['ci95'][1]:.4f}]" if rc else "1 (baseline)"
        mb = f"{rs['min_of_blocks_ratio']:.4f}" if rs else "-"
        print(
            f"{mode:<7} {pm['steps']:>5} {pm['step_ms_p50']:>8.2f} {pm['step_ms_p10']:>7.2f}-{pm['step_ms_p90']:<7.2f} "
            f"{ws:>26} {mb:>13} {cs:>26} {wt['thread_cpu_percent_of_a_core'] if wt else '-':>15}"
        )
    nf = a["noise_floor"]
    print(
        f"  noise floor (off2/off, 95% CI half-width): wall +/-{nf['wall_half_width_percent']}%, CPU +/-{nf['cpu_half_width_percent']}%"
    )
    for mode, v in a["verdicts"].items():
        wt = a["watchdog_thread"][mode]
        print(f"  {mode}: {v['overall']}")
        print(f"         wall ratio: {v['wall_ratio']}")
        print(
            f"         watchdog thread {wt['thread_cpu_us_per_tick']} us CPU per tick "
            f"({wt['tick_s']} s), {wt['thread_cpu_ms_per_step']} ms per step; "
            f"{wt['recorded_collectives_per_step']} recorded collectives per step"
        )
        idle = a["idle"].get(mode)
        if idle:
            print(
                f"         idle (training paused): +{idle['extra_cpu_percent_of_a_core_both_ranks']}% of a core for both ranks, "
                f"{idle['extra_cpu_us_per_tick_per_rank']} us per tick per rank (thread alone "
                f"{idle['watchdog_thread_cpu_us_per_tick']} us); as step time of a CPU-bound job: "
                f"+{idle['step_overhead_percent_one_core_per_rank']}% with a core per rank, "
                f"+{idle['step_overhead_percent_at_this_runs_share']}% at the CPU share this run got"
            )


def reanalyse(args: argparse.Namespace) -> int:
    """Recomputes every stack's analysis from the raw per-rank data in ``--from-json`` (a file that
    ``--raw-json`` wrote); writes ``--json``."""
    try:
        doc = json.loads(args.from_json.read_text())
        stacks = doc["stacks"]
        for res in stacks.values():
            res["analysis"] = analyse(res["raw"], args.bootstrap)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--from-json {args.from_json}: not a --raw-json file of this benchmark ({exc})") from exc
    for res in stacks.values():
        print_table(res)
    args.raw_json = None
    write_results(doc, args)
    print(f"\nwrote {args.json} (re-analysed from {args.from_json})")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stacks", default="ddp,deepspeed", help="comma-separated: ddp, deepspeed")
    ap.add_argument(
        "--heartbeats",
        default=f"{DEFAULT_HEARTBEAT_S:g},0.2",
        help="comma-separated heartbeat_s values (default: WatchdogConfig's default and 0.2)",
    )
    ap.add_argument("--rounds", type=int, default=8, help="rounds (one block per mode each)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--settle", type=int, default=2, help="untimed steps at each block's start")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--idle-s", type=float, default=4.0, help="seconds per idle block (training paused)")
    ap.add_argument("--idle-rounds", type=int, default=3, help="rounds of idle blocks")
    ap.add_argument("--bootstrap", type=int, default=4000, help="bootstrap resamples")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="wall-clock bound per stack")
    ap.add_argument("--from-json", type=Path, help="re-analyse an earlier run's --raw-json file (runs nothing)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "watchdog_cost.json")
    ap.add_argument("--raw-json", type=Path, help="also write every step's data here (for --from-json)")
    args = ap.parse_args(argv)
    stacks = [s for s in args.stacks.split(",") if s]
    bad = [s for s in stacks if s not in ("ddp", "deepspeed")]
    if not stacks or bad:
        ap.error(f"--stacks takes ddp and/or deepspeed, got {args.stacks!r}")
    try:
        hbs = [float(h) for h in args.heartbeats.split(",") if h]
    except ValueError:
        ap.error(f"--heartbeats takes numbers, e.g. 1.0,0.2; got {args.heartbeats!r}")
    if not hbs or any(h <= 0 for h in hbs):
        ap.error(f"--heartbeats must be positive numbers, got {args.heartbeats!r}")
    if args.rounds < 3 or args.steps < 3 or args.settle < 0 or args.bootstrap < 100 or args.idle_s < 0:
        ap.error("need --rounds >= 3, --steps >= 3, --settle >= 0, --idle-s >= 0 and --bootstrap >= 100")
    if args.idle_rounds < 1:
        ap.error("need --idle-rounds >= 1")
    args.stack_list = stacks
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json is not None:
        return reanalyse(args)
    started = time.time()
    out: dict[str, Any] = {
        "command": "python benchmarks/watchdog_cost.py " + shlex.join(argv),
        "target": "watchdog + instrument() + phase() cost at most 1% of step time (issue 13)",
        "method": __doc__,
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "git": git_state(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "stacks": {},
    }
    for stack in args.stack_list:
        res = run_stack(stack, args)
        out["stacks"][stack] = res
        print_table(res)
    out["machine"]["torch"] = out["stacks"][args.stack_list[0]]["raw"][0]["torch"]
    out["wall_s"] = round(time.time() - started, 1)
    write_results(out, args)
    print(f"\nwrote {args.json} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
