"""``ncclguard run [--ncclguard-OPTION ...] [torchrun options] SCRIPT [ARGS]``: torchrun, with ncclguard
on in every rank and no line of the script changed.

Every rank starts with ``NCCLGUARD_AUTO=1`` (the start-up hook, ``ncclguard_autostart``): right after
the default process group is made, however it is made, the watchdog starts with the settings of the
environment, every ``torch.distributed`` collective is recorded, torch's flight recorder is on
(``TORCH_FR_BUFFER_SIZE``) and rank 0 prints, once, the command that shows the job live.

Options:

- ``--ncclguard-<field> VALUE``: any field of :class:`~ncclguard.watching.base.settings.WatchdogConfig`
  (``--ncclguard-hang-timeout-s 120``, ``--ncclguard-incident-dir DIR``, ``--ncclguard-action exit``);
  each sets ``NCCLGUARD_WATCHDOG_<FIELD>`` for the ranks, over the value the environment has;
- ``--ncclguard-restarts N`` (with ``--ncclguard-warm-spare``, ``--ncclguard-preload MOD``): every rank
  runs under its supervisor (``python -m ncclguard.supervise``), which restarts it alone when it dies,
  up to N times (docs/recovery.md); ``--ncclguard-stop-grace S``: the seconds a supervised rank has
  to end after SIGTERM before it is SIGKILLed (default 8);
- ``--ncclguard-no-net-plan``: leave ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` alone (default: the
  ranks' network plan, an interface the user named checked here first: refused only where it cannot
  work, warned about where no route to the master is seen; docs/environment.md);
- ``--ncclguard-preempt-dir DIR``: sets ``NCCLGUARD_PREEMPT_DIR`` for the ranks, where a recovery
  engine writes the framework's checkpoint when the job is told to stop (docs/recovery.md, "Preemption");
- everything else is torchrun's, passed through unchanged (``--ncclguard-*`` options are read up to
  the script; what follows the script is the script's).

torchrun runs in this process (``torch.distributed.run``'s own parser and ``run()``), so that the
exit status is the script's own: that of the first rank that failed (128 + N for a rank killed by
signal N), 0 when every rank succeeded. torchrun's own command exits 1 on any failure.

SIGTERM or SIGINT to this process (Slurm's preemption, ``scancel``, a spot notice) is torchrun's:
its agent sends the signal to every worker's session and waits up to 30 s before SIGKILL. Under
``--ncclguard-restarts`` each supervisor stops its rank without a restart (SIGKILL after the stop
grace), and the command exits 128 + the signal (143 for SIGTERM): preempted (docs/run.md).

SIGKILL to this process (the OOM killer, a lost node agent) stops nothing in torchrun: the orphan guard
(:mod:`ncclguard.supervise.reaper`, started before torchrun, detached) then sends the job's processes
SIGTERM and SIGKILL after the stop grace; under ``--ncclguard-restarts`` each supervisor also stops
its rank by itself (:mod:`ncclguard.supervise.parent`). docs/run.md, "Its launcher killed".
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ncclguard.backend_rules import survivor_handling
from ncclguard.env.hostview import check_interfaces
from ncclguard.env.sockets import NET_PLAN_VAR
from ncclguard.store import node_store
from ncclguard.supervise.loop import DEFAULT_STOP_GRACE_S
from ncclguard.supervise.parent import LAUNCHER_VAR
from ncclguard.supervise.reaper import Guard
from ncclguard.watching.base.hang_bound import given as hang_given
from ncclguard.watching.base.settings import WatchdogConfig

__all__ = ["AUTO_VAR", "Launch", "add_arguments", "launch", "main", "plan", "run"]

PREEMPT_DIR_VAR = "NCCLGUARD_PREEMPT_DIR"  # ncclguard.recovery.preempt reads it (not imported: torch-free)
AUTO_VAR = "NCCLGUARD_AUTO"  # the start-up hook's switch (autostart/ncclguard_autostart.py reads it)
PREFIX = "--ncclguard-"
_SUPERVISOR = "ncclguard.supervise"
USAGE = "ncclguard run [--ncclguard-OPTION VALUE ...] [torchrun options] SCRIPT [ARGS ...]"


def _option(field: str) -> str:
    return PREFIX + field.replace("_", "-")


def _field_help() -> dict[str, str]:
    """Each WatchdogConfig field's line of help: its description, else its entry under the class
    docstring's ``Attributes:`` (the first sentence)."""
    out: dict[str, str] = {}
    current = None
    for line in (WatchdogConfig.__doc__ or "").split("Attributes:", 1)[-1].splitlines():
        head, sep, text = line.strip().partition(": ")
        if sep and head in WatchdogConfig.model_fields and line.startswith(" " * 8) and not line.startswith(" " * 12):
            current, out[head] = head, text
        elif current is not None and line.startswith(" " * 12):
            out[current] += " " + line.strip()
        else:
            current = None
    for name, info in WatchdogConfig.model_fields.items():
        text = (info.description or out.get(name) or f"WatchdogConfig.{name}").split(". ")[0].rstrip(".")
        out[name] = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text).replace("``", "")
    return out


