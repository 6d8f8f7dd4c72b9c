"""`python -m ncclguard doctor`: the table, --json, --export, bad input, and --check-ranks under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ncclguard.cli import main
from ncclguard.cli.doctor import compare_ranks
from ncclguard.env.envvars import DEPRECATED, IGNORED

REPO = Path(__file__).parents[2]
REPORT_KEYS = {
    "host",
    "rank",
    "plan",
    "sockets",
    "variables",
    "timeouts",
    "versions",
    "warnings",
    "ok",
    "backend",
    "to_set",
}
# Variables the tests decide on; anything of the runner's environment among them is removed.
CONTROLLED = [
    *IGNORED,
    *DEPRECATED,
    *DEPRECATED.values(),
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "NCCL_SOCKET_FAMILY",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "DEEPSPEED_TIMEOUT",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCHELASTIC_RUN_ID",
]
SEEDS_ENV = {
    "NCCL_TIMEOUT": "1800",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "16384",
    "NCCL_SOCKET_IFNAME": "lo",
}


@pytest.fixture
def env(monkeypatch):
    for name in CONTROLLED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # rich: one table row per line
    return monkeypatch


def _doctor(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["doctor", "--master-addr", "127.0.0.1", "--backend", "gloo", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_names_every_variable_the_seeds_set(env, capsys):
    for name, value in SEEDS_ENV.items():
        env.setenv(name, value)
    rc, out, _ = _doctor(capsys, "--json")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert set(report) == REPORT_KEYS
    assert (report["plan"]["interface"], report["plan"]["target_source"]) == ("lo", "argument")
    # The socket plan a rank would apply at start (the same function): the user's NCCL interface kept
    # (lo reaches a loopback master), gloo's default left (it binds loopback, which is where the master is).
    sockets = report["sockets"]
    assert (sockets["master"], sockets["interface"], sockets["refusal"]) == ("127.0.0.1", "lo", None)
    assert [(c["variable"], c["action"], c["value"]) for c in sockets["choices"]] == [
        ("GLOO_SOCKET_IFNAME", "left", None),
        ("NCCL_SOCKET_IFNAME", "kept", "lo"),
    ]
    rows = {v["name"]: (v["value"], v["recommended"], v["status"]) for v in report["variables"]}
    assert rows == {
        "NCCL_SOCKET_IFNAME": ("lo", "=lo", "set by user"),
        "GLOO_SOCKET_IFNAME": (None, "lo", "unset"),
        "NCCL_IB_DISABLE": (None, "1", "unset"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": (None, "3", "set by user"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": (None, "1", "unset"),
        "TORCH_FR_BUFFER_SIZE": (None, "2000", "set by user"),
        "NCCL_ASYNC_ERROR_HANDLING": ("1", None, "deprecated"),
        "NCCL_TIMEOUT": ("1800", None, "ignored by NCCL and PyTorch"),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": ("16384", None, "deprecated"),
    }
    assert [w.split(":")[0] for w in report["warnings"]] == [
        "NCCL_TIMEOUT=1800 does nothing",
        "NCCL_ASYNC_ERROR_HANDLING is deprecated",
        "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated",
    ]
    timeouts = {r["name"]: r["seconds"] for r in report["timeouts"]["rows"]}
    # ncclguard's default deadline is capped below the group's timeout: 1800 x 0.9 - 0.5.
    assert timeouts["per-op deadline"] == 1619.5 and timeouts["process-group timeout"] == 1800
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["gloo"] == f"built into torch {torch.__version__}"


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("group_timeout", [None, "600", "1800", "3600"])
def test_with_the_defaults_doctor_says_nothing_about_timeouts(env, capsys, backend, group_timeout):
    args = ["--json", "--backend", backend] + (["--group-timeout", group_timeout] if group_timeout else [])
    rc, out, _ = _doctor(capsys, *args)
    report = json.loads(out)
    assert report["timeouts"]["problems"] == []
    assert [w for w in report["warnings"] if w.startswith("timeouts")] == []
    rows = {r["name"]: r["seconds"] for r in report["timeouts"]["rows"]}
    assert rows["per-op deadline"] < rows["process-group timeout"]
    assert rows["barrier deadline"] < rows["process-group timeout"]


def test_clean_environment_exits_zero(env, capsys):
    rc, out, _ = _doctor(capsys, "--json", "--group-timeout", "3600")
    report = json.loads(out)
    assert (rc, report["ok"], report["warnings"], report["timeouts"]["problems"]) == (0, True, [], [])
    assert {v["status"] for v in report["variables"]} == {"unset"}


def test_old_pg_timeout_flag_still_works_and_is_hidden(env, capsys):
    rc_new, new, _ = _doctor(capsys, "--json", "--group-timeout", "900")
    rc_old, old, _ = _doctor(capsys, "--json", "--pg-timeout", "900")
    assert rc_new == rc_old and json.loads(new)["timeouts"] == json.loads(old)["timeouts"]
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    help_text = capsys.readouterr().out
    assert "--group-timeout" in help_text and "--pg-timeout" not in help_text


def test_table(env, capsys):
    for name, value in SEEDS_ENV.items():
        env.setenv(name, value)
    rc, out, _ = _doctor(capsys)
    assert rc == 1
    for title in ("network of", "environment variables", "timeout hierarchy", "versions", "3 warning(s):"):
        assert title in out, title
    lines = out.splitlines()
    row = next(line for line in lines if "│ NCCL_TIMEOUT " in line)
    assert "1800" in row and "ignored by NCCL and PyTorch" in row
    row = next(line for line in lines if "│ interface " in line)
    assert "│ lo " in row
    assert "127.0.0.1 [argument]" in out
    assert "  - NCCL_TIMEOUT=1800 does nothing: neither NCCL nor PyTorch reads it;" in out
    for name in SEEDS_ENV:
        env.delenv(name)
    rc, out, _ = _doctor(capsys, "--group-timeout", "3600")
    assert rc == 0 and out.rstrip().endswith("nothing to change.")


def test_export_lines(env, capsys):
    env.setenv("NCCL_TIMEOUT", "1800")
    env.setenv("NCCL_IB_DISABLE", "0")
    rc, out, _ = _doctor(capsys, "--export")
    assert rc == 1
    assert out.splitlines() == [
        "# ncclguard doctor for " + os.uname().nodename + ": peer 127.0.0.1 via lo",
        "export NCCL_SOCKET_IFNAME==lo",
        "export GLOO_SOCKET_IFNAME=lo",
        "# NCCL_IB_DISABLE is yours (0); ncclguard would set 1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
        "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
        "export TORCH_FR_BUFFER_SIZE=2000",
        "# NCCL_TIMEOUT=1800: ignored by NCCL and PyTorch; " + IGNORED["NCCL_TIMEOUT"],
    ]


def test_bad_input_and_check_ranks_outside_a_launcher(env, capsys):
    rc = main(["doctor", "--master-addr", "a b"])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "")
    assert err.startswith("doctor: master address 'a b' is neither an IP address nor a valid hostname")
    rc = main(["doctor", "--master-addr", "127.0.0.1", "--check-ranks"])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "")
    assert "torchrun --nproc_per_node=2 -m ncclguard doctor --check-ranks" in err
    for bad in (["--json", "--export"], ["--group-timeout", "0"], ["--group-timeout", "ten"], ["--timeout", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["doctor", *bad])  # argparse refuses it, with status 2
        assert exc.value.code == 2
    assert "expected a positive number of seconds, got '0'" in capsys.readouterr().err


def _payload(interface: str, torch_version: str, **env: str) -> dict:
    return {
        "host": "h",
        "plan": {"interface": interface},
        "versions": {"torch": torch_version},
        "env": env,
        "warnings": 0,
    }


def test_compare_ranks_names_the_disagreements():
    same = {r: _payload("eth0", "2.13.0") for r in range(4)}
    assert compare_ranks(same) == []
    mixed = {
        0: _payload("eth0", "2.13.0"),
        1: _payload("eth0", "2.13.0"),
        2: _payload("eth0", "2.13.0"),
        3: _payload("ens5", "2.12.1", NCCL_SOCKET_IFNAME="eth0"),
    }
    assert compare_ranks(mixed) == [
        "ranks disagree on the interface: eth0 on ranks 0-2; ens5 on rank 3. One exported NCCL_SOCKET_IFNAME/"
        "GLOO_SOCKET_IFNAME cannot name them all: let ncclguard.init_process_group apply each rank's own plan, or give "
        "NCCL a prefix list that matches every one.",
        "ranks disagree on torch version: 2.13.0 on ranks 0-2; 2.12.1 on rank 3. Install the same version on every host.",
        "ranks disagree on NCCL_SOCKET_IFNAME: None on ranks 0-2; eth0 on rank 3. Set it the same way on every host "
        "(or nowhere).",
    ]


def _clean_subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.multirank
def test_check_ranks_under_torchrun():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--monitor-interval=0.1",
            "-m",
            "ncclguard",
            "doctor",
            "--check-ranks",
            "--json",
            "--group-timeout",
            "3600",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=_clean_subprocess_env(),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # rank 0 alone prints; this is also `python -m ncclguard` end to end
    ranks = report["ranks"]
    assert (report["rank"], ranks["world_size"], ranks["all_reduce_ok"], ranks["disagreements"]) == (0, 2, True, [])
    assert sorted(ranks["reports"]) == ["0", "1"]
    assert {p["plan"]["interface"] for p in ranks["reports"].values()} == {"lo"}
    # torchrun itself exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 to its workers.
    row = next(v for v in report["variables"] if v["name"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert (row["value"], row["status"]) == ("1", "set by user") and row["note"].startswith("torchrun's default")


def _doctor_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m ncclguard doctor`` as a user runs it, in a clean environment of known width."""
    clean = {k: v for k, v in _clean_subprocess_env().items() if not k.startswith("NCCLGUARD_")}
    return subprocess.run(
        [sys.executable, "-m", "ncclguard", "doctor", "--master-addr", "127.0.0.1", "--backend", "gloo", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, "COLUMNS": "250", **env},
        cwd=REPO,
    )


