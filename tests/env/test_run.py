"""ncclguard run's command line, the start-up hook and the one-watchdog rule, without launching ranks
(tests/env/test_run_multirank.py launches them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ncclguard_autostart
import pytest
import torch.distributed as dist
from torch.distributed import device_mesh, distributed_c10d

import ncclguard
from ncclguard.cli import main
from ncclguard.cli.run import plan
from ncclguard.testing.launch import free_port
from ncclguard.watching.watchdog import Watchdog, current_watchdog


def test_options_become_the_ranks_settings_and_torchruns_pass_through(tmp_path: Path) -> None:
    argv = ["--standalone", "--ncclguard-hang-timeout-s", "120", "--nproc-per-node", "4"]
    argv += ["--ncclguard-action=exit", "--ncclguard-incident-dir", "inc", "train.py", "--lr", "0.1"]
    argv += ["--ncclguard-action", "raise"]  # the script's own arguments, whatever they look like
    job = plan(argv, cwd=tmp_path)
    assert job.env == {
        "NCCLGUARD_AUTO": "1",
        "NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S": "120",
        "NCCLGUARD_WATCHDOG_ACTION": "exit",
        "NCCLGUARD_WATCHDOG_INCIDENT_DIR": str(tmp_path / "inc"),
    }
    assert (job.config.hang_timeout_s, job.config.action, job.config.incident_dir) == (120, "exit", tmp_path / "inc")
    t = job.torchrun
    assert (t.standalone, t.nproc_per_node, t.training_script) == (True, "4", "train.py")
    assert t.training_script_args == ["--lr", "0.1", "--ncclguard-action", "raise"]
    assert not job.supervised and not t.module


def test_restarts_run_every_rank_under_its_supervisor(tmp_path: Path) -> None:
    job = plan(["--ncclguard-restarts", "2", "--ncclguard-warm-spare", "-m", "pkg.train", "--x", "1"], cwd=tmp_path)
    t = job.torchrun
    assert job.supervised and t.module and not t.no_python and t.training_script == "ncclguard.supervise"
    assert t.training_script_args == [
        "--restarts",
        "2",
        "--warm-spare",
        "--",
        sys.executable,
        "-m",
        "pkg.train",
        "--x",
        "1",
    ]
    job = plan(["--no-python", "--ncclguard-restarts=1", "./train.sh"], cwd=tmp_path)
    assert job.torchrun.training_script_args == ["--restarts", "1", "--", "./train.sh"]


def test_restarts_make_every_nccl_group_let_a_survivor_of_a_peers_death_live(tmp_path: Path, monkeypatch) -> None:
    """torch's default NCCL error handling (3) ends a survivor when a peer dies (seen on an H200,
    docs/nccl.md): under restarts the ranks' groups are made with 2 (a 3 or a 1 replaced, and said)
    and a bounded dump wait (unless set)."""
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"):
        monkeypatch.delenv(var, raising=False)
    job = plan(["--ncclguard-restarts", "1", "train.py"], cwd=tmp_path)
    assert job.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert job.env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "250"
    assert not any("ERROR_HANDLING" in w for w in job.warnings)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in plan(["train.py"], cwd=tmp_path).env  # no recovery: torch's own
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "30000")
    job = plan(["--ncclguard-restarts", "1", "train.py"], cwd=tmp_path)
    assert job.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC" not in job.env
    said = [w for w in job.warnings if "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 is replaced by 2" in w]
    assert len(said) == 1 and "exit -6" in said[0], job.warnings


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the script to run"),
        (
            ["--ncclguard-hang-timeout", "3", "x.py"],
            "unknown option --ncclguard-hang-timeout (did you mean --ncclguard-hang-timeout-s?)",
        ),
        (
            ["--ncclguard-hang-timeout-s", "0.1", "--ncclguard-heartbeat-s", "1", "x.py"],
            "hang_timeout_s (0.1) must be > heartbeat_s (1.0)",
        ),
        (["--ncclguard-action", "explode", "x.py"], "bad watchdog setting: action: Input should be 'report', 'raise'"),
        (
            ["--ncclguard-warm-spare", "x.py"],
            "--ncclguard-warm-spare and --ncclguard-preload go with --ncclguard-restarts N",
        ),
        (["--ncclguard-restarts", "1", "--run-path", "x.py"], "--run-path runs the script inside torchrun's process"),
    ],
)
def test_bad_usage_says_what_to_change(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=None) as info:
        plan(argv)
    assert message in str(info.value)
    assert main(["run", *argv]) == 2
    assert f"ncclguard run: {info.value}" in capsys.readouterr().err


def test_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--ncclguard-help"]) == 0
    out = capsys.readouterr().out
    assert "--ncclguard-hang-timeout-s VALUE" in out and "--ncclguard-restarts N" in out and "torchrun --help" in out


def test_the_pth_line_imports_the_hook_only_when_the_variable_is_set() -> None:
    """Unset, the line costs a look-up in os.environ and imports nothing; set, it imports the
    hook (a few standard modules), and neither torch nor ncclguard until c10d loads."""
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith(('ncclguard', 'torch'))))"
    env = {k: v for k, v in os.environ.items() if k != "NCCLGUARD_AUTO"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert off.stdout.strip() == "[]"
    on = subprocess.run(
        [sys.executable, "-c", code], env={**env, "NCCLGUARD_AUTO": "1"}, capture_output=True, text=True, timeout=60
    )
    assert on.stdout.strip() == "['ncclguard_autostart']", on.stderr
    zero = subprocess.run(
        [sys.executable, "-c", code], env={**env, "NCCLGUARD_AUTO": "0"}, capture_output=True, text=True, timeout=60
    )
    assert zero.stdout.strip() == "['ncclguard_autostart']"  # imported, and it does nothing: boot() said no
    assert ncclguard_autostart.enabled({"NCCLGUARD_AUTO": "0"}) is False
    assert ncclguard_autostart.enabled({"NCCLGUARD_AUTO": "1"}) is True


@pytest.fixture
def hooked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """init_process_group wrapped as the start-up hook wraps it, for this test only."""
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_INCIDENT_DIR", str(tmp_path))
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_STRAGGLER", "false")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    originals = {m: m.init_process_group for m in (distributed_c10d, dist, device_mesh)}
    try:
        yield
    finally:
        wd = current_watchdog()
        if wd is not None:
            wd.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        for module, fn in originals.items():
            module.init_process_group = fn


def test_the_scripts_own_watchdog_takes_the_place_of_the_one_ncclguard_run_started(
    hooked: None, capsys: pytest.CaptureFixture[str]
) -> None:
    original = distributed_c10d.init_process_group
    assert ncclguard_autostart.patch(distributed_c10d) and ncclguard_autostart.patch(distributed_c10d)
    wrapper = distributed_c10d.init_process_group
    assert wrapper is not original and wrapper.__wrapped__ is original  # type: ignore[attr-defined]
    assert dist.init_process_group is wrapper and device_mesh.init_process_group is wrapper  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    auto = current_watchdog()
    assert auto is not None and auto.gives_way
    err = capsys.readouterr().err
    assert err.count("ncclguard: watching 1 rank(s): hang after 300 s") == 1
    mine = ncclguard.start_watchdog(heartbeat_s=0.2, hang_timeout_s=1.0)
    assert current_watchdog() is mine and not mine.gives_way and auto._thread is None
    with pytest.raises(RuntimeError, match="a Watchdog already runs in this process"):
        Watchdog().start()  # the script's own does not give way
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert current_watchdog() is mine  # a group made again: no second watchdog, no second line
    assert "ncclguard: watching" not in capsys.readouterr().err


# A restarted rank's script that makes its group before it imports ncclguard, as the HF Trainer's,
# Accelerate's and Lightning's docs write it: its init_process_group must stand in (a world of one),
# never wait for the job's first world (nobody listens at MASTER_PORT here: torch would wait its
# whole timeout to connect). Then a join's real group passes through the hook's wrapper.
_RESTARTED_SCRIPT = """
import json, sys, time
import torch.distributed as dist
first = "ncclguard" in sys.modules
t0 = time.monotonic()
try:
    dist.init_process_group("gloo", bogus=1)