def _parser() -> argparse.ArgumentParser:
    """The ``--ncclguard-*`` options: one per WatchdogConfig field, and the supervisor's."""
    ap = argparse.ArgumentParser(
        prog="ncclguard run",
        usage=USAGE,
        description="torchrun with ncclguard on in every rank; torchrun's own options pass through "
        "(torchrun --help lists them).",
        add_help=False,
        allow_abbrev=False,
    )
    ap.add_argument("--ncclguard-help", action="help", help="show the --ncclguard-* options and exit")
    group = ap.add_argument_group("the watchdog's settings (each sets NCCLGUARD_WATCHDOG_<FIELD> for the ranks)")
    helps = _field_help()
    for name, info in WatchdogConfig.model_fields.items():
        default = "" if info.default is None or "default" in helps[name] else f" (default {info.default})"
        text = f"{helps[name]}{default}".replace("%", "%%")
        group.add_argument(_option(name), dest=f"wd_{name}", metavar="VALUE", help=text)
    sup = ap.add_argument_group("restarting a rank alone (python -m ncclguard.supervise; docs/recovery.md)")
    sup.add_argument(
        "--ncclguard-restarts", type=int, metavar="N", help="run every rank under its supervisor: N restarts at most"
    )
    sup.add_argument(
        "--ncclguard-warm-spare", action="store_true", help="keep a standby process per rank that imported torch"
    )
    sup.add_argument(
        "--ncclguard-preload", action="append", default=[], metavar="MOD", help="a module the spare imports too"
    )
    sup.add_argument(
        "--ncclguard-stop-grace",
        type=float,
        metavar="S",
        help="seconds a supervised rank has to end after SIGTERM, then SIGKILL (default 8)",
    )
    pre = ap.add_argument_group("preemption (docs/recovery.md)")
    pre.add_argument(
        "--ncclguard-preempt-dir",
        metavar="DIR",
        help="sets NCCLGUARD_PREEMPT_DIR: where a recovery engine writes its checkpoint on SIGTERM",
    )
    net = ap.add_argument_group("the network plan (docs/environment.md)")
    off = "leave GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME alone (sets NCCLGUARD_NET_PLAN=0 for the ranks)"
    net.add_argument("--ncclguard-no-net-plan", action="store_true", help=off)
    return ap


_FLAGS = ("--ncclguard-help", "--ncclguard-warm-spare", "--ncclguard-no-net-plan")  # the options that take no value


def _names() -> list[str]:
    """Every ``--ncclguard-*`` option."""
    mine = ["--ncclguard-restarts", "--ncclguard-preload", "--ncclguard-stop-grace", "--ncclguard-preempt-dir"]
    return [*_FLAGS, *mine, *map(_option, WatchdogConfig.model_fields)]


