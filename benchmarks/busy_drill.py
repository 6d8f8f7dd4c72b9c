"""The busy-rank drill (issue 36): ranks that are slow but moving, with every default. Count of actions
(target 0) and of reports.

One launch of 3 ranks on this host, as a user runs it with every default: ``ncclguard run
--ncclguard-restarts 1 --standalone --nproc-per-node 3`` (the watchdog, each rank under its supervisor),
a loop of ``RecoveringStep(module, optimizer)`` and nothing else set (the step bound 300 s, the judge
bound and the watchdog's hang bound learned from the job, gloo's 30 min group timeout). Each step
sleeps ``--step-s`` (its compute) besides a tiny model's forward and backward. Kinds of busy rank:

- **a long save on rank 0**: after every ``--save-every`` steps rank 0 writes a checkpoint for
  ``--save-s`` seconds (``torch.save`` of a 32 MiB state again and again into one file: CPU and I/O
  move) while ranks 1-2 go on into the next step and wait in its all_reduce;
- **a long evaluation shard on rank 2**: every ``--eval-every`` steps every rank evaluates (forward
  passes under ``torch.no_grad``), rank 2 for ``--eval-s`` seconds and the others for 1 s, then an
  all_reduce of the metric, in which ranks 0-1 wait for rank 2;
- **an upload on rank 1** (``--upload-s``, off by default): after every ``--upload-every`` steps
  rank 1's main thread is blocked in ``socket.sendall`` of a big buffer to a slow reader (a process
  the launcher starts, not in any rank's tree: 64 KiB every 50 ms on loopback) for ``--upload-s``
  seconds; only its network bytes move (its CPU, I/O and stack do not) while the others wait in the
  next step's all_reduce;
- **a stalled data loader on rank 0** (``--loader-stall-s``, off by default): every rank reads its
  batches from a ``DataLoader`` with ``num_workers=2``; on rank 0 the batch of every
  ``--loader-every``-th step takes its worker process ``--loader-stall-s`` seconds of computing, while
  its main thread waits in the loader's queue ``get``: only its children's CPU moves.

By default the upload and the stalled batch fall on the same step (after step 19, the batch of step
20, ...): rank 2 alone waits and judges both, 10 s into the step, at the judge bound learned from the
quick steps (its floor). The first long interval raises the judge bound to 5 x its length (at most
half the 300 s step bound, 150 s); a bound never shrinks, so a later busy rank shorter than it is not
judged by the verdict at all, only reported by the watchdog past its hang bound.

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
    python benchmarks/busy_drill.py --upload-s 60 --loader-stall-s 60 --steps 45    # no save nor eval before step 50
    python benchmarks/busy_drill.py --save-s 180 --eval-s 180 --steps 130      # the issue's 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
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
UPLOADER, LOADER = 1, 0
SHORT_EVAL_S = 1.0
# The upload's reader takes READ_CHUNK bytes every READ_EVERY_S for --upload-s seconds, then drains.
READ_CHUNK, READ_EVERY_S = 64 << 10, 0.05


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


def _upload_bytes(seconds: float) -> int:
    """A buffer the slow reader takes longer than ``seconds`` to read (the kernel's socket buffers too)."""
    return int(seconds * READ_CHUNK / READ_EVERY_S * 1.5) + (16 << 20)


def _upload(port: int, data: bytes) -> float:
    """One upload: ``data`` sent with ``sendall`` to the slow reader at ``port``, the main thread
    blocked in it until the reader has drained it and closed. Returns its seconds."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)  # blocked here while the reader takes 64 KiB every 50 ms
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the reader closes once it has read it all
    return time.monotonic() - t0


def _compute_for(seconds: float) -> int:
    """CPU work in Python for ``seconds`` (in a loader's worker process)."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += sum(i * i for i in range(2000)) % 7
    return n


class Batches:
    """The drill's batches as a map-style dataset (index: the step): on rank LOADER the batch of every
    ``every``-th step (but step 0) takes ``stall_s`` seconds of computing in the worker producing it."""

    def __init__(self, me: int, steps: int, stall_s: float, every: int) -> None:
        self.me, self.steps, self.stall_s, self.every = me, steps, stall_s, every

    def stalls(self, step: int) -> bool:
        return self.me == LOADER and step > 0 and step % self.every == 0

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> tuple[Any, Any]:
        if self.stalls(step):
            _compute_for(self.stall_s)
        return _batch(step, self.me)


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
    data = bytes(_upload_bytes(args.upload_s)) if args.upload_s > 0 and me == UPLOADER else b""
    # With --loader-stall-s every rank reads through a DataLoader (2 worker processes); rank LOADER's stalls.
    loader = Batches(me, args.steps, args.loader_stall_s, args.loader_every) if args.loader_stall_s > 0 else None
    batches = iter(torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2)) if loader is not None else None
    dist.barrier()
    t0 = time.time()
    results, saves, evals, intervals, last = [], [], [], [], None
    uploads, loader_waits = [], []
    for step in range(args.steps):
        if loader is None or batches is None:
            x, y = _batch(step, me)
        else:
            w0 = time.monotonic()
            x, y = next(batches)  # on a stalled batch: the main thread waits in the loader's queue
            if loader.stalls(step):
                loader_waits.append({"step": step, "s": round(time.monotonic() - w0, 2)})

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
        if args.upload_s > 0 and (step + 1) % args.upload_every == 0 and me == UPLOADER:
            uploads.append({"step": step, "s": round(_upload(args.upload_port, data), 2), "bytes": len(data)})
        if (step + 1) % args.eval_every == 0:
            e0 = time.monotonic()
            with _labelled("eval", args.phases):
                metric = torch.tensor([_evaluate(module, args.eval_s if me == EVALUATOR else SHORT_EVAL_S)])
                dist.all_reduce(metric)
            evals.append({"step": step, "s": round(time.monotonic() - e0, 2)})
    t1 = time.time()
    del batches  # its worker processes end
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
            "uploads": uploads,
            "loader_waits": loader_waits,
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
        *("--upload-every", str(args.upload_every), "--upload-s", str(args.upload_s)),
        *("--upload-port", str(args.upload_port)),
        *("--loader-every", str(args.loader_every), "--loader-stall-s", str(args.loader_stall_s)),
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
        "uploads_on_rank1": ranks[UPLOADER]["uploads"],
        "loader_waits_on_rank0": ranks[LOADER]["loader_waits"],
        "longest_step_interval_s": max(r["longest_step_interval_s"] for r in ranks.values()),
        "judge_s": {k: r["judge_s"] for k, r in ranks.items()},
        "hang": {k: r["hang"] for k, r in ranks.items()},
        "learned_lines": re.findall(r"learned (?:step|hang) bound[^\n]*", text)[:30],
    }


