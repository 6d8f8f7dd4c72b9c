"""How long a preempted job takes to end: SIGTERM to ``ncclguard run --ncclguard-restarts 2``, until
every process of the job (the launcher, the supervisors, the ranks) is gone.

Runs tests/workers/preempt_worker.py (2 gloo ranks; RecoveringStep with DDP or FSDP2, the HF
Trainer, DeepSpeed ZeRO-2, a Lightning Trainer under NcclGuardCallback(recover=True)), waits until
every rank applied 3 steps, sends SIGTERM to the launcher, and prints the seconds until the last
pid is gone, the exit status and the checkpoint written::

    .venv/bin/python benchmarks/preempt_stop.py --stack ddp --runs 3

docs/recovery.md ("Preemption") quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

WORKERS = Path(__file__).resolve().parent.parent / "tests" / "workers"


def one(stack: str, root: Path) -> dict[str, object]:
    """One launch, stopped by SIGTERM; its figures."""
    out = root / stack
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(WORKERS), "NCCLGUARD_PREEMPT_DIR": str(out / "ckpt")}
    cmd = [sys.executable, "-m", "ncclguard", "run", "--ncclguard-restarts", "2", "--standalone"]
    cmd += ["--nproc-per-node", "2", str(WORKERS / "preempt_worker.py"), stack, "train", str(out)]
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while (
            not all((out / f"progress-{r}").exists() for r in (0, 1))
            or min(int((out / f"progress-{r}").read_text() or -1) for r in (0, 1)) < 3
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{stack}: no training (see {out / 'log'})")
            time.sleep(0.05)
        launcher = psutil.Process(proc.pid)
        others = [c for s in launcher.children() for c in (s, *s.children())]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        psutil.wait_procs(others, timeout=60)
        gone = time.monotonic() - start
    marker = json.loads((out / "ckpt" / "PREEMPTED.json").read_text())
    restarted = "; restart" in (out / "log").read_text()
    return {"stack": stack, "gone_s": round(gone, 2), "rc": rc, "restarted": restarted, "checkpoint": marker["path"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", choices=("ddp", "fsdp2", "hf", "deepspeed", "lightning"), default="ddp")
    ap.add_argument("--runs", type=int, default=3)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.runs):
            print(json.dumps(one(ns.stack, Path(tmp) / str(i))), flush=True)


if __name__ == "__main__":
    main()