class Launch:
    """What ``ncclguard run`` launches: torchrun's parsed arguments and the ranks' environment.

    Attributes:
        torchrun: torchrun's arguments, as ``torch.distributed.run``'s parser made them.
        env: variables set for the ranks (added to this environment).
        config: the watchdog's settings every rank will read.
        supervised: the ranks run under ``python -m ncclguard.supervise``.
        warnings: what the network plan lets through but may not work (printed before the launch).
        stop_grace_s: seconds a rank has to end after SIGTERM (each supervisor's; the orphan
            guard's, when this launcher is gone), before SIGKILL.
    """

    def __init__(
        self, torchrun: argparse.Namespace, env: dict[str, str], config: WatchdogConfig, supervised: bool
    ) -> None:
        self.torchrun, self.env, self.config, self.supervised = torchrun, env, config, supervised
        self.warnings: list[str] = []
        self.stop_grace_s = DEFAULT_STOP_GRACE_S


def _dashed(token: str) -> str:
    """``--ncclguard-hang_timeout_s=10`` as ``--ncclguard-hang-timeout-s=10``: both spellings, as torchrun
    takes ``--nproc_per_node`` and ``--nproc-per-node``."""
    name, sep, value = token.partition("=")
    return PREFIX + name[len(PREFIX) :].replace("_", "-") + sep + value


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the ``--ncclguard-*`` tokens before the script, torchrun's arguments with the script's)."""
    from torch.distributed.run import get_args_parser

    orig, argv = list(argv), [_dashed(t) if t.startswith(PREFIX) else t for t in argv]
    taken: list[int] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith(PREFIX):
            taken.append(i)
            if "=" not in token and token not in _FLAGS and i + 1 < len(argv):
                taken.append(i + 1)
                i += 1
        i += 1
    kept = [j for j in range(len(argv)) if j not in set(taken)]
    rest = [argv[j] for j in kept]
    torchrun = get_args_parser()
    torchrun.prog = "ncclguard run"
    parsed = torchrun.parse_args(rest)  # torchrun's own errors, and its exit status 2
    script_at = kept[len(rest) - len(parsed.training_script_args) - 1]
    mine = [argv[j] for j in taken if j < script_at]
    theirs = [argv[j] for j in range(script_at) if j not in set(taken)] + orig[script_at:]  # the script's as given
    return mine, theirs


def _unknown(tokens: Sequence[str]) -> None:
    known = _names()
    for token in tokens:
        name = token.split("=", 1)[0]
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"unknown option {name}{hint}; ncclguard run --ncclguard-help lists them")


def plan(argv: Sequence[str], cwd: Path | None = None) -> Launch:
    """Reads ``ncclguard run``'s command line into what to launch; launches nothing.

    Args:
        argv: the arguments after ``run``.
        cwd: the directory a relative ``incident_dir`` is taken from (default: the current one).

    Returns:
        The launch.

    Raises:
        ValueError: an unknown ``--ncclguard-*`` option, a bad setting (with the environment's
            ``NCCLGUARD_WATCHDOG_*``), no script, or a user's interface that cannot reach the master.
        SystemExit: torchrun's parser refused its arguments (it printed why).
    """
    if not argv:
        raise ValueError(f"give the script to run: {USAGE}")
    _unknown([_dashed(t) for t in argv if t.startswith(PREFIX)])
    mine, theirs = _split(argv)
    ns = _parser().parse_args(mine)
    given = {name: getattr(ns, f"wd_{name}") for name in WatchdogConfig.model_fields}
    given = {name: value for name, value in given.items() if value is not None}
    config = _config(given)
    # Every rank writes its incidents in one place, whatever directory it runs in.
    given["incident_dir"] = str((cwd or Path.cwd()) / config.incident_dir.expanduser())
    config = config.model_copy(update={"incident_dir": Path(given["incident_dir"])})
    env = {AUTO_VAR: "1", **{f"NCCLGUARD_WATCHDOG_{name.upper()}": value for name, value in given.items()}}
    if ns.ncclguard_preempt_dir is not None:
        env[PREEMPT_DIR_VAR] = str(_preempt_dir(ns.ncclguard_preempt_dir, cwd or Path.cwd()))
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser().parse_args(theirs)
    warnings: list[str] = []
    if ns.ncclguard_no_net_plan:
        env[NET_PLAN_VAR] = "0"
    else:  # the user's own interface is checked before any rank starts (BadInterface); what may not work is said
        warnings = check_interfaces(torchrun.rdzv_endpoint or torchrun.master_addr, nodes=_min_nodes(torchrun.nnodes))
    if ns.ncclguard_restarts is not None:
        _supervise(torchrun, ns)
        # A survivor of a peer's death must outlive NCCL's own error handling (backend_rules).
        to_set, warning = survivor_handling(os.environ, group_made=False)
        env.update(to_set)
        warnings += [warning] if warning is not None else []
    elif ns.ncclguard_warm_spare or ns.ncclguard_preload:
        raise ValueError("--ncclguard-warm-spare and --ncclguard-preload go with --ncclguard-restarts N")
    elif ns.ncclguard_stop_grace is not None:
        raise ValueError("--ncclguard-stop-grace goes with --ncclguard-restarts N (it is each supervisor's)")
    job = Launch(torchrun, env, config, ns.ncclguard_restarts is not None)
    job.warnings = warnings
    if ns.ncclguard_stop_grace is not None:
        job.stop_grace_s = float(ns.ncclguard_stop_grace)
    return job


def _min_nodes(nnodes: str) -> int | None:
    """The fewest nodes torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) allows, or None if unreadable."""
    low = str(nnodes).split(":", 1)[0].strip()
    return int(low) if low.isdigit() else None


def _config(given: dict[str, Any]) -> WatchdogConfig:
    """The settings the ranks will read (the options over this environment's), checked here so
    that a bad one stops the launch before any rank starts."""
    try:
        return WatchdogConfig(**given)
    except ValidationError as exc:
        # pydantic words a validator's ValueError "Value error, <text>", with no field for a check of
        # the whole model: the user reads the text, after the field's name where there is one.
        lines = []
        for e in exc.errors():
            msg = str(e["msg"]).removeprefix("Value error, ")
            field = ".".join(str(x) for x in e["loc"])
            lines.append(f"{field}: {msg}" if field else msg)
        raise ValueError("bad watchdog setting: " + "; ".join(lines)) from None


def _preempt_dir(value: str, cwd: Path) -> Path:
    """The preemption directory, absolute (every rank writes in one place); refused when a file."""
    if not value:
        raise ValueError("--ncclguard-preempt-dir is empty; name the directory a preempted job writes to")
    path = cwd / Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--ncclguard-preempt-dir {value!r} is a file; name a directory (made if missing)")
    return path


def _supervise(torchrun: argparse.Namespace, ns: argparse.Namespace) -> None:
    """Makes every rank ``python -m ncclguard.supervise --restarts N ... -- <the rank's command>``."""
    if ns.ncclguard_restarts < 0:
        raise ValueError(f"--ncclguard-restarts must be >= 0, got {ns.ncclguard_restarts}")
    if torchrun.run_path:
        raise ValueError("--run-path runs the script inside torchrun's process: it cannot be supervised")
    script = [torchrun.training_script, *torchrun.training_script_args]
    if torchrun.no_python:
        cmd = script
    else:
        cmd = [sys.executable, *(["-m"] if torchrun.module else []), *script]
    sup = ["--restarts", str(ns.ncclguard_restarts)]
    sup += ["--warm-spare"] if ns.ncclguard_warm_spare else []
    if ns.ncclguard_stop_grace is not None:
        if not ns.ncclguard_stop_grace > 0:
            raise ValueError(f"--ncclguard-stop-grace must be above 0 seconds, got {ns.ncclguard_stop_grace}")
        sup += ["--stop-grace", str(ns.ncclguard_stop_grace)]
    for module in ns.ncclguard_preload:
        sup += ["--preload", module]
    torchrun.module, torchrun.no_python = True, False
    torchrun.training_script, torchrun.training_script_args = _SUPERVISOR, [*sup, "--", *cmd]


def status_of(failure: Any) -> int:
    """A failed rank's exit status as a shell gives it (128 + N for a rank killed by signal N)."""
    code = int(failure.exitcode)
    return 128 - code if code < 0 else code


def launch(job: Launch) -> int:
    """Runs torchrun in this process with the ranks' environment; returns the job's exit status.

    Args:
        job: what :func:`plan` made.

    Returns:
        0 when every rank succeeded, else the first failed rank's status.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun_run

    guard = _guard(job)
    os.environ.update(job.env)  # torchrun's agent gives its workers a copy of this environment
    served = _serve_node_store(job)
    if served:
        os.environ[node_store.LAUNCHER_VAR] = served
    else:
        os.environ.pop(node_store.LAUNCHER_VAR, None)  # another launcher's, or the user's: not this node's
    if guard is not None:
        os.environ[LAUNCHER_VAR] = guard.token  # every worker, and all they start, carry it
    try:
        torchrun_run(job.torchrun)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return status_of(exc.get_first_failure()[1])
    except SignalException as exc:
        # torchrun's agent stopped every worker first (SIGTERM to their sessions, SIGKILL after 30 s).
        print(f"ncclguard run: stopped by signal {int(exc.sigval)} (preempted); every rank ended", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if guard is not None:
            guard.done()  # returned (torchrun stopped its workers): the guard leaves what is left alone
    return 0


def _serve_node_store(job: Launch) -> str:
    """Serves the node tier's store of this node in this process (docs/scale.md), where the tier can
    be on: more than one node, the tier not off. This process outlives every rank of the node, so the
    node's store does too, and a dead rank's agent is taken over by another rank (node_agent.py).

    Returns:
        Its ``127.0.0.1:PORT``, or ``""`` where none is served (said once where it failed).
    """
    if job.config.node_tier == "off":
        return ""
    most = str(getattr(job.torchrun, "nnodes", "1")).rpartition(":")[2]
    if most.isdecimal() and int(most) < 2:
        return ""
    try:
        server = node_store.serve(job.config.store_timeout)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or DistStoreError; each rank's own agent then
        print(
            f"ncclguard run: warning: the node's store was not served here ({exc}); a rank serves it", file=sys.stderr
        )
        return ""
    return f"127.0.0.1:{server.port}"


def _guard(job: Launch) -> Guard | None:
    """Starts the orphan guard (:mod:`ncclguard.supervise.reaper`): if this process dies without
    returning, the job's processes get SIGTERM, and SIGKILL after the stop grace. None where it cannot
    run (no ``/proc``), said once."""
    if not Path("/proc/self/environ").exists():
        print("ncclguard run: no /proc here: the job is not ended if this launcher is killed", file=sys.stderr)
        return None
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    env = {k: v for k, v in os.environ.items() if k not in (LAUNCHER_VAR, AUTO_VAR)}
    try:
        return Guard(token, job.stop_grace_s, env=env)
    except OSError as exc:
        print(
            f"ncclguard run: the orphan guard did not start ({exc}): the job is not ended if this launcher is killed",
            file=sys.stderr,
        )
        return None


def main(argv: Sequence[str]) -> int:
    """``ncclguard run``'s command line; returns the job's exit status (2: bad usage)."""
    if list(argv[:1]) in (["-h"], ["--help"]) or "--ncclguard-help" in argv:
        _parser().print_help()
        print("\ntorchrun's options: torchrun --help")
        return 0
    try:
        job = plan(argv)
    except ValueError as exc:
        print(f"ncclguard run: {exc}", file=sys.stderr)
        return 2
    for warning in job.warnings:
        print(f"ncclguard run: warning: {warning}", file=sys.stderr)
    cfg = job.config
    restarts = " under ncclguard.supervise" if job.supervised else ""
    print(
        f"ncclguard run: torchrun with ncclguard on in every rank{restarts} (hang after {cfg.hang_timeout_s:g} s"
        f"{'' if hang_given(cfg.model_fields_set) or cfg.action != 'report' else ' until learned per phase from the job'}, "
        f"incidents in {cfg.incident_dir})",
        file=sys.stderr,
        flush=True,
    )
    return launch(job)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: everything after ``run`` (read by :func:`main`, not argparse)."""
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="[--ncclguard-OPTION ...] [torchrun options] SCRIPT")


def run(args: argparse.Namespace) -> int:
    """Runs the command; returns the job's exit status."""
    return main(args.argv)
