"""How long a preempted job takes to end: SIGTERM to ``ncclguard run --ncclguard-restarts 2``, until
every process of the job (the launcher, the supervisors, the ranks) is gone.

Runs tests/workers/preempt_worker.py (2 gloo ranks; RecoveringStep with DDP or FSDP2, the HF
Trainer, DeepSpeed ZeRO-2, a Lightning Trainer under NcclGuardCallback(recover=True)), waits until
every rank applied 3 steps, sends SIGTERM to the launcher, and prints the seconds until the last
pid is gone, the exit status and the checkpoint written::

    .venv/bin/python benchmarks/preempt_stop.py --stack ddp --runs 3

``--params-m N`` gives the loop's and DeepSpeed's model N million float32 parameters (two square
layers), so that the checkpoint written inside the supervisor's stop-grace (8 s by default) is one of
a real size; each run then also reports the checkpoint's bytes on disk. docs/reference/recovery-drills.md
("Preemption") quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

WORKERS = Path(__file__).resolve().parent.parent / "tests" / "workers"


def one(stack: str, root: Path, width: int) -> dict[str, object]:
    """One launch, stopped by SIGTERM; its figures."""
    out = root / stack
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(WORKERS), "NCCLGUARD_PREEMPT_DIR": str(out / "ckpt")}
    env["NCCLGUARD_PREEMPT_WIDTH"] = str(width)
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
    text = (out / "log").read_text()
    restarted = "; restart" in text
    # each rank's own account: the save's seconds against its supervisor's stop grace
    said = [
        line.split("] ", 1)[-1] for line in text.splitlines() if " written to " in line and "checkpoint of step" in line
    ]
    written = sum(f.stat().st_size for f in (out / "ckpt").rglob("*") if f.is_file())
    return {
        "stack": stack,
        "gone_s": round(gone, 2),
        "rc": rc,
        "restarted": restarted,
        "checkpoint": marker["path"],
        "checkpoint_bytes": written,
        "ranks_said": said,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", choices=("ddp", "fsdp2", "hf", "deepspeed", "lightning"), default="ddp")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--params-m", type=float, default=0.0, help="the loop's and DeepSpeed's model size, millions")
    ns = ap.parse_args()
    if ns.params_m and ns.stack not in ("ddp", "fsdp2", "deepspeed"):
        ap.error("--params-m sizes the loop's and DeepSpeed's model: --stack ddp, fsdp2 or deepspeed")
    width = round(math.sqrt(ns.params_m * 1e6 / 2)) if ns.params_m else 0  # two square layers
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.runs):
            print(json.dumps({**one(ns.stack, Path(tmp) / str(i), width), "width": width}), flush=True)


if __name__ == "__main__":
    main()