TRAINER_NOTE = (
    "note: Hugging Face Trainer: the process-group timeout is TrainingArguments.ddp_timeout ({} s, {}); "
    "guard_trainer's eval_timeout_s and the watchdog's hang timeout must be below it"
)


def test_doctor_names_what_is_not_below_the_trainers_ddp_timeout():
    # --ddp_timeout: the flag of the training script's own command line, copied as it is.
    done = _doctor_cli("--ddp_timeout", "600", "--eval-timeout", "600", NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S="900")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    row = next(line for line in lines if "│ process-group timeout " in line)
    assert "│ 600 " in row and "TrainingArguments.ddp_timeout (--ddp-timeout)" in row
    tail = lines[lines.index(TRAINER_NOTE.format(600, "given")) :]
    assert tail == [
        TRAINER_NOTE.format(600, "given"),
        "3 warning(s):",
        "  - timeouts: watchdog hang timeout (900 s) is not below the process-group timeout (600 s): the backend "
        "tears the job down before the watchdog reports; lower NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S "
        "(TrainingArguments.ddp_timeout=600)",
        "  - timeouts: evaluation deadline (600 s) is not below the process-group timeout (600 s): ranks that finish "
        "first wait in the next collective for at most the group timeout, then fail (TrainingArguments.ddp_timeout=600)",
        "  - timeouts: barrier deadline (300 s) is shorter than the evaluation deadline (600 s): the barrier after "
        "evaluation would give up on a rank that is still within its deadline",
    ]


