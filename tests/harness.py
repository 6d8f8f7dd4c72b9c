"""Launching real multi-rank jobs from a test: bounded in time, results read back as JSON.

A worker script (tests/workers/*.py) runs on every rank, uses the fault vocabulary of
``workers/rankkit.py`` (stall, kill, leave, skip_collective) and saves what it saw with
``rankkit.save(...)``; the test asserts on ``Job.results[rank]``.

Every launch is also checked for issue 59's rule (:func:`check_health`): a launch in which no fault
fired ends with no rebuild (world generation 0) and no lost snapshot take on every rank; a launch
with faults, up to its first fault.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import psutil

from ncclguard.testing.launch import spawn

T = TypeVar("T")
WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).parent.parent


@dataclass
class Job:
    """A finished multi-rank launch."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    returncodes: dict[int, int | None] = field(default_factory=dict)
    output: str = ""
    wall_s: float = 0.0
    out_dir: Path | None = None
    restarts: list[Any] = field(default_factory=list)  # spawn's Restart records
    lives: dict[int, list[int | None]] = field(default_factory=dict)  # exit code of each process, by rank
    faults: list[dict[str, Any]] = field(default_factory=list)  # rankkit's line of each fault fired, any rank
    health: str = ""  # what check_health checked, in words

    def __getitem__(self, rank: int) -> dict[str, Any]:
        if rank not in self.results:
            raise AssertionError(
                f"rank {rank} saved no results (rc={self.returncodes.get(rank)})\n{self.output[-6000:]}"
            )
        return self.results[rank]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package), registered
    under ``name`` so that its dataclasses and its pickled worker functions resolve."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wait_for(ready: Callable[[], T], bound_s: float, what: str, every_s: float = 0.005) -> T:
    """Polls ``ready()`` until it returns something truthy, and returns that: a test orders its
    threads and processes by what happened, not by how fast a loaded machine ran them.

    Args:
        ready: the condition (or the value waited for).
        bound_s: a hang guard, not a speed target.
        what: what is waited for, in words, for the failure.
        every_s: the pause between looks.

    Raises:
        AssertionError: nothing truthy within ``bound_s``.
    """
    end = time.monotonic() + bound_s
    while not (got := ready()):
        assert time.monotonic() < end, f"hang guard: no {what} within {bound_s} s"
        time.sleep(every_s)
    return got


def _kill_job(proc: subprocess.Popen) -> None:
    """Kills torchrun and every rank it started: torchrun starts each rank in a session of its
    own, so killing torchrun's process group alone left ranks running (orphans that loaded the
    machine for the tests after, seen in a fresh-clone run)."""
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    # First SIGABRT: faulthandler (PYTHONFAULTHANDLER, set for every rank) writes each thread's
    # Python stack into the launch's log, which says where a hung rank was.
    for child in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGABRT)
    psutil.wait_procs(ranks, timeout=5)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in ranks:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the rank's own session, with what it started
        except (ProcessLookupError, PermissionError):
            pass
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


LAUNCH_LOG = "launch.log"  # the job's whole output, in its directory


def _failed(what: str, output: str, out_dir: Path) -> AssertionError:
    """A launch's failure: what went wrong, the output's tail, and where the whole output is."""
    log = out_dir / LAUNCH_LOG
    if not log.exists():  # the spawn launcher keeps its output in memory
        log.write_text(output)
    return AssertionError(f"{what} (whole output: {log})\n{output[-8000:]}")


HEALTH_KEY = "_ncclguard"  # rankkit.HEALTH_KEY: a rank's world generation and lost takes
FAULTS_FILE = "faults.jsonl"  # rankkit.FAULTS_FILE: one line per fault fired, any rank
# A rank started again: ncclguard's launcher's line, or its supervisor's (ncclguard.supervise).
RESTARTED = re.compile(r"exited -?\d+; restart \d+|; restart \d+ of \d+")


def launch_faults(job: Job, fault_free: bool | None = None) -> list[str]:
    """Why a finished launch is not fault-free, in words (empty: it is).

    Args:
        job: the launch, its faults read back.
        fault_free: False where the test injects a fault the ranks cannot see (a network, a mount);
            None or True: what the launch shows decides.

    Returns:
        The faults fired, an exit other than 0, a restart; empty for a fault-free launch.
    """
    why = ["the test says it injects a fault (fault_free=False)"] if fault_free is False else []
    why += [f"rank {f.get('rank')}: {f.get('what')}" for f in job.faults]
    if codes := {r: rc for r, rc in job.returncodes.items() if rc != 0}:
        why.append(f"exit codes {codes}")
    if job.restarts or any(len(lives) > 1 for lives in job.lives.values()) or RESTARTED.search(job.output):
        why.append("a rank was restarted")
    return why


def _unhealthy(health: dict[str, Any]) -> bool:
    return bool(health.get("generation") or health.get("failed_takes"))


