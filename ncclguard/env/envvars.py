"""The environment variables that matter to NCCL, gloo, PyTorch and DeepSpeed, and the ones that do nothing.

Names, defaults and aliases are checked against torch 2.13's own headers (installed with the
wheel under ``torch/include/torch/csrc/distributed/c10d/``: ``ProcessGroupNCCL.hpp``,
``FlightRecorder.hpp``, ``Utils.hpp``), NCCL's environment page and DeepSpeed's
``deepspeed/constants.py``; docs/environment.md lists the sources and tests/env/test_netenv.py
re-checks the aliases against the installed headers.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Collection, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "DEPRECATED",
    "IGNORED",
    "Status",
    "VariableStatus",
    "applied_by_ncclguard",
    "audit",
    "env_warnings",
    "gloo_ifname_matches",
    "mark_applied",
    "nccl_ifname_matches",
]

Status = Literal[
    "ok",
    "unset",
    "set by user",
    "set by ncclguard",
    "ignored by NCCL and PyTorch",
    "deprecated",
    "no effect (read at import)",
]

# Old name -> current name. torch reads both through getCvar*, the old one last, and warns
# when only the old one is set (c10d/Utils.hpp, WARN_ENV_VAR_ONCE).
DEPRECATED: dict[str, str] = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
}

_REAL_TIMEOUT_KNOBS = (
    "the collective timeout is the timeout= argument of init_process_group and new_group "
    "(default 10 min for NCCL, 30 min for gloo), or DEEPSPEED_TIMEOUT in minutes for "
    "deepspeed.init_distributed"
)

# Read by nobody: name -> what to do instead.
IGNORED: dict[str, str] = {
    "NCCL_TIMEOUT": _REAL_TIMEOUT_KNOBS,
}

_applied_lock = threading.Lock()
_applied: dict[str, str] = {}


def mark_applied(name: str, value: str) -> None:
    """Records that ncclguard set ``name`` to ``value`` in this process."""
    with _applied_lock:
        _applied[name] = value


def applied_by_ncclguard() -> dict[str, str]:
    """The variables ncclguard set in this process, with the values it set."""
    with _applied_lock:
        return dict(_applied)


class VariableStatus(BaseModel):
    """One row of the doctor's table.

    Attributes:
        name: the variable.
        value: its value now, or None when unset.
        recommended: what ncclguard recommends, or None when it has no opinion.
        status: see :data:`Status`.
        note: one line on what to do, or empty.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    value: str | None
    recommended: str | None
    status: Status
    note: str = ""


def nccl_ifname_matches(spec: str, names: Collection[str]) -> list[str]:
    """The interfaces among ``names`` that NCCL would accept for ``NCCL_SOCKET_IFNAME=spec``.

    NCCL's rules (``parseStringList`` and ``matchIfList`` in ``src/misc/utils.cc``): a comma-separated
    list of prefixes, each optionally ``name:port`` (the port is not a name); a leading ``^`` excludes
    instead of selects; a leading ``=`` (after ``^``) makes every entry an exact name; an empty list
    matches every interface (so ``^`` alone excludes them all). Spaces are part of a name, as in NCCL.
    """
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    items = [item.split(":", 1)[0] for item in body.split(",")]
    items = [item for item in items if item]

    def hit(name: str) -> bool:
        if not items:
            return True
        return any(name == item if exact else name.startswith(item) for item in items)

    return sorted(n for n in names if hit(n) != exclude)


def gloo_ifname_matches(spec: str, names: Collection[str]) -> list[str]:
    """The interfaces among ``names`` named by ``GLOO_SOCKET_IFNAME=spec`` (comma-separated exact names)."""
    wanted = {item.strip() for item in spec.split(",") if item.strip()}
    return sorted(n for n in names if n in wanted)


def _torch_debug_level() -> str | None:
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    try:
        return dist.get_debug_level().name
    except (AttributeError, RuntimeError):
        return None


def _deepspeed_minutes_in_force() -> float | None:
    constants = sys.modules.get("deepspeed.constants")
    if constants is None:
        return None
    timeout = getattr(constants, "default_pg_timeout", None)
    return timeout.total_seconds() / 60 if timeout is not None else None


