"""``python -m ncclguard doctor``: the network and timeout environment of this rank, and what to change.

Exit status: 0 when nothing needs changing, 1 on warnings (or ranks that disagree with ``--check-ranks``)
or a variable to set (recommended, unset, that matters on the backend and no rank sets at start: on
NCCL, its error handling, dump on timeout and InfiniBand switch), 2 when the doctor could not run.

With ``--ddp-timeout`` or ``--training-args`` (a Hugging Face Trainer job) the process-group
timeout is ``TrainingArguments.ddp_timeout`` and the rules broken against it say so.

Under torchrun, ``--check-ranks`` has every rank detect its own plan, joins a gloo group with
it (which proves the plan works), exchanges the plans through the store and flags
disagreements (interface names, library versions, user-set variables). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ncclguard._naming import rank_ranges
from ncclguard.deadlines import Deadline
from ncclguard.env.envvars import DEPRECATED, IGNORED, audit
from ncclguard.env.hierarchy import TimeoutHierarchy
from ncclguard.env.hostview import plan_sockets
from ncclguard.env.netenv import NetPlan, detect
from ncclguard.env.sockets import SocketPlan
from ncclguard.env.trainer import HF_DDP_TIMEOUT_DEFAULT_S, trainer_timeout_notes
from ncclguard.env.versions import library_versions
from ncclguard.testing.launch import under_launcher

# A TrainingArguments JSON file is a few KiB; anything far larger is not one.
TRAINING_ARGS_MAX_BYTES = 1 << 20
# The recommended variables that matter on each backend and that no rank sets at start by itself.
USERS: dict[str, frozenset[str]] = {
    "nccl": frozenset({"NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"}),
    "gloo": frozenset(),
}
# Variables shown in the table when set, besides the recommended ones.
SHOWN_WHEN_SET = (
    "DEEPSPEED_TIMEOUT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_BUFFSIZE",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_IB_HCA",
    "NCCL_IB_TIMEOUT",
    "NCCL_P2P_DISABLE",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DESYNC_DEBUG",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
)
# Variables whose values must agree across ranks (compared by --check-ranks when set).
COMPARED_VARIABLES = tuple(
    sorted(
        {
            *SHOWN_WHEN_SET,
            *IGNORED,
            *DEPRECATED,
            "NCCL_SOCKET_IFNAME",
            "GLOO_SOCKET_IFNAME",
            "NCCL_IB_DISABLE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCH_FR_BUFFER_SIZE",
        }
        - {"MASTER_ADDR", "MASTER_PORT"}
    )
)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, e.g. 600, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the doctor's options to its subcommand parser."""
    parser.epilog = (
        "exit status: 0 nothing to change, 1 warnings, ranks that disagree or variables to set, 2 could not run"
    )
    parser.add_argument(
        "--master-addr", metavar="HOST", help="peer to route to (default: MASTER_ADDR, else the default route)"
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    out.add_argument("--export", action="store_true", help="print `export` lines for the recommended variables")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="backend to assume for the default timeout (default: nccl with CUDA, else gloo)",
    )
    pg = parser.add_mutually_exclusive_group()
    pg.add_argument(
        "--group-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="the process group's timeout: the timeout= you pass to init_process_group",
    )
    # The old spelling, hidden, so that scripts written for it keep working.
    pg.add_argument("--pg-timeout", dest="group_timeout", type=_seconds, help=argparse.SUPPRESS)
    # Both spellings, as HfArgumentParser gives a training script (transformers/hf_argparser.py):
    # the flag can be copied from the training command as it is.
    pg.add_argument(
        "--ddp-timeout",
        "--ddp_timeout",
        type=_seconds,
        metavar="SECONDS",
        help="a Hugging Face Trainer job: its TrainingArguments.ddp_timeout (the process group's timeout)",
    )
    pg.add_argument(
        "--training-args",
        metavar="FILE.json",
        help="a Hugging Face Trainer job: read ddp_timeout from its TrainingArguments JSON file (default 1800 if absent)",
    )
    parser.add_argument(
        "--eval-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="the evaluation deadline (guard_trainer's or guarded_evaluate's eval_timeout_s)",
    )
    parser.add_argument("--check-ranks", action="store_true", help="under torchrun: compare the plans of all ranks")
    parser.add_argument(
        "--timeout", type=_seconds, default=60.0, metavar="SECONDS", help="bound for --check-ranks (default 60)"
    )