def slow_reader(seconds: float) -> None:
    """The uploads' receiver (``--slow-reader``): prints its port, then for each connection reads
    READ_CHUNK bytes every READ_EVERY_S for ``seconds``, drains the rest and closes; until killed."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                end = time.monotonic() + seconds
                while time.monotonic() < end and conn.recv(READ_CHUNK):
                    time.sleep(READ_EVERY_S)
                while conn.recv(1 << 20):
                    pass


def _start_reader(seconds: float) -> tuple[subprocess.Popen[str], int]:
    """The slow reader in a process of its own, a child of this launcher (not of any rank)."""
    cmd = [sys.executable, str(HERE), "--slow-reader", "--upload-s", str(seconds)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--step-s", type=float, default=0.1, help="each step's compute (a sleep)")
    p.add_argument("--save-every", type=int, default=50, help="rank 0 saves after every this many steps")
    p.add_argument("--save-s", type=float, default=180.0, help="how long rank 0's save lasts (the issue: 3 minutes)")
    p.add_argument("--eval-every", type=int, default=60, help="every rank evaluates after every this many steps")
    p.add_argument("--eval-s", type=float, default=180.0, help="how long rank 2's evaluation shard lasts")
    p.add_argument("--upload-s", type=float, default=0.0, help="rank 1's upload to a slow reader (0: none)")
    p.add_argument("--upload-every", type=int, default=20, help="rank 1 uploads after every this many steps")
    p.add_argument(
        "--loader-stall-s",
        type=float,
        default=0.0,
        help="rank 0's DataLoader worker computes a batch this long (0: none)",
    )
    p.add_argument("--loader-every", type=int, default=20, help="the batch of every this many steps stalls")
    p.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True, help="label save and eval phases")
    p.add_argument("--both", action="store_true", help="run with the phases labelled, then without")
    p.add_argument("--launch-timeout", type=float, default=3600.0, help="hang guard of each launch")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workdir", type=Path, help="keep the launch's logs, dumps and results here")
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--upload-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slow-reader", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.slow_reader:
        slow_reader(args.upload_s)
        return 0
    if args.rank_side:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        rank_side(args)
        return 0
    for name in ("steps", "save_every", "eval_every", "upload_every", "loader_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.step_s, args.save_s, args.eval_s) <= 0:
        p.error("--step-s, --save-s and --eval-s must be positive seconds")
    if min(args.upload_s, args.loader_stall_s) < 0:
        p.error("--upload-s and --loader-stall-s must be seconds (0: none)")
    load0 = os.getloadavg()
    runs = []
    reader = None
    with tempfile.TemporaryDirectory(prefix="ncclguard-busy-") as tmp:
        root = Path(tmp) if args.workdir is None else args.workdir
        try:
            if args.upload_s > 0:
                reader, args.upload_port = _start_reader(args.upload_s)
            for phases in [True, False] if args.both else [args.phases]:
                args.phases = phases
                r = launch(args, root)
                runs.append(r)
                print(
                    f"phases {'on' if phases else 'off'}: {r['action_count']} action(s), "
                    f"{r['report_count']} busy report(s), incidents {r['reports']['incidents_by_kind']}, "
                    f"finished on {r['finished_on']}, wall {r['launch_wall_s']} s",
                    flush=True,
                )
                for b in r["reports"]["busy_reports"]:
                    print(f"  busy: rank {b['rank']} by rank {b['by']}, {b['behind_s']} s behind: {b['evidence']}")
                for u in r["uploads_on_rank1"]:
                    print(f"  upload on rank {UPLOADER} after step {u['step']}: {u['s']} s, {u['bytes']} bytes")
                for w in r["loader_waits_on_rank0"]:
                    print(f"  loader stall on rank {LOADER} before step {w['step']}: waited {w['s']} s")
        finally:
            if reader is not None:
                _kill_tree(reader)
                reader.wait()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("rank_side", "out", "json", "workdir", "upload_port", "slow_reader")
        },
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