def env_warnings(environ: Mapping[str, str] | None = None, interfaces: Collection[str] | None = None) -> list[str]:
    """Warnings about variables in ``environ`` that do nothing, are deprecated or cannot work.

    Args:
        environ: the environment to check (default: ``os.environ``).
        interfaces: network interface names of this host, to check the ``*_SOCKET_IFNAME``
            values against (None: skip that check).

    Returns:
        One sentence per problem, each naming the variable and what to do.
    """
    env = os.environ if environ is None else environ
    out = _ignored_and_deprecated(env)
    out += _debug_level_warnings(env)
    out += _deepspeed_timeout_warnings(env)
    out += _nccl_error_handling_warnings(env)
    if interfaces is not None:
        out += _ifname_warnings(env, sorted(interfaces))
    return out


def _ignored_and_deprecated(env: Mapping[str, str]) -> list[str]:
    """Variables nobody reads, and old names: renamed, or shadowed by the new one."""
    out: list[str] = []
    for name, instead in IGNORED.items():
        if name in env:
            out.append(f"{name}={env[name]} does nothing: neither NCCL nor PyTorch reads it; {instead}.")
    for old, new in DEPRECATED.items():
        if old not in env:
            continue
        if new in env:
            out.append(f"{old} is deprecated and shadowed: {new}={env[new]} wins; remove {old}.")
        else:
            out.append(f"{old} is deprecated: rename it {new} (PyTorch still reads the old name, with a warning).")
    return out


def _debug_level_warnings(env: Mapping[str, str]) -> list[str]:
    """``TORCH_DISTRIBUTED_DEBUG`` set after torch read it: torch uses another level."""
    debug = env.get("TORCH_DISTRIBUTED_DEBUG")
    level = _torch_debug_level()
    if debug is not None and level is not None and debug.strip().upper() != level:
        return [
            f"TORCH_DISTRIBUTED_DEBUG={debug} has no effect: torch read it at `import torch` and uses {level}; "
            "set it before Python starts (export it, or in the launcher's environment)."
        ]
    return []


def _deepspeed_timeout_warnings(env: Mapping[str, str]) -> list[str]:
    """``DEEPSPEED_TIMEOUT`` that breaks ``import deepspeed``, reads as seconds where it is minutes,
    or came after deepspeed read it."""
    ds = env.get("DEEPSPEED_TIMEOUT")
    if ds is None:
        return []
    if not ds.strip().isdigit():
        return [
            f"DEEPSPEED_TIMEOUT={ds} is not a whole number of minutes: `import deepspeed` fails on it "
            "(deepspeed/constants.py calls int() on it); write e.g. DEEPSPEED_TIMEOUT=30."
        ]
    out: list[str] = []
    minutes = int(ds)
    if minutes > 24 * 60:
        out.append(
            f"DEEPSPEED_TIMEOUT={ds} means {minutes} minutes ({minutes / 60:.1f} hours): it is read in "
            f"minutes, not seconds; for {minutes} s write DEEPSPEED_TIMEOUT={max(1, round(minutes / 60))}."
        )
    in_force = _deepspeed_minutes_in_force()
    if in_force is not None and in_force != minutes:
        out.append(
            f"DEEPSPEED_TIMEOUT={ds} has no effect: deepspeed read it at import and uses {in_force:g} min; "
            "set it before `import deepspeed`, or pass timeout= to deepspeed.init_distributed."
        )
    return out


def _nccl_error_handling_warnings(env: Mapping[str, str]) -> list[str]:
    """NCCL's error handling turned off, and a dump on timeout with no flight recorder to dump."""
    out: list[str] = []
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    if handling is not None and handling.strip() == "0":
        out.append(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 turns off NCCL error handling: a timed-out collective is not "
            "torn down and the job can hang; leave it unset (default 3) or use 1-3."
        )
    fr_size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    dump = env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in ("1", "true", "yes", "y", "t")  # getCvarBool
    if dump and fr_size is not None:
        if fr_size.strip().lstrip("-").isdigit() and int(fr_size) <= 0:
            out.append(
                f"TORCH_NCCL_DUMP_ON_TIMEOUT is on but the flight recorder buffer is {fr_size}: there is nothing "
                "to dump; set TORCH_FR_BUFFER_SIZE=2000."
            )
    return out