class _TrainingArgsFile(BaseModel):
    """The one field of a TrainingArguments JSON file the doctor reads (the others are the script's)."""

    model_config = ConfigDict(extra="ignore")

    ddp_timeout: float | None = Field(None, gt=0, allow_inf_nan=False, strict=True)  # not "600", not true


def read_ddp_timeout(path: str | Path) -> float | None:
    """``ddp_timeout`` from a TrainingArguments JSON file, as ``HfArgumentParser.parse_json_file``
    reads it (``python train.py args.json``) and ``TrainingArguments.to_json_string`` writes it.

    Args:
        path: the JSON file.

    Returns:
        The timeout in seconds, or None when the file does not set it (the Trainer's default then).

    Raises:
        ValueError: the file is missing, larger than 1 MiB, not a JSON object, or its
            ``ddp_timeout`` is not a positive number.
    """
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > TRAINING_ARGS_MAX_BYTES:
            raise ValueError(f"{file} is {size} bytes; a TrainingArguments file is at most {TRAINING_ARGS_MAX_BYTES}")
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read TrainingArguments JSON {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object of TrainingArguments fields")
    try:
        return _TrainingArgsFile.model_validate(data).ddp_timeout
    except ValidationError:
        raise ValueError(
            f"{file}: ddp_timeout must be a positive number of seconds, got {data['ddp_timeout']!r}"
        ) from None


def _timeouts(args: argparse.Namespace) -> tuple[TimeoutHierarchy, list[str], list[str]]:
    """The hierarchy in force, its broken rules and its notes; with a Trainer's ``ddp_timeout``
    as the process-group timeout, the rules and notes name it."""
    ddp_given = args.ddp_timeout is not None or args.training_args is not None
    if not ddp_given:
        hierarchy = TimeoutHierarchy.in_force(
            backend=args.backend, group_timeout_s=args.group_timeout, eval_timeout_s=args.eval_timeout, validate=False
        )
        return hierarchy, hierarchy.problems(), hierarchy.notes()
    if args.training_args is not None:
        ddp = read_ddp_timeout(args.training_args)
        source = f"TrainingArguments.ddp_timeout ({args.training_args}{'' if ddp is not None else ', default'})"
    else:
        ddp, source = args.ddp_timeout, "TrainingArguments.ddp_timeout (--ddp-timeout)"
    pg = HF_DDP_TIMEOUT_DEFAULT_S if ddp is None else ddp
    hierarchy = TimeoutHierarchy.in_force(
        backend=args.backend, group_timeout_s=pg, group_source=source, eval_timeout_s=args.eval_timeout, validate=False
    )
    # The rules broken against the process-group timeout are broken against ddp_timeout: say so.
    suffix = f" (TrainingArguments.ddp_timeout={pg:g})"
    problems = [p + suffix if "the process-group timeout" in p else p for p in hierarchy.problems()]
    head = trainer_timeout_notes(ddp, args.eval_timeout, hierarchy.watchdog_hang_s)[0]
    return hierarchy, problems, [head, *hierarchy.notes()]


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the report (plain JSON-able data) for this rank.

    Raises:
        ValueError: a value the doctor cannot use (master address, TrainingArguments file).
    """
    plan = detect(args.master_addr)
    sockets = plan_sockets(net=plan)  # the same plan ncclguard run, NCCLGUARD_AUTO and init_process_group apply
    variables = audit(plan.environment, extra=SHOWN_WHEN_SET)
    hierarchy, problems, notes = _timeouts(args)
    warnings = list(plan.warnings) + [f"timeouts: {p}" for p in problems]
    if sockets.refusal is not None:
        warnings.append(f"refused at start: {sockets.refusal}")
    import torch  # the doctor needs it anyway (versions, --check-ranks); --help does not

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # What the user must set: a recommended variable unset, that matters on this backend, and that no
    # rank sets at start (the socket plan sets the interfaces, the start-up hook the flight recorder).
    to_set = [
        v.name for v in variables if v.recommended is not None and v.status == "unset" and v.name in USERS[backend]
    ]
    return {
        "host": plan.hostname,
        "backend": backend,
        "to_set": to_set,
        "rank": int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None,
        "plan": plan.model_dump(mode="json"),
        "sockets": sockets.model_dump(mode="json"),
        "variables": [v.model_dump() for v in variables],
        "timeouts": {"rows": hierarchy.rows(), "problems": problems, "notes": notes},
        "versions": library_versions(),
        "warnings": warnings,
    }


def compare_ranks(payloads: dict[int, dict[str, Any]]) -> list[str]:
    """Disagreements between ranks' reports: interface names, library versions, variables."""
    out = []

    def spread(label: str, values: dict[int, Any], advice: str) -> None:
        groups: dict[str, list[int]] = {}
        for rank, value in values.items():
            groups.setdefault(json.dumps(value), []).append(rank)
        if len(groups) > 1:
            ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
            parts = [f"{json.loads(v)} on rank{'s' if len(r) > 1 else ''} {rank_ranges(r)}" for v, r in ordered]
            out.append(f"ranks disagree on {label}: {'; '.join(parts)}. {advice}".strip())

    spread(
        "the interface",
        {r: p["plan"]["interface"] for r, p in payloads.items()},
        "One exported NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME cannot name them all: let ncclguard.init_process_group "
        "apply each rank's own plan, or give NCCL a prefix list that matches every one.",
    )
    for lib in sorted({k for p in payloads.values() for k in p["versions"]}):
        spread(
            f"{lib} version",
            {r: p["versions"].get(lib) for r, p in payloads.items()},
            "Install the same version on every host.",
        )
    for name in COMPARED_VARIABLES:
        values = {r: p["env"].get(name) for r, p in payloads.items()}
        spread(name, values, "Set it the same way on every host (or nowhere).")
    return out


def _check_ranks(report: dict[str, Any], plan_target: str | None, timeout_s: float) -> dict[str, Any]:
    """Joins a gloo group with this rank's plan, all-reduces one element, exchanges reports."""
    import torch
    import torch.distributed as dist

    from ncclguard.collectives.groups import group_info
    from ncclguard.collectives.numbering import next_round
    from ncclguard.collectives.rendezvous import exchange
    from ncclguard.env.pginit import init_process_group

    start = time.monotonic()
    init = init_process_group("gloo", timeout=timeout_s, master_addr=plan_target)
    one = torch.ones(1)
    dist.all_reduce(one)
    reduce_ms = (time.monotonic() - start) * 1000
    info = group_info()
    assert info is not None
    payload = {
        "host": report["host"],
        "plan": {k: report["plan"][k] for k in ("interface", "local_address", "address", "family")},
        "versions": report["versions"],
        # What the user set (not what the plan just applied): these must agree across hosts.
        "env": {n: os.environ[n] for n in COMPARED_VARIABLES if n in os.environ and n not in init.applied},
        "warnings": len(report["warnings"]),
    }
    result = exchange(info, next_round(info, "doctor"), payload, deadline=Deadline.within(timeout_s))
    disagreements = compare_ranks(result.payloads)
    if not result.ok:
        disagreements.insert(0, f"ranks {rank_ranges(result.missing)} did not answer within {timeout_s:g} s")
    return {
        "world_size": info.size,
        "all_reduce_ok": int(one.item()) == info.size,
        "join_and_all_reduce_ms": round(reduce_ms, 1),
        "reports": {str(r): p for r, p in sorted(result.payloads.items())},
        "disagreements": disagreements,
    }


def _print_tables(report: dict[str, Any], console: Console) -> None:
    """Prints ``report`` as tables (network, network plan, variables, timeouts, versions, and the
    ranks when checked), then the notes and the warnings."""
    # Each table printed as soon as it is built: a part of the report that does not read still
    # leaves the tables before it on the screen.
    console.print(_network_table(report))
    console.print(_plan_table(report))
    console.print(_variables_table(report))
    console.print(_timeouts_table(report))
    console.print(_versions_table(report))
    if "ranks" in report:
        console.print(_ranks_table(report["ranks"]))
    _print_problems(report, console)


def _network_table(report: dict[str, Any]) -> Table:
    """This host's network as the doctor found it: the peer, the route, the interface, InfiniBand."""
    plan = NetPlan.model_validate(report["plan"])
    net = Table(
        title=f"network of {report['host']}" + (f" (rank {report['rank']})" if report["rank"] is not None else "")
    )
    net.add_column("item", style="bold")
    net.add_column("value")
    route = plan.route
    net.add_row("peer", escape(f"{plan.target or '(none)'} [{plan.target_source}]"))
    net.add_row("address", ", ".join(plan.resolved) if plan.resolved else (plan.address or "-"))
    net.add_row("interface", plan.interface or "none (no route)")
    net.add_row("local address", plan.local_address or "-")
    if route is not None:
        via = f"via {route.gateway}" if route.gateway else "direct"
        net.add_row("route", f"{route.kind} {route.destination} dev {route.interface} {via} (from {route.method})")
    net.add_row("family", plan.family or "-")
    if plan.infiniband:
        for dev in plan.infiniband:
            ports = ", ".join(f"port {p.port} {p.state} {p.link_layer} {p.rate}" for p in dev.ports)
            net.add_row(f"InfiniBand {dev.name}", f"{ports} (netdev {', '.join(dev.netdevs) or '-'})")
    else:
        net.add_row("InfiniBand", "none (/sys/class/infiniband is empty)")
    return net


def _plan_table(report: dict[str, Any]) -> Table:
    """The socket variables a rank sets at start, and why."""
    sockets = SocketPlan.model_validate(report["sockets"])
    st = Table(title="network plan: what a rank sets at start (off: NCCLGUARD_NET_PLAN=0)")
    for col in ("variable", "action", "value", "why"):
        st.add_column(col)
    for c in sockets.choices:
        st.add_row(c.variable, c.action, escape(c.value or "-"), escape(c.why))
    return st


def _variables_table(report: dict[str, Any]) -> Table:
    """The environment variables: current, recommended and their status, coloured."""
    var = Table(title="environment variables")
    for col in ("variable", "current", "recommended", "status", "note"):
        var.add_column(col)
    style = {"ok": "green", "set by ncclguard": "green", "unset": "yellow", "set by user": "cyan"}
    for v in report["variables"]:
        var.add_row(
            v["name"],
            escape(v["value"]) if v["value"] is not None else "-",
            escape(v["recommended"] or "-"),
            f"[{style.get(v['status'], 'red')}]{v['status']}[/]",
            escape(v["note"]),
        )
    return var


def _timeouts_table(report: dict[str, Any]) -> Table:
    """The timeout hierarchy in force, one row per timeout."""
    tt = Table(title="timeout hierarchy")
    for col in ("timeout", "seconds", "rule", "source"):
        tt.add_column(col)
    for r in report["timeouts"]["rows"]:
        tt.add_row(r["name"], "-" if r["seconds"] is None else f"{r['seconds']:g}", r["rule"], r["source"])
    return tt


def _versions_table(report: dict[str, Any]) -> Table:
    """The versions of the libraries that matter."""
    vt = Table(title="versions")
    vt.add_column("library")
    vt.add_column("version")
    for name, version in report["versions"].items():
        vt.add_row(name, escape(version or "not available"))
    return vt


def _ranks_table(ranks: dict[str, Any]) -> Table:
    """What each rank reported, under whether the gloo all_reduce across them came out right."""
    rt = Table(title=f"ranks ({ranks['world_size']}), gloo all_reduce {'ok' if ranks['all_reduce_ok'] else 'WRONG'}")
    for col in ("rank", "host", "interface", "local address", "torch", "warnings"):
        rt.add_column(col)
    for rank, p in ranks["reports"].items():
        rt.add_row(
            rank,
            p["host"],
            str(p["plan"]["interface"]),
            str(p["plan"]["local_address"]),
            str(p["versions"].get("torch")),
            str(p["warnings"]),
        )
    return rt


def _print_problems(report: dict[str, Any], console: Console) -> None:
    """Prints the timeouts' notes, then the warnings and the ranks' disagreements, or that there is
    nothing to change."""
    problems = report["warnings"] + report.get("ranks", {}).get("disagreements", [])
    # soft_wrap: one line per message, for grep and copy-paste; the terminal wraps it.
    for note in report["timeouts"]["notes"]:
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if problems:
        console.print(f"[bold red]{len(problems)} warning(s):[/]")
        for w in problems:
            console.print(f"  - {w}", highlight=False, markup=False, soft_wrap=True)
    if report["to_set"]:
        console.print(
            f"[bold yellow]{len(report['to_set'])} variable(s) to set for {report['backend']}[/] (no rank sets them "
            f"by itself): {', '.join(report['to_set'])}; `ncclguard doctor --export` prints the lines.",
            highlight=False,
            soft_wrap=True,
        )
    elif not problems:
        console.print("[bold green]nothing to change.[/]")


def _print_export(report: dict[str, Any]) -> None:
    plan = report["plan"]
    print(
        f"# ncclguard doctor for {report['host']}: peer {plan['target'] or '(default route)'} via {plan['interface']}"
    )
    for v in report["variables"]:
        if v["recommended"] is not None and v["status"] == "unset":
            print(f"export {v['name']}={shlex.quote(v['recommended'])}")
        elif v["recommended"] is not None and v["status"] == "set by user":
            print(
                f"# {v['name']} is yours ({v['value'] if v['value'] is not None else v['note']}); "
                f"ncclguard would set {v['recommended']}"
            )
        elif v["status"] in ("ignored by NCCL and PyTorch", "deprecated", "no effect (read at import)"):
            print(f"# {v['name']}={v['value']}: {v['status']}; {v['note']}")


def run(args: argparse.Namespace) -> int:
    """Runs the doctor; returns the exit status (0 nothing to change, 1 warnings, 2 could not run)."""
    try:
        report = collect(args)
    except (TypeError, ValueError) as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    if args.check_ranks:
        if not under_launcher():
            print(
                "doctor: --check-ranks compares ranks and runs under a launcher, e.g.\n"
                "  torchrun --nproc_per_node=2 -m ncclguard doctor --check-ranks",
                file=sys.stderr,
            )
            return 2
        try:
            report["ranks"] = _check_ranks(report, args.master_addr, args.timeout)
        except Exception as exc:  # noqa: BLE001 - the point of the check: say why the ranks could not meet
            print(
                f"doctor: rank {report['rank']} could not join the others with its plan "
                f"(interface {report['plan']['interface']}): {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            sys.stderr.flush()
            os._exit(1)  # a half-made gloo group can block interpreter shutdown
    problems = report["warnings"] + report.get("ranks", {}).get("disagreements", [])
    report["ok"] = not problems
    rc = 0 if report["ok"] and not report["to_set"] else 1
    # Under --check-ranks only rank 0 prints (the comparison is the same on every rank).
    if not (args.check_ranks and report["rank"] not in (0, None)):
        if args.json:
            print(json.dumps(report, indent=2))
        elif args.export:
            _print_export(report)
        else:
            _print_tables(report, Console(width=max(Console().width, 120)))  # narrower cuts the notes
    sys.stdout.flush()
    if args.check_ranks:
        import torch.distributed as dist

        dist.destroy_process_group()
    return rc