def check_health(job: Job, fault_free: bool | None = None) -> None:
    """Issue 59's rule for every launch: a fault-free run rebuilds nothing and loses no snapshot take.

    A launch in which no fault fired (:func:`launch_faults`) must end on every rank that saved its
    results in world generation 0 with no take lost. A launch with faults is held to it up to its
    first fault: the rank that fired it was in generation 0 with no take lost then (a rebuild, and
    a take's outcome, are the same on every rank). Sets ``job.health`` to what was checked.

    Args:
        job: the finished launch, its results and faults read back.
        fault_free: as :func:`launch_faults`; True also fails a launch in which a fault fired.

    Raises:
        AssertionError: a rank rebuilt or lost a take where no fault came before, naming the rank
            and its numbers.
    """
    faults = launch_faults(job, fault_free)
    if fault_free and faults:
        raise AssertionError(f"a launch declared fault-free had faults: {'; '.join(faults)}")
    if not faults:
        bad = {r: res[HEALTH_KEY] for r, res in sorted(job.results.items()) if _unhealthy(res.get(HEALTH_KEY, {}))}
        if bad:
            said = "; ".join(
                f"rank {r}: generation {h['generation']}, {h['failed_takes']} failed take(s)" for r, h in bad.items()
            )
            raise AssertionError(f"a fault-free launch rebuilt or lost a snapshot take (issue 59: none may): {said}")
        job.health = f"fault-free: {sum(HEALTH_KEY in res for res in job.results.values())} rank(s) checked"
        return
    first = min(job.faults, key=lambda f: f.get("at", 0.0)) if job.faults else None
    if first is None or "generation" not in first:  # no line, or ncclguard not yet imported there
        job.health = f"not checked: {'; '.join(faults)}"
        return
    if _unhealthy(first):
        raise AssertionError(
            f"before the launch's first fault (rank {first['rank']}: {first['what']}) that rank was in world "
            f"generation {first['generation']} with {first['failed_takes']} failed take(s): the fault-free part "
            "rebuilt or lost a snapshot take (issue 59: none may), or a fault before it is not marked "
            "(rankkit.fault_fired)"
        )
    job.health = f"checked up to its first fault (rank {first['rank']}: {first['what']})"


def _read_back(job: Job) -> None:
    """The ranks' results and the faults they fired, from the launch's directory."""
    assert job.out_dir is not None
    for path in job.out_dir.glob("rank*.json"):
        job.results[int(path.stem[4:])] = json.loads(path.read_text())
    log = job.out_dir / FAULTS_FILE
    if log.exists():
        job.faults = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def run_ranks(
    worker: str,
    nproc: int,
    *args: str,
    timeout_s: float = 90.0,
    launcher: str = "torchrun",
    env: dict[str, str] | None = None,
    expect_rc: dict[int, int] | None = None,
    restarts: int = 0,
    restart_on: Sequence[int] | None = None,
    supervise: Sequence[str] | None = None,
    fault_free: bool | None = None,
) -> Job:
    """Runs ``tests/workers/<worker>.py <args>`` on ``nproc`` ranks and returns their results.

    Args:
        worker: script name under tests/workers, without ``.py``.
        nproc: ranks.
        *args: arguments for the script (usually a scenario name).
        timeout_s: hard wall-clock bound; the job is killed and the test fails past it.
        launcher: ``"torchrun"`` (``torchrun --standalone``) or ``"spawn"`` (ncclguard's
            launcher, which does not tear the job down when one rank dies).
        env: extra environment for the ranks.
        expect_rc: exit codes to require per rank (spawn only); default: every rank exits 0.
        restarts: restarts per rank that died (spawn only; see ``spawn(restarts=)``).
        restart_on: the exit codes that earn a restart (spawn's ``restart_on``).
        supervise: torchrun only: run each rank under ``python -m ncclguard.supervise`` with these
            options (``["--restarts=1"]``: a rank restarted alone, without torchrun's teardown).
        fault_free: False for a launch whose fault the test injects from outside the ranks (see
            :func:`check_health`, run on every launch); None: the faults the ranks fired decide.

    Raises:
        AssertionError: the launch ran past ``timeout_s``, exited otherwise than expected, or
            rebuilt or lost a snapshot take with no fault before (:func:`check_health`).
    """
    out_dir = Path(tempfile.mkdtemp(prefix=f"ncclguard-{worker}-"))
    rank_env = {**os.environ, "NCCLGUARD_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    rank_env.update(env or {})
    # The worker imports rankkit from tests/workers; ncclguard comes from the installed package.
    rank_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKERS), rank_env.get("PYTHONPATH")]))
    script = [str(WORKERS / f"{worker}.py"), *args]
    job = Job(out_dir=out_dir)
    start = time.monotonic()
    if launcher == "torchrun":
        cmd: Sequence[str] = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--monitor-interval=0.1",
            *(
                script
                if supervise is None
                else ["-m", "ncclguard.supervise", *supervise, "--", sys.executable, *script]
            ),
        ]
        # The whole output stays in the job's directory: a failure message keeps only its tail, and
        # the line that explains a rank's end (an abort's message) may come long before it.
        with open(out_dir / LAUNCH_LOG, "w+") as log:
            proc = subprocess.Popen(
                cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=REPO
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_job(proc)
                proc.wait()
                log.seek(0)
                raise _failed(f"{worker} {args} did not finish within {timeout_s} s", log.read(), out_dir) from None
            log.seek(0)
            job.output = log.read()
        job.returncodes = {r: rc for r in range(nproc)}
        if rc != 0:
            raise _failed(f"torchrun {worker} {args} exited {rc}", job.output, out_dir)
    elif launcher == "spawn":
        res = spawn(
            [sys.executable, *script],
            nproc,
            timeout_s=timeout_s,
            env=rank_env,
            cwd=str(REPO),
            restarts=restarts,
            restart_on=restart_on,
        )
        job.output = res.output()
        job.returncodes = {r.rank: r.returncode for r in res.ranks}
        job.restarts, job.lives = res.restarts, {r.rank: r.lives for r in res.ranks}
        if res.timed_out:
            raise _failed(f"{worker} {args} did not finish within {timeout_s} s", job.output, out_dir)
        want = {r: (expect_rc or {}).get(r, 0) for r in range(nproc)}
        if job.returncodes != want:
            raise _failed(f"{worker} {args}: exit codes {job.returncodes}, expected {want}", job.output, out_dir)
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    job.wall_s = time.monotonic() - start
    _read_back(job)
    try:
        check_health(job, fault_free)
    except AssertionError as exc:
        raise _failed(f"{worker} {args}: {exc}", job.output, out_dir) from None
    return job