def _ifname_warnings(env: Mapping[str, str], names: list[str]) -> list[str]:
    """``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` that match none of this host's interfaces ``names``."""
    out: list[str] = []
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec and not nccl_ifname_matches(spec, names):
        out.append(
            f"NCCL_SOCKET_IFNAME={spec} matches no interface of this host ({', '.join(names)}): NCCL will fail "
            "to find a socket interface; fix or unset it."
        )
    spec = env.get("GLOO_SOCKET_IFNAME")
    if spec and not gloo_ifname_matches(spec, names):
        out.append(
            f"GLOO_SOCKET_IFNAME={spec} names no interface of this host ({', '.join(names)}): gloo will fail "
            "to create its device; fix or unset it."
        )
    return out


def audit(
    recommended: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
    extra: Collection[str] = (),
) -> list[VariableStatus]:
    """One status row per relevant variable: recommended, deprecated, ignored and ``extra`` names.

    Args:
        recommended: the variables ncclguard recommends, with their values.
        environ: the environment to check (default: ``os.environ``).
        extra: more names to show when set (e.g. ``TORCH_DISTRIBUTED_DEBUG``).

    Returns:
        Rows in a stable order: recommended first, then the rest sorted by name.
    """
    env = os.environ if environ is None else environ
    applied = applied_by_ncclguard()
    level = _torch_debug_level()
    ds_minutes = _deepspeed_minutes_in_force()
    rows = [_recommended_row(name, want, env, applied) for name, want in recommended.items()]
    rest = sorted(({*IGNORED, *DEPRECATED, *extra} - set(recommended)) & set(env))
    rows += [_other_row(name, env[name], level, ds_minutes) for name in rest]
    return rows


def _recommended_row(name: str, want: str, env: Mapping[str, str], applied: Mapping[str, str]) -> VariableStatus:
    """The row of a variable ncclguard recommends ``want`` for: unset, set by ncclguard, as
    recommended, or set otherwise by the user (directly or through its deprecated name)."""
    value = env.get(name)
    alias = next((old for old, new in DEPRECATED.items() if new == name and old in env), None)
    if value is None and alias is not None:
        return VariableStatus(
            name=name,
            value=None,
            recommended=want,
            status="set by user",
            note=f"set through the deprecated {alias}={env[alias]}; left as is",
        )
    if value is None:
        return VariableStatus(
            name=name,
            value=None,
            recommended=want,
            status="unset",
            note="`doctor --export` prints the line to set it",
        )
    if applied.get(name) == value:
        return VariableStatus(name=name, value=value, recommended=want, status="set by ncclguard")
    if value == want:
        return VariableStatus(name=name, value=value, recommended=want, status="ok")
    if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and value == "1" and "TORCHELASTIC_RUN_ID" in env:
        return VariableStatus(
            name=name,
            value=value,
            recommended=want,
            status="set by user",
            note="torchrun's default when unset (1: abort communicators, tear down)",
        )
    return VariableStatus(
        name=name,
        value=value,
        recommended=want,
        status="set by user",
        note="differs from the recommendation; ncclguard leaves it as is",
    )


def _other_row(name: str, value: str, level: str | None, ds_minutes: float | None) -> VariableStatus:
    """The row of a variable set that ncclguard makes no recommendation for: ignored, deprecated,
    read at import to another value than ``value`` (torch's debug ``level``, deepspeed's
    ``ds_minutes``), or simply set."""
    if name in IGNORED:
        return VariableStatus(
            name=name, value=value, recommended=None, status="ignored by NCCL and PyTorch", note=IGNORED[name]
        )
    if name in DEPRECATED:
        return VariableStatus(
            name=name, value=value, recommended=None, status="deprecated", note=f"rename it {DEPRECATED[name]}"
        )
    if name == "TORCH_DISTRIBUTED_DEBUG" and level is not None and value.strip().upper() != level:
        return VariableStatus(
            name=name,
            value=value,
            recommended=None,
            status="no effect (read at import)",
            note=f"torch uses {level}; set it before Python starts",
        )
    if name == "DEEPSPEED_TIMEOUT" and ds_minutes is not None and value.strip() != f"{ds_minutes:g}":
        return VariableStatus(
            name=name,
            value=value,
            recommended=None,
            status="no effect (read at import)",
            note=f"deepspeed uses {ds_minutes:g} min; set it before `import deepspeed`",
        )
    return VariableStatus(name=name, value=value, recommended=None, status="set by user")
