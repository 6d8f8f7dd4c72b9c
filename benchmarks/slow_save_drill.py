"""The busy drill's save to network storage (issue 58): rank 0 saves a checkpoint into a mount whose
``close()`` waits ``--flush-s`` (60 s by default: NFS and Lustre flush on close), N launches in a row,
with every default. Target: 0 actions, every file whole.

Each launch is the one ``tests/watching/test_slow_save_multirank.py`` makes (there with a 20 s close):
3 gloo ranks under ``torchrun --standalone``, each under ``python -m ncclguard.supervise --restarts=1``
(what ``ncclguard run --ncclguard-restarts 1`` runs), ``NCCLGUARD_AUTO=1`` and nothing else set; the
script makes its group before it imports ncclguard; ``RecoveringStep(module, opt, scheduler=...)``
over a 2.05M-parameter BERT (``tests/workers/slow_save_worker.py``). After the judge bound is learned
(its 10 s floor) launch rank 0 ``torch.save``s about 25 MiB inside its step function into a FUSE mount
(``tests/fusefs.py``) while ranks 1-2 wait in the step's all_reduce.

Per launch: the close's wait, the actions on any rank (the verdict's, a supervisor's: target 0), the
busy reports naming the close, the rebuilds, whether the file read back is what rank 0 saved, whether
every rank ended with the same parameters.

Usage (needs ``/dev/fuse``, ``fusermount3`` and ``mfusepy``: it says which is missing):
    python benchmarks/slow_save_drill.py --runs 5 --flush-s 60 --json benchmarks/results/slow_save_drill_60s.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent / "tests"))
sys.path.insert(0, str(HERE.parent.parent / "tests" / "workers"))

import torch  # noqa: E402
from fusefs import fuse_missing, slow_mount  # noqa: E402
from harness import run_ranks  # noqa: E402
from slow_save_worker import state_digest  # noqa: E402

ACTIONS = ("acted", "self-asked", "self-fenced", "asked", "ended")


def _one(flush_s: float, write_s: float, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ncclguard-slow-save-") as tmp:
        mount, incidents = Path(tmp) / "mnt", Path(tmp) / "incidents"
        mount.mkdir()
        env = {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": str(incidents)}
        t0 = time.monotonic()
        with slow_mount(mount, Path(tmp) / "release", write_s=write_s, flush_s=flush_s):
            try:
                job = run_ranks(
                    "slow_save_worker", 3, str(mount), timeout_s=timeout_s, supervise=["--restarts=1"], env=env
                )
            except AssertionError as exc:  # a launch that failed or hung: its reason, first line
                return {"ok": False, "error": str(exc).splitlines()[0][:300], "wall_s": round(time.monotonic() - t0, 1)}
            saved = torch.load(mount / "ckpt.pt", weights_only=True)
    res = job.results
    save = res[0]["save"]
    events = [(r, e) for r in res for e in res[r].get("events", [])]
    busy = [e["evidence"] for r, e in events if e["what"] == "busy" and e["rank"] == 0]
    return {
        "ok": True,
        "wall_s": round(job.wall_s, 1),
        "close_wait_s": round(save["ended"] - save["started"], 1),
        "actions": [(r, e["what"], e["rank"]) for r, e in events if e["what"] in ACTIONS],
        "restarted": sorted(r for r in res if r >= 10),
        "rebuilds": [res[r]["rebuilds"] for r in (0, 1, 2)],
        "busy_reports": len(busy),
        "busy_says_close": all(b.startswith("blocked in close() on ") for b in busy),
        "file_whole": state_digest(saved) == save["digest"],
        "equal": len({res[r]["digest"] for r in (0, 1, 2)}) == 1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--flush-s", type=float, default=60.0, help="how long the close() of the saved file waits")
    p.add_argument("--write-s", type=float, default=0.02, help="each write's time (a tensor, at most 1 MiB)")
    p.add_argument("--launch-timeout", type=float, default=400.0, help="hang guard of each launch")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    why = fuse_missing()
    if why is not None:
        sys.exit(f"slow_save_drill: a FUSE mount cannot be made here: {why}")
    rows = []
    for i in range(args.runs):
        row = _one(args.flush_s, args.write_s, args.launch_timeout)
        rows.append(row)
        print(f"{i + 1}/{args.runs}: {json.dumps(row)}", flush=True)
    good = [r for r in rows if r["ok"]]
    summary = {
        "runs": args.runs,
        "flush_s": args.flush_s,
        "ok": len(good),
        "actions": sum(len(r["actions"]) for r in good),
        "restarted": sum(len(r["restarted"]) for r in good),
        "rebuilds": sum(sum(r["rebuilds"]) for r in good),
        "files_whole": sum(r["file_whole"] for r in good),
        "equal": sum(r["equal"] for r in good),
        "close_wait_s": [r["close_wait_s"] for r in good],
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "launches": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
