"""The busy-rank drill (issue 36): ranks that are slow but moving, with every default. Count of actions
(target 0) and of reports.

One launch of 3 ranks on this host, as a user runs it with every default: ``ncclguard run
--ncclguard-restarts 1 --standalone --nproc-per-node 3`` (the watchdog, each rank under its supervisor),
a loop of ``RecoveringStep(module, optimizer)`` and nothing else set (the step bound 300 s, the judge
bound and the watchdog's hang bound learned from the job, gloo's 30 min group timeout). Each step
sleeps ``--step-s`` (its compute) besides a tiny model's forward and backward. Two kinds of busy rank:

- **a long save on rank 0**: after every ``--save-every`` steps rank 0 writes a checkpoint for
  ``--save-s`` seconds (``torch.save`` of a 32 MiB state again and again into one file: CPU and I/O
  move) while ranks 1-2 go on into the next step and wait in its all_reduce;
- **a long evaluation shard on rank 2**: every ``--eval-every`` steps every rank evaluates (forward
  passes under ``torch.no_grad``), rank 2 for ``--eval-s`` seconds and the others for 1 s, then an
  all_reduce of the metric, in which ranks 0-1 wait for rank 2.

With ``--phases`` (the default) the script labels them ``ncclguard.phase("save")`` and
``phase("eval")`` (Lightning's and the HF adapters' phases are of these names); ``--no-phases`` runs
the same script without the labels, so every interval is of one kind.

Counted from every rank: **actions** (a step that failed and was redone, a rebuild, a world that
shrank, the verdict's death notices, connection cuts, asks to a supervisor and self-fences, a
supervisor that ended or restarted a rank) and **reports** (the verdict's busy reports, the
watchdog's incidents by kind). Also the learned bounds against the real intervals: the judge bound,
the hang bound per phase, and the longest step interval, save and evaluation.

Usage:
    python benchmarks/busy_drill.py --save-s 40 --eval-s 40 --steps 130 --json benchmarks/results/busy_drill_40s.json
    python benchmarks/busy_drill.py --save-s 180 --eval-s 180 --steps 130      # the issue's 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from failure_drill import _batch, _digest, _end, _kill_tree, _model, _save  # noqa: E402

NPROC = 3
SAVER, EVALUATOR = 0, 2
SHORT_EVAL_S = 1.0


# ------------------------------------------------------------------------------------ rank side


def _labelled(name: str, on: bool) -> Any:
    import contextlib

    import ncclguard

    return ncclguard.phase(name) if on else contextlib.nullcontext()


def _save_for(seconds: float, path: Path) -> int:
    """A checkpoint written for ``seconds``: a 32 MiB state saved again and again (CPU and I/O move)."""
    import torch

    state = {"w": torch.randn(4 * 1024 * 1024, dtype=torch.float64)}
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        torch.save(state, path)
        n += 1
    path.unlink(missing_ok=True)
    return n


def _evaluate(module: Any, seconds: float) -> float:
    """Forward passes for ``seconds``: an evaluation shard of that length; returns the summed loss."""
    import torch

    total, i, end = 0.0, 0, time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            x, y = _batch(10_000 + i, 0)
            total += float(torch.nn.functional.mse_loss(module(x), y))
            i += 1
    return total


def _watchdog_view() -> dict[str, Any]:
    """The watchdog's incidents and its learned hang bounds."""
    from ncclguard.watching.watchdog import current_watchdog

    wd = current_watchdog()
    if wd is None:
        return {"incidents": [], "hang": None}
    learner = wd.hang.learner
    return {
        "incidents": [
            {"kind": i["kind"], "reason": str(i["doc"].get("reason", ""))[:300], "rungs": i["actions"]}
            for i in wd.incidents
        ],
        "hang": {
            "fixed": wd.hang.fixed,
            "bounds": {k: round(learner.bound(k), 3) for k in learner.state.counts},
            "learned": learner.state.model_dump(),
        },
    }


