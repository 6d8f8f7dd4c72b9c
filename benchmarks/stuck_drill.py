"""The stuck drill with every default (issue 45): a rank asleep for good, N launches in a row, per stack.

Each launch is the one ``tests/watching/test_defaults_multirank.py`` makes: 3 gloo ranks under
``torchrun --standalone``, each under ``python -m ncclguard.supervise --restarts=1`` (what
``ncclguard run --ncclguard-restarts 1`` runs), ``NCCLGUARD_AUTO=1`` and nothing else set; the rank
side is ``tests/workers/defaults_worker.py``:

The loops and the Trainer make their process group before they import ncclguard, as their docs write them.

- ``loop``: ``RecoveringStep(module, opt, scheduler=...)``, a BERT classifier of 2.05M parameters,
  launch rank 2 asleep for good at step 12 (after the judge bound's warm-up);
- ``hf``: the HF Trainer with ``guard_trainer(trainer, recover=True)``, launch rank 2 asleep for good
  at the start of global step 3 (before the warm-up: the judge bound's 30 s default);
- ``accelerate``: the ``loop`` as the Accelerate page writes it (``Accelerator()`` first, then
  ``recovering_step(accelerator, model, optimizer, scheduler=schedule)``), asleep at step 12;
- ``lightning``: that BERT as a LightningModule, ``Trainer(callbacks=[NcclGuardCallback(recover=True)])``
  with Lightning's defaults (its fit makes the group), asleep at global step 12;
- ``deepspeed``: ``deepspeed.init_distributed`` first, then ``CommittedEngineStep(engine,
  checkpoint_dir=..., rebuild_engine=make)`` over ZeRO-2 (``tests/workers/defaults_ds_worker.py``),
  asleep in its step function at the worker's ``ASLEEP``; training goes on when the first step after
  the failed one is applied (every rank went back to the snapshot's step).

Per launch: the launcher's status, the seconds from the stall to training going on (the redone step
committed on rank 0), the world size training ended on, whether every rank ended with the same
parameters, and the **healthy ranks acted on** (any action of the verdict, by any rank, naming a rank
other than the one asleep: target 0), with the ranks judged stuck by one rank alone (``awaiting``:
no action) counted apart.

``--ranks 4`` widens the world (run at 4: the loop and the Trainer); ``--fault stopped`` makes every
stack's stuck rank SIGSTOP itself instead of sleeping in Python, so that its heartbeats stop too and it
has no say in the waiting ranks' agreement. A launch whose rank 0 was ended (a healthy rank acted on)
is counted not ok, with what was acted on.

Usage:
    python benchmarks/stuck_drill.py --runs 20 --stacks loop hf accelerate lightning --json benchmarks/results/stuck_drill_defaults.json
    python benchmarks/stuck_drill.py --runs 5 --stacks loop --ranks 4 --fault stopped --json benchmarks/results/stuck_drill_four_ranks_stopped.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent / "tests"))

from harness import run_ranks  # noqa: E402

ASLEEP = 2
STACKS = ("loop", "hf", "accelerate", "lightning", "deepspeed")
WORKERS = {"deepspeed": ("defaults_ds_worker", ())}  # the others: defaults_worker, its stack the argument
ACTIONS = ("acted", "self-asked", "self-fenced", "asked", "ended")


def _one(stack: str, timeout_s: float, ranks: int = 3, fault: str = "asleep") -> dict[str, Any]:
    incidents = Path(tempfile.mkdtemp(prefix="ncclguard-stuck-drill-"))
    env = {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": str(incidents), "DRILL_FAULT": fault}
    t0 = time.monotonic()
    try:
        worker, args = WORKERS.get(stack, ("defaults_worker", (stack,)))
        job = run_ranks(worker, ranks, *args, timeout_s=timeout_s, supervise=["--restarts=1"], env=env)
    except AssertionError as exc:  # a launch that failed or hung: its reason, first line
        return {"ok": False, "error": str(exc).splitlines()[0][:300], "wall_s": round(time.monotonic() - t0, 1)}
    finally:
        shutil.rmtree(incidents, ignore_errors=True)
    res = job.results
    events = [(r, e) for r in res for e in res[r].get("events", [])]
    healthy = [(r, e["what"], e["rank"]) for r, e in events if e["what"] in ACTIONS and e["rank"] != ASLEEP]
    try:
        return _row(stack, job, ranks, events, healthy)
    except KeyError as exc:  # a healthy rank ended (its first life left no results): what was acted on
        return {"ok": False, "error": f"no {exc} in a rank's results", "healthy_acted_on": healthy}


def _row(stack: str, job: Any, ranks: int, events: list[tuple[int, Any]], healthy: list[Any]) -> dict[str, Any]:
    """One good launch's figures (see the module doc)."""
    res = job.results
    stall = res[ASLEEP]["stall_at"]
    at, steps = res[0]["plan"]
    if stack in ("loop", "accelerate"):
        on = res[0]["results"][at]["ended"]
    elif stack == "deepspeed":  # the first step applied after the failed one
        rows = res[0]["results"]
        failed = next(i for i, x in enumerate(rows) if not x["applied"])
        on = next(x["ended"] for x in rows[failed + 1 :] if x["applied"])
    else:  # the step after the stalled one ended: global step at + 1 done
        on = res[0]["step_ends"][str(at + 1)]
    ends = [r for r in range(ranks) if r != ASLEEP] + [10 + ASLEEP]  # the survivors and the restarted rank
    return {
        "ok": True,
        "wall_s": round(job.wall_s, 1),
        "stall_to_on_s": round(on - stall, 2),
        "world": [res[r]["final"][1] for r in ends],
        "equal": len({res[r]["digest"] for r in ends}) == 1,
        "healthy_acted_on": healthy,
        "awaiting": sorted({e["rank"] for _, e in events if e["what"] == "awaiting"}),
        "by": sorted({e["what"] for _, e in events if e["what"] in ACTIONS}),
        "steps": steps,
        # The script's order (the group made before ncclguard was imported) and the restart's stand-in.
        # Lightning's fit makes the group after the callback is imported: not recorded there.
        "group_first": all(res[r].get("order", {}).get("ncclguard_first") is False for r in (0, 1, ASLEEP, 10 + ASLEEP))
        if stack != "lightning"
        else None,
        "stood_in": res[10 + ASLEEP]["order"]["group"] == [0, 1] if stack != "lightning" else None,
        # torch's TCPStore client warnings ("waitForInput: poll for socket ... timed out"), the whole launch.
        "torch_poll_warnings": job.output.count("waitForInput"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    p.add_argument("--launch-timeout", type=float, default=300.0, help="hang guard of each launch")
    p.add_argument("--ranks", type=int, default=3, help="the world's size (run at 4: the loop and the Trainer)")
    p.add_argument(
        "--fault",
        choices=("asleep", "stopped"),
        default="asleep",
        help="the stuck rank: asleep in Python (its heartbeats go on) or SIGSTOPped (they stop too)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out: dict[str, Any] = {"runs": args.runs, "ranks": args.ranks, "fault": args.fault, "stacks": {}}
    for stack in args.stacks:
        rows = []
        for i in range(args.runs):
            row = _one(stack, args.launch_timeout, args.ranks, args.fault)
            rows.append(row)
            print(f"{stack} {i + 1}/{args.runs}: {json.dumps(row)}", flush=True)
        good = [r for r in rows if r["ok"]]
        times = [r["stall_to_on_s"] for r in good]
        out["stacks"][stack] = {
            "launches": rows,
            "ok": len(good),
            "full_world": sum(r["world"] == [args.ranks] * args.ranks and r["equal"] for r in good),
            "healthy_acted_on": sum(len(r.get("healthy_acted_on", [])) for r in rows),
            "torch_poll_warnings": sum(r["torch_poll_warnings"] for r in good),
            "stall_to_on_s": {
                "median": statistics.median(times) if times else None,
                "max": max(times) if times else None,
                "min": min(times) if times else None,
            },
        }
        summary = {k: v for k, v in out["stacks"][stack].items() if k != "launches"}
        print(f"{stack}: {json.dumps(summary)}", flush=True)
        if args.json:  # after each stack: a long drill cut short keeps the stacks it finished
            args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
