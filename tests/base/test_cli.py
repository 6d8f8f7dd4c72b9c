"""One command line in torchrun's conventions (ncclguard/cli/__init__.py): every command under
``ncclguard``, ``--version``, ``--help`` without importing a command, unknown names refused, both
spellings of ``run``'s options, ``report``'s default directory. No ranks launched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ncclguard.cli import COMMANDS, main, version
from ncclguard.cli.run import plan


def test_every_command_is_one_entry_point_with_a_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(COMMANDS) == ["run", "supervise", "bench", "status", "report", "doctor", "demo"]
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"ncclguard {version()}"
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2 and "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["supervise", "--help"])  # the supervisor's own parser, reached through the one entry point
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--restarts" in out and out.startswith("usage: ncclguard supervise ")
    from ncclguard.bench.arguments import build_parser

    assert build_parser().format_usage().startswith("usage: ncclguard bench ")  # one name in every help


def test_help_imports_no_command_and_no_torch() -> None:
    code = (
        "import sys\nfrom ncclguard.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0\nprint(sorted(m for m in sys.modules if m == 'torch' or m.startswith('ncclguard.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "ncclguard demo" not in out and out.strip().endswith("[]"), out
    assert all(f"  {name} " in out for name in COMMANDS), out


def test_run_takes_both_spellings_of_its_options_and_leaves_the_scripts_alone(tmp_path: Path) -> None:
    argv = ["--ncclguard-hang_timeout_s", "120", "--ncclguard-incident_dir=inc", "--nproc_per_node", "2"]
    job = plan([*argv, "train.py", "--ncclguard-hang_timeout_s", "7"], cwd=tmp_path)
    assert job.env["NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S"] == "120"
    assert job.env["NCCLGUARD_WATCHDOG_INCIDENT_DIR"] == str(tmp_path / "inc")
    assert job.torchrun.nproc_per_node == "2"
    assert job.torchrun.training_script_args == ["--ncclguard-hang_timeout_s", "7"]  # the script's, as given


def test_an_unknown_demo_act_is_refused_with_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--only", "demo_desynk"]) == 2
    err = capsys.readouterr().err
    assert "no act named 'demo_desynk'" in err and "demo_desync" in err


def test_report_reads_where_the_watchdog_writes_when_given_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NCCLGUARD_WATCHDOG_INCIDENT_DIR", raising=False)
    assert main(["report"]) == 2
    assert "none at ncclguard-incidents (the default here)" in capsys.readouterr().out
    fixtures = Path(__file__).parents[1] / "fixtures" / "incidents_v1"
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_INCIDENT_DIR", str(fixtures))
    assert main(["report", "--list"]) == 0
    assert "20261122-090619-001" in capsys.readouterr().out


def test_a_bad_setting_is_said_in_the_users_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--ncclguard-hang-timeout-s", "0.1", "--ncclguard-heartbeat-s", "1", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "ncclguard run: bad watchdog setting: hang_timeout_s (0.1) must be > heartbeat_s (1.0)" in err, err
    assert "Value error" not in err