def rank_side(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ncclguard

    out, me = Path(args.out), int(os.environ["RANK"])
    dist.init_process_group("gloo")  # no timeout set anywhere: gloo's 30 min
    module = _model()
    stepper = ncclguard.RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.01))  # every default
    timing = stepper.engine.timing
    dist.barrier()
    t0 = time.time()
    results, saves, evals, intervals, last = [], [], [], [], None
    for step in range(args.steps):
        x, y = _batch(step, me)

        def step_fn(model: Any, x: Any = x, y: Any = y) -> None:
            time.sleep(args.step_s)  # the step's compute
            torch.nn.functional.mse_loss(model(x), y).backward()

        started = time.monotonic()
        if last is not None:
            intervals.append(started - last)
        last = started
        res = stepper(step_fn, step=step)
        results.append([step, res.ok, res.attempts, res.generation, dist.get_world_size()])
        if not res:
            raise SystemExit(f"step {step} was not applied: {res.error}")
        if (step + 1) % args.save_every == 0 and me == SAVER:
            s0 = time.monotonic()
            with _labelled("save", args.phases):
                n = _save_for(args.save_s, out / f"ckpt-{me}.pt")
            saves.append({"step": step, "s": round(time.monotonic() - s0, 2), "writes": n})
        if (step + 1) % args.eval_every == 0:
            e0 = time.monotonic()
            with _labelled("eval", args.phases):
                metric = torch.tensor([_evaluate(module, args.eval_s if me == EVALUATOR else SHORT_EVAL_S)])
                dist.all_reduce(metric)
            evals.append({"step": step, "s": round(time.monotonic() - e0, 2)})
    t1 = time.time()
    digest, flat = _digest(module)
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    _save(
        out,
        me,
        {
            "train_s": round(t1 - t0, 2),
            "results": results,
            "events": timing.driver.events,
            "recoveries": [{"step": r.step, "attempts": r.attempts, "s": r.elapsed_s} for r in stepper.recoveries],
            "saves": saves,
            "evals": evals,
            "longest_step_interval_s": round(max(intervals, default=0.0), 3),
            "judge_s": timing.judge_s(),
            "judge_learned": timing.learner.state.model_dump(),
            "world": [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()],
            "equal_across_ranks": all(torch.equal(everyone[0], t) for t in everyone),
            "digest": digest,
            **_watchdog_view(),
        },
    )
    _end()


# ------------------------------------------------------------------------------------ launcher side

ACTIONS = ("acted", "self-fenced", "asked", "ended")  # the verdict's events that act (busy is a report)


def _count(ranks: dict[int, dict[str, Any]], log: str) -> dict[str, Any]:
    """Actions and reports over every rank, and the supervisors' lines."""
    redone = sorted({(s, a) for r in ranks.values() for s, ok, a, *_ in r["results"] if a > 1})
    worlds = {(g, n) for r in ranks.values() for *_, g, n in r["results"]}
    events = [dict(e, by=k) for k, r in ranks.items() for e in r["events"]]
    incidents: dict[str, int] = {}
    for r in ranks.values():
        for i in r["incidents"]:
            incidents[i["kind"]] = incidents.get(i["kind"], 0) + 1
    supervisor = [line for line in log.splitlines() if "ncclguard.supervise:" in line]
    actions = {
        "redone_steps": [list(x) for x in redone],
        "worlds_left": sorted(w for w in worlds if w != (0, NPROC)),
        "verdict_actions": [e for e in events if e["what"] in ACTIONS],
        "supervisor_lines": supervisor,
    }
    reports = {
        "busy_reports": [
            {k: e.get(k) for k in ("by", "rank", "evidence", "site", "behind_s")} for e in events if e["what"] == "busy"
        ],
        "incidents_by_kind": incidents,  # as handled on each rank (one incident counts once per rank)
        "incident_reasons": sorted({i["reason"] for r in ranks.values() for i in r["incidents"]})[:20],
    }
    n_actions = len(redone) + len(actions["worlds_left"]) + len(actions["verdict_actions"]) + len(supervisor)
    return {
        "action_count": n_actions,
        "actions": actions,
        "report_count": len(reports["busy_reports"]),
        "reports": reports,
    }