except TypeError as exc:
    bad = str(exc)
dist.init_process_group("gloo")
took = time.monotonic() - t0
stood = [dist.get_backend(), dist.get_rank(), dist.get_world_size()]
from ncclguard.recovery._rebuild import stand_in
from ncclguard.watching.watchdog import current_watchdog
active = stand_in.active()
stand_in.leave()
stand_in.torch_init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
joined = [dist.get_backend(), dist.get_rank(), dist.get_world_size()]
watchdog = current_watchdog() is not None
if current_watchdog() is not None:
    current_watchdog().stop()
dist.destroy_process_group()
print(json.dumps(dict(first=first, bad=bad, took=took, stood=stood, active=active, joined=joined, watchdog=watchdog)))
"""


@pytest.mark.parametrize("auto", ["1", None])
def test_a_restarted_process_stands_in_before_the_scripts_first_line_whatever_its_order(
    tmp_path: Path, auto: str | None
) -> None:
    """Under ncclguard run (NCCLGUARD_AUTO=1) and under python -m ncclguard.supervise alone (only the
    restart number set), the .pth hook answers a restarted process's init_process_group with the
    stand-in; a call with bad arguments still gets torch's TypeError; a join's call is torch's own."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLGUARD_", "TORCHELASTIC_"))}
    env.update(
        NCCLGUARD_RESTART_COUNT="1",
        RANK="2",
        LOCAL_RANK="2",
        WORLD_SIZE="3",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NCCLGUARD_WATCHDOG_INCIDENT_DIR=str(tmp_path),
        NCCLGUARD_WATCHDOG_STRAGGLER="false",
    )
    if auto is not None:
        env["NCCLGUARD_AUTO"] = auto
    # Hang guard: an interpreter importing torch twice; torch's own wait here would be 30 minutes.
    out = subprocess.run(
        [sys.executable, "-c", _RESTARTED_SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] is False  # the script had not imported ncclguard
    assert "bogus" in got["bad"]  # torch's own argument error, before any stand-in
    assert got["stood"] == ["fake", 0, 1] and got["active"] is True
    assert got["joined"] == ["gloo", 0, 1]  # the join's group is torch's, through the hook's wrapper
    assert got["watchdog"] is (auto is not None)  # started on the joined world under ncclguard run only
    assert "init_process_group made a stand-in world of one" in out.stderr


def test_a_cold_restart_runs_through_the_spare_where_the_hook_does_not_load(tmp_path: Path) -> None:
    """An interpreter that loads no .pth (``python -S``; ncclguard and torch on PYTHONPATH): the
    supervisor's restart command runs the script through ``ncclguard.supervise.spare --now``, so its
    init_process_group stands in all the same; where the interpreter cannot load ncclguard at all, no
    command is made and the sentence says why. With the hook (this venv), the rank's own command."""
    import json

    from ncclguard.supervise.spare import hook_loads, restart_command

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLGUARD_", "TORCHELASTIC_"))}
    env.update(NCCLGUARD_RESTART_COUNT="1", RANK="2", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    assert hook_loads(sys.executable, env) is True
    script = tmp_path / "train.py"
    script.write_text(_RESTARTED_SCRIPT)
    assert restart_command([sys.executable, str(script)], env, 1) == [sys.executable, str(script)]
    assert restart_command(["bash", "run.sh"], env, 1) == ["bash", "run.sh"]  # not a Python command: as it is

    bare = tmp_path / "python-bare"  # a Python named python*, that reads no .pth
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    assert hook_loads(str(bare), env) is False
    said = restart_command([str(bare), str(script)], env, 1)
    assert isinstance(said, str) and "loads neither ncclguard's start-up hook nor ncclguard" in said

    repo = Path(ncclguard.__file__).resolve().parent.parent
    sites = [p for p in sys.path if p.endswith("site-packages")]  # torch, pydantic: their .pth files unread
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *sites])
    cmd = restart_command([str(bare), str(script)], env, 1)
    assert cmd == [str(bare), "-m", "ncclguard.supervise.spare", "--now", "1", "--", str(bare), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["stood"] == ["fake", 0, 1] and got["joined"] == ["gloo", 0, 1]


def test_the_launcher_serves_its_nodes_store_where_the_tier_can_be_on(tmp_path: Path, monkeypatch) -> None:
    """docs/scale.md: ``ncclguard run`` serves the node tier's store of its node (one per process) for
    a job of more than one node, unless the tier is off; its ranks find it in NCCLGUARD_NODE_STORE."""
    from ncclguard.cli.run import _serve_node_store
    from ncclguard.store.clients import connect

    monkeypatch.delenv("NCCLGUARD_WATCHDOG_NODE_TIER", raising=False)
    one = ["--standalone", "--nproc-per-node", "2", "train.py"]
    assert _serve_node_store(plan(one, cwd=tmp_path)) == ""
    addr = _serve_node_store(plan(["--nnodes", "2", "--nproc-per-node", "2", "train.py"], cwd=tmp_path))
    host, _, port = addr.rpartition(":")
    assert host == "127.0.0.1"
    client = connect(host, int(port), 10.0)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert _serve_node_store(plan(["--nnodes", "1:4", "train.py"], cwd=tmp_path)) == addr  # one for the process
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_NODE_TIER", "off")
    assert _serve_node_store(plan(["--nnodes", "2", "train.py"], cwd=tmp_path)) == ""
