"""A warm spare: a standby Python process that has imported torch (and what ``--preload`` names)
and waits to take a dead rank's place.

A restarted rank spends its first seconds importing: torch takes 1.5 to 3 s on the machines here,
``torch._dynamo`` (which the first optimizer a script makes imports) 3 to 8 s more under load, and
transformers or Lightning several more. The supervisor (:mod:`ncclguard.supervise.loop`)
keeps one spare per rank, started beside the rank's process; when the rank dies, the supervisor
writes one line to the spare's standard input (``{"restart": n}``) and the spare runs the rank's
script in its own process, with ``NCCLGUARD_RESTART_COUNT`` set to ``n``: the imports are done.

Run as ``python -m ncclguard.supervise.spare [--preload MOD ...] -- PYTHON SCRIPT ARGS`` (or
``-- PYTHON -m MODULE ARGS``); only those two forms of a Python command can be taken over. An end of
its input (the supervisor went away) ends the spare with status 0, running nothing.

``--now N`` runs the script at once as restart ``N``, with the stand-in in place before its first
line: the supervisor's cold restart where the start-up hook (``ncclguard-autostart.pth``) does not
load in the rank's interpreter (ncclguard on ``PYTHONPATH`` rather than installed, ``python -S``),
see :func:`restart_command`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ncclguard.recovery._rebuild.restarts import RESTART_COUNT_VAR

__all__ = ["HOOK_PROBE_S", "Target", "hook_loads", "main", "restart_command", "target_of"]

MAX_LINE = 4096
# What every rank of a training script imports, and takes seconds: torch; torch._dynamo, which the
# first optimizer a script makes imports (torch/optim/optimizer.py, through torch._compile), and
# with it sympy: 3 to 8 s measured here, more than torch itself; DDP; ncclguard.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "ncclguard.recovery")
HOOK_PROBE_S = 20.0  # an interpreter's start without torch: ~30 ms here, seconds on a loaded node
_PROBE = "import sys; print('ncclguard_autostart' in sys.modules)"


@dataclass(frozen=True)
class Target:
    """What a spare runs: a script (``path``) or a module (``module``), with its arguments."""

    path: str | None
    module: str | None
    args: tuple[str, ...]


def target_of(argv: Sequence[str]) -> Target | None:
    """The Python script or module a rank's command runs, or None when a spare cannot run it.

    Args:
        argv: the rank's command, ``[python, script, ...]`` or ``[python, -m, module, ...]``.

    Returns:
        The target, or None (not a Python command, or a form with interpreter options).
    """
    if len(argv) < 2 or not Path(argv[0]).name.startswith("python"):
        return None
    if argv[1] == "-m" and len(argv) >= 3:
        return Target(None, argv[2], tuple(argv[3:]))
    if argv[1].startswith("-"):
        return None
    return Target(argv[1], None, tuple(argv[2:]))


def hook_loads(python: str, env: dict[str, str], timeout_s: float = HOOK_PROBE_S) -> bool | None:
    """Whether the start-up hook loads in a restarted process of ``python``: its ``.pth`` is in that
    interpreter's site-packages and imports ``ncclguard_autostart`` when ``NCCLGUARD_RESTART_COUNT``
    is set.

    Args:
        python: the interpreter of the rank's command.
        env: the restarted process's environment (``NCCLGUARD_RESTART_COUNT`` set).
        timeout_s: how long the probe may take.

    Returns:
        True or False; None when the probe could not run (no such interpreter, its bound passed).
    """
    try:
        out = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"True": True, "False": False}.get(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "")


def restart_command(argv: Sequence[str], env: dict[str, str], restart: int) -> list[str] | str:
    """The command that restarts a rank cold, so that its ``init_process_group`` makes the stand-in
    whatever the script's order: the rank's own command where the start-up hook loads in its
    interpreter, else the script run through this module (``--now``).

    Args:
        argv: the rank's command.
        env: the restarted process's environment.
        restart: its restart number.

    Returns:
        The command, or a sentence saying why none can make the stand-in before the script's first line.
    """
    target = target_of(argv)
    if target is None:
        return list(argv)  # not a Python command this module can run: the hook of its interpreters, if any
    if hook_loads(argv[0], env):
        return list(argv)
    probe = [argv[0], "-c", "import ncclguard.supervise.spare"]
    try:
        ok = subprocess.run(probe, env=env, capture_output=True, timeout=HOOK_PROBE_S, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        return (
            f"{argv[0]} loads neither ncclguard's start-up hook nor ncclguard: a restarted process would make the "
            "job's first world again and wait there for ranks that are in a later one"
        )
    return [argv[0], "-m", "ncclguard.supervise.spare", "--now", str(restart), "--", *argv]


def _run(target: Target) -> None:
    if target.module is not None:
        sys.argv = [target.module, *target.args]
        sys.path[0] = os.getcwd()  # as ``python -m`` sets it
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.path is not None
        sys.argv = [target.path, *target.args]
        sys.path[0] = str(Path(target.path).resolve().parent)  # as ``python script.py`` sets it
        runpy.run_path(target.path, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """The spare's life: import, wait for the word, run the rank's script. Returns its status."""
    ap = argparse.ArgumentParser(prog="python -m ncclguard.supervise.spare")
    ap.add_argument("--preload", action="append", default=[], help="a module to import while waiting")
    ap.add_argument("--now", type=int, metavar="N", help="run at once as restart N (a cold restart), no wait")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    target = target_of(cmd)
    if target is None:
        sys.stderr.write(f"ncclguard.supervise.spare: cannot take over {cmd[:3]!r}\n")
        return 2
    if ns.now is not None:
        restart = ns.now
        if restart < 1:
            sys.stderr.write(f"ncclguard.supervise.spare: --now takes a restart number >= 1, got {restart}\n")
            return 2
    else:
        for name in (*PRELOAD, *ns.preload):  # the point of a spare: done before the rank needs them
            importlib.import_module(name)
        line = sys.stdin.readline(MAX_LINE)
        if not line:
            return 0  # the supervisor is gone: nothing to take over
        word = json.loads(line)
        restart = word.get("restart") if isinstance(word, dict) else None
        if not isinstance(restart, int) or isinstance(restart, bool) or restart < 1:
            sys.stderr.write(f"ncclguard.supervise.spare: an unreadable word from the supervisor: {line[:200]!r}\n")
            return 2
    os.environ[RESTART_COUNT_VAR] = str(restart)
    from ncclguard.recovery._rebuild import stand_in

    stand_in.install()  # imported before the count was known: init_process_group stands in from now on
    _run(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
