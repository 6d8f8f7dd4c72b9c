"""Nothing outlives its launcher (issue 45, "do no harm"): a launcher SIGKILLed (the OOM killer, a lost
node agent) leaves no process of its job running.

Every job runs tests/workers/launcher_death_worker.py on 2 ranks: each rank writes that it runs, then
sleeps in a loop and never exits by itself. Once every rank has written, the test notes the job's
processes (the launcher's process tree, with psutil, and the orphan guard, found by its command line),
SIGKILLs the launcher and polls until none of them is left, within a hang guard (the library's bound,
10 s with the default stop grace, is what docs/run.md says; a loaded machine may be slower). Three
launches, one after the other:

- ``ncclguard run --ncclguard-restarts 2 --standalone --nproc-per-node 2``: the supervisors learn of
  the launcher's end (SIGHUP from PR_SET_PDEATHSIG, or their poll of their parent) and the orphan
  guard sends them SIGTERM, whichever comes first: each stops its rank without a restart;
- ``ncclguard run --standalone --nproc-per-node 2`` (plain ranks): the orphan guard ends them;
- ``torchrun --standalone --nproc-per-node 2 -m ncclguard.supervise --restarts 2 -- python WORKER``
  (no ``ncclguard run``, no guard): the supervisors alone end their ranks and themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from harness import _kill_job, wait_for

pytestmark = pytest.mark.multirank

REPO = Path(__file__).parents[2]
WORKER = str(REPO / "tests" / "workers" / "launcher_death_worker.py")
START_GUARD_S = 120.0  # hang guard: two ranks (no torch in them) and their launcher start on a loaded 2-core machine
GONE_GUARD_S = 30.0  # hang guard for the job's end after the launcher's SIGKILL (the bound is 10 s)


def _alive(procs: list[psutil.Process]) -> list[int]:
    """The pids still running (a zombie has ended: it only waits to be reaped)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _guards(launcher: int) -> list[psutil.Process]:
    """The orphan guard of ``launcher``: ``python -S .../reaper.py --token <launcher>-<hex> ...``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(a.endswith("reaper.py") for a in cmd) and any(a.startswith(f"{launcher}-") for a in cmd):
            found.append(p)
    return found


def _kill_launcher(cmd: list[str]) -> tuple[list[int], list[int], str]:
    """Runs ``cmd`` until both ranks run, SIGKILLs it, and waits for its job to end.

    Returns:
        (the pids of the job noted before the kill, those still running after the guard, the output).
    """
    out = Path(tempfile.mkdtemp(prefix="ncclguard-orphan-"))
    log = tempfile.TemporaryFile("w+")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*cmd, str(out)], cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    procs: list[psutil.Process] = []
    try:
        wait_for(
            lambda: proc.poll() is not None or all((out / f"running-{r}").exists() for r in (0, 1)),
            START_GUARD_S,
            "two ranks running",
            every_s=0.05,
        )
        assert proc.poll() is None, "the launcher ended before its ranks ran"
        ranks = [psutil.Process(int((out / f"running-{r}").read_text())) for r in (0, 1)]
        procs = [*psutil.Process(proc.pid).children(recursive=True), *_guards(proc.pid)]
        assert all(r in procs for r in ranks), (ranks, procs)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        end = time.monotonic() + GONE_GUARD_S
        while _alive(procs) and time.monotonic() < end:
            time.sleep(0.05)
        left = _alive(procs)
    finally:
        if proc.poll() is None:
            _kill_job(proc)
        for p in procs:  # whatever the assertion finds, nothing is left for the tests after
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    log.seek(0)
    return [p.pid for p in procs], left, log.read()


def test_a_supervised_job_ends_with_its_killed_launcher() -> None:
    run = [sys.executable, "-m", "ncclguard", "run", "--ncclguard-restarts", "2", "--standalone"]
    noted, left, output = _kill_launcher([*run, "--nproc-per-node", "2", WORKER])
    assert len(noted) == 5, output[-3000:]  # 2 supervisors, 2 ranks, the guard
    assert left == [], output[-3000:]
    # Both ranks stopped, none restarted: by its supervisor (which saw the launcher go) or by the guard's
    # SIGTERM, whichever came first.
    assert output.count(": told to stop, it stays down") == 2, output[-3000:]
    assert "restart 1 of 2" not in output


def test_plain_ranks_end_with_their_killed_launcher() -> None:
    run = [sys.executable, "-m", "ncclguard", "run", "--standalone", "--nproc-per-node", "2", WORKER]
    noted, left, output = _kill_launcher(run)
    assert len(noted) == 3, output[-3000:]  # 2 ranks, the guard
    assert left == [], output[-3000:]
    assert "ncclguard run: the launcher is gone without ending its job: SIGTERM to its 2 processes" in output


def test_supervisors_under_plain_torchrun_end_with_it() -> None:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    noted, left, output = _kill_launcher(
        [*run, "-m", "ncclguard.supervise", "--restarts", "2", "--", sys.executable, WORKER]
    )
    assert len(noted) == 4, output[-3000:]  # 2 supervisors, 2 ranks: no guard without ncclguard run
    assert left == [], output[-3000:]
    assert output.count(" is gone: stopping the rank (SIGTERM, SIGKILL after 8 s), no restart") == 2, output[-3000:]