def launch(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / ("phases" if args.phases else "nophases")
    out.mkdir(parents=True)
    worker = [
        str(HERE),
        "--rank-side",
        *("--out", str(out), "--steps", str(args.steps), "--step-s", str(args.step_s)),
        *("--save-every", str(args.save_every), "--save-s", str(args.save_s)),
        *("--eval-every", str(args.eval_every), "--eval-s", str(args.eval_s)),
        "--phases" if args.phases else "--no-phases",
    ]
    cmd = [sys.executable, "-m", "ncclguard", "run", "--ncclguard-restarts", "1"]
    cmd += ["--ncclguard-incident-dir", str(out / "incidents"), "--standalone", f"--nproc-per-node={NPROC}"]
    cmd += ["--monitor-interval=0.1", *worker]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in [k for k in env if k.startswith("NCCLGUARD_")]:
        env.pop(k)  # every default: nothing of ours set from outside
    start = time.monotonic()
    with (out / "launch.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.launch_timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
            raise SystemExit(
                f"did not finish within {args.launch_timeout} s\n{(out / 'launch.log').read_text()[-4000:]}"
            ) from None
    text = (out / "launch.log").read_text()
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    if rc != 0 or sorted(ranks) != list(range(NPROC)):
        raise SystemExit(f"ncclguard run exited {rc} with results of ranks {sorted(ranks)}\n{text[-4000:]}")
    r0, r2 = ranks[SAVER], ranks[EVALUATOR]
    return {
        "phases": args.phases,
        "launch_wall_s": round(time.monotonic() - start, 2),
        "torchrun_rc": rc,
        "train_s": r0["train_s"],
        **_count(ranks, text),
        "finished_on": sorted({tuple(r["world"][1:]) for r in ranks.values()}),
        "equal_across_ranks": all(r["equal_across_ranks"] for r in ranks.values()),
        "saves": r0["saves"],
        "evals_on_rank2": r2["evals"],
        "longest_step_interval_s": max(r["longest_step_interval_s"] for r in ranks.values()),
        "judge_s": {k: r["judge_s"] for k, r in ranks.items()},
        "hang": {k: r["hang"] for k, r in ranks.items()},
        "learned_lines": re.findall(r"learned (?:step|hang) bound[^\n]*", text)[:30],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--step-s", type=float, default=0.1, help="each step's compute (a sleep)")
    p.add_argument("--save-every", type=int, default=50, help="rank 0 saves after every this many steps")
    p.add_argument("--save-s", type=float, default=180.0, help="how long rank 0's save lasts (the issue: 3 minutes)")
    p.add_argument("--eval-every", type=int, default=60, help="every rank evaluates after every this many steps")
    p.add_argument("--eval-s", type=float, default=180.0, help="how long rank 2's evaluation shard lasts")
    p.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True, help="label save and eval phases")
    p.add_argument("--both", action="store_true", help="run with the phases labelled, then without")
    p.add_argument("--launch-timeout", type=float, default=3600.0, help="hang guard of each launch")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workdir", type=Path, help="keep the launch's logs, dumps and results here")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_side:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        rank_side(args)
        return 0
    for name in ("steps", "save_every", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.step_s, args.save_s, args.eval_s) <= 0:
        p.error("--step-s, --save-s and --eval-s must be positive seconds")
    load0 = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="ncclguard-busy-") as tmp:
        root = Path(tmp) if args.workdir is None else args.workdir
        for phases in [True, False] if args.both else [args.phases]:
            args.phases = phases
            r = launch(args, root)
            runs.append(r)
            print(
                f"phases {'on' if phases else 'off'}: {r['action_count']} action(s), {r['report_count']} busy report(s), "
                f"incidents {r['reports']['incidents_by_kind']}, finished on {r['finished_on']}, "
                f"wall {r['launch_wall_s']} s",
                flush=True,
            )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if k not in ("rank_side", "out", "json", "workdir")},
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "runs": runs,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