def test_doctor_reads_ddp_timeout_from_a_training_arguments_json(env, capsys, tmp_path):
    # In this process (the CLI itself is run as a subprocess above): the file HfArgumentParser reads.
    env.setenv("NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S", "900")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "ddp_timeout": 7200, "eval_strategy": "steps"}))
    rc, out, _ = _doctor(capsys, "--training-args", str(args), "--eval-timeout", "120")
    assert rc == 0, out
    assert out.splitlines()[-2:] == [TRAINER_NOTE.format(7200, "given"), "nothing to change."]
    # Without ddp_timeout in the file, the Trainer's default (1800 s): a hang timeout of 1800 s is not below it.
    env.setenv("NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S", "1800")
    args.write_text(json.dumps({"output_dir": "out"}))
    rc, out, _ = _doctor(capsys, "--training-args", str(args), "--json")
    report = json.loads(out)
    assert report["timeouts"]["notes"] == [TRAINER_NOTE.format(1800, "the default").removeprefix("note: ")]
    assert report["timeouts"]["problems"] == [
        "watchdog hang timeout (1800 s) is not below the process-group timeout (1800 s): the backend tears the job "
        "down before the watchdog reports; lower NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S (TrainingArguments.ddp_timeout=1800)"
    ]
    row = next(r for r in report["timeouts"]["rows"] if r["name"] == "process-group timeout")
    assert (row["seconds"], row["source"]) == (1800, f"TrainingArguments.ddp_timeout ({args}, default)")
    assert rc == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"ddp_timeout": -1}', "ddp_timeout must be a positive number of seconds, got -1"),
        ('{"ddp_timeout": "soon"}', "ddp_timeout must be a positive number of seconds, got 'soon'"),
        ('{"ddp_timeout": true}', "ddp_timeout must be a positive number of seconds, got True"),
        ('{"ddp_timeout": "600"}', "ddp_timeout must be a positive number of seconds, got '600'"),
        ("[1800]", "is not a JSON object of TrainingArguments fields"),
        ("{", "cannot read TrainingArguments JSON"),
    ],
)
def test_doctor_refuses_a_bad_training_arguments_file(env, capsys, tmp_path, content, message):
    bad = tmp_path / "args.json"
    bad.write_text(content)
    rc, out, err = _doctor(capsys, "--training-args", str(bad))
    assert (rc, out) == (2, "") and err.startswith("doctor: ") and message in err
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--ddp-timeout", "600", "--group-timeout", "600"])  # one process-group timeout, not two
    assert exc.value.code == 2


def test_on_nccl_the_variables_no_rank_sets_by_itself_are_a_change_to_make(env, capsys):
    """The doctor recommends variables; the ones that matter on the backend and that no rank sets at
    start (the socket plan sets the interfaces, the start-up hook the flight recorder) are a change to
    make: listed on the last line, exit 1. Set, nothing to change, exit 0; on gloo none matter."""
    rc, out, _ = _doctor(capsys, "--json", "--backend", "nccl", "--group-timeout", "3600")
    report = json.loads(out)
    assert (rc, report["ok"], report["backend"]) == (1, True, "nccl")
    assert report["to_set"] == ["NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"]
    rc, out, _ = _doctor(capsys, "--backend", "nccl", "--group-timeout", "3600")
    assert rc == 1 and out.rstrip().endswith("`ncclguard doctor --export` prints the lines.")
    assert "3 variable(s) to set for nccl (no rank sets them by itself): NCCL_IB_DISABLE, " in out
    for name, value in (("NCCL_IB_DISABLE", "1"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")):
        env.setenv(name, value)
    env.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    rc, out, _ = _doctor(capsys, "--backend", "nccl", "--group-timeout", "3600")
    assert rc == 0 and out.rstrip().endswith("nothing to change."), out[-300:]
