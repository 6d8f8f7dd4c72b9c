"""ncclguard switched on without a line changed, on real gloo ranks.

tests/workers/plain_ddp.py is a DDP training script with no ncclguard in it; one rank sleeps in
``evaluate()`` for longer than the hang timeout while the others wait in DDP's next bucket
all_reduce (issued from C++). Three launches, run at once:

1. ``python -m ncclguard run --nproc-per-node 3`` (settings as ``--ncclguard-*`` options; the
   group made by ``init_process_group``): the incident, in the configured directory, names rank 2
   and ``evaluate``; the job exits with the script's own status (3); rank 0 prints the status
   command once; one watchdog per rank; the picture and the trace carry the story.
2. plain ``torchrun --nproc-per-node 2`` with ``NCCLGUARD_AUTO=1`` (settings from
   ``NCCLGUARD_WATCHDOG_*``; the group made by ``init_device_mesh``): the same incident, naming rank 1.
3. ``ncclguard run --ncclguard-restarts 1`` on one rank whose first process exits 5: the supervisor
   restarts it and the job exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import _kill_job

from ncclguard.cli import main

pytestmark = pytest.mark.multirank
WORKERS = Path(__file__).parents[1] / "workers"
WORKER = str(WORKERS / "plain_ddp.py")
PNG = b"\x89PNG\r\n\x1a\n"
# The slow rank sleeps EVAL_S; the incident is merged ~2.5 s after the others start waiting
# (HANG_S + a beat + the merge), so the culprit is still in evaluate() when it speaks: about 5x
# with three launches at once.
HANG_S, HEARTBEAT_S, EVAL_S = 2.0, 0.5, 12.0
# Hang guard: a loaded 2-core machine starts three ranks (torch, DDP) in 20-35 s; the job then runs
# ~EVAL_S more. Over 3x that.
JOB_GUARD_S = 240.0


class Launch:
    """A launcher and its ranks, started now, run to its end within JOB_GUARD_S by :meth:`finish`.

    The three launches of this module run at once: most of each is a rank asleep in evaluate() or
    importing torch, and their sleeps overlap."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.started = cmd, time.monotonic()
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def finish(self) -> tuple[int, str]:
        """(exit status, output); kills the job and fails past the guard."""
        try:
            rc = self.proc.wait(timeout=max(1.0, JOB_GUARD_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            _kill_job(self.proc)
            self.proc.wait()
            self.log.seek(0)
            raise AssertionError(
                f"{self.cmd[:6]} did not finish within {JOB_GUARD_S} s\n{self.log.read()[-8000:]}"
            ) from None
        self.log.seek(0)
        out = self.log.read()
        self.log.close()
        return rc, out


def results(output: str) -> dict[int, dict]:
    """Each rank's ``RESULT {json}``, wherever it is: the ranks share torchrun's output, and two
    ranks' lines have been seen run together on one line."""
    found = {}
    decoder = json.JSONDecoder()
    for part in output.split("RESULT ")[1:]:
        got, _ = decoder.raw_decode(part)
        found[got["rank"]] = got
    return found


def check_incident(root: Path, slow: int, world: int, out: Path) -> None:
    """The one incident under ``root`` names ``slow`` in evaluate(), and its pictures tell it."""
    (where,) = sorted(root.iterdir())
    incident = json.loads((where / "incident.json").read_text())
    assert incident["incident"]["kind"] == "desync"
    assert [(c["rank"], c["why"], c["func"]) for c in incident["culprits"]] == [(slow, "behind", "evaluate")]
    assert incident["victims"] == [r for r in range(world) if r != slow]
    assert (
        f"rank {slow} last completed" in incident["summary"]
        and "now in evaluate() at plain_ddp.py:" in (incident["summary"])
    )
    summary = (where / "summary.txt").read_text()
    assert f"main thread in evaluate() at {WORKER}:" in summary
    for r in range(world):
        dump = json.loads((where / f"rank{r}.json").read_text())
        # torch's flight recorder was on and read: DDP's bucket all_reduces, issued from C++.
        names = {e["name"] for e in dump["backend"]}
        assert "gloo:all_reduce" in names, names
        still = [e for e in dump["backend"] if e["open"]]
        assert len(still) == (0 if r == slow else 1), still
        assert dump["track"][-1]["func"] == ("evaluate" if r == slow else "main"), dump["track"][-1]
    assert (where / "timeline.png").read_bytes()[:8] == PNG
    trace = out
    assert main(["report", str(where), "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    last = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == slow and e["tid"] == 1][-1]
    assert last == "evaluate()"
    culprit = [e["name"] for e in events if e["ph"] == "i" and e.get("s") == "p"]
    assert len(culprit) == 1 and culprit[0].startswith("culprit (behind): evaluate() at plain_ddp.py:")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """The three launches, run at once: name -> (their directory, exit status, output)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("run", "torchrun", "restart")}
    # 1. ncclguard run, 3 ranks, settings as options, incidents in a relative directory.
    options = ["--ncclguard-hang-timeout-s", str(HANG_S), f"--ncclguard-heartbeat-s={HEARTBEAT_S}"]
    options += ["--ncclguard-incident-dir", "incidents", "--ncclguard-straggler", "false"]
    run = [sys.executable, "-m", "ncclguard", "run", "--standalone", "--nproc-per-node", "3", *options]
    run += ["--monitor-interval", "0.1", WORKER, "--slow-rank", "2", "--eval-s", str(EVAL_S), "--exit-code", "3"]
    # 2. plain torchrun, 2 ranks, the variable alone and the settings' variables; init_device_mesh.
    env = {
        "NCCLGUARD_AUTO": "1",
        "NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S": str(HANG_S),
        "NCCLGUARD_WATCHDOG_HEARTBEAT_S": str(HEARTBEAT_S),
        "NCCLGUARD_WATCHDOG_INCIDENT_DIR": str(dirs["torchrun"] / "incidents"),
        "NCCLGUARD_WATCHDOG_STRAGGLER": "false",
    }
    plain = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    plain += ["--monitor-interval", "0.1", WORKER, "--mesh", "--slow-rank", "1", "--eval-s", str(EVAL_S)]
    # 3. ncclguard run --ncclguard-restarts 1, one rank that needs no torch: its first process
    # fails (5), its restart succeeds.
    script = dirs["restart"] / "once.py"
    script.write_text(
        "import os, sys\n"
        "print('life', os.environ.get('NCCLGUARD_RESTART_COUNT', '0'), 'auto', os.environ.get('NCCLGUARD_AUTO'))\n"
        "sys.exit(0 if os.environ.get('NCCLGUARD_RESTART_COUNT') == '1' else 5)\n"
    )
    again = [sys.executable, "-m", "ncclguard", "run", "--ncclguard-restarts", "1", "--standalone"]
    again += ["--nproc-per-node", "1", "--monitor-interval", "0.1", str(script)]
    started = {
        "run": Launch(run, dirs["run"]),
        "torchrun": Launch(plain, dirs["torchrun"], env),
        "restart": Launch(again, dirs["restart"]),
    }
    return {name: (dirs[name], *job.finish()) for name, job in started.items()}


def test_ncclguard_run_names_the_rank_in_evaluate_and_exits_with_the_scripts_status(jobs) -> None:
    where, rc, out = jobs["run"]
    root = where / "incidents"
    assert rc == 3, out[-6000:]
    assert out.count("python -m ncclguard status --store ") == 1, out[-6000:]
    assert f"ncclguard: watching 3 rank(s): hang after {HANG_S:g} s, ladder report, incidents in {root}" in out
    assert {r: got["watchdog_threads"] for r, got in results(out).items()} == {0: 1, 1: 1, 2: 1}
    check_incident(root, slow=2, world=3, out=where / "trace.json")
    assert sorted(p.name for p in where.iterdir()) == ["incidents", "trace.json"]  # nothing else written


def test_plain_torchrun_with_the_variable_alone_does_the_same(jobs) -> None:
    where, rc, out = jobs["torchrun"]
    assert rc == 0, out[-6000:]
    assert out.count("python -m ncclguard status --store ") == 1, out[-6000:]
    assert {r: got["watchdog_threads"] for r, got in results(out).items()} == {0: 1, 1: 1}
    check_incident(where / "incidents", slow=1, world=2, out=where / "trace.json")


def test_ncclguard_run_restarts_a_rank_alone_under_its_supervisor(jobs) -> None:
    _, rc, out = jobs["restart"]
    assert rc == 0, out[-6000:]
    assert [line for line in out.splitlines() if line.startswith("life")] == ["life 0 auto 1", "life 1 auto 1"]
    assert "the rank (pid " in out and "exited 5; restart 1 of 1" in out
