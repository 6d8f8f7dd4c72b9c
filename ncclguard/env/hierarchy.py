"""The whole hierarchy of timeouts in force (:class:`TimeoutHierarchy`): the backend's, the
groups', ncclguard's deadlines, the watchdog's and the launcher's, and whether they nest."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ncclguard import _torch_compat as compat
from ncclguard.collectives.groups import group_timeout_s
from ncclguard.config import Config, get_config
from ncclguard.deadlines import adaptive_timeout, default_deadline

__all__ = [
    "TimeoutHierarchy",
    "backend_default_timeout_s",
    "group_timeout_s",
    "subgroup_timeouts_s",
]

# The live group's timeout, under a name that TimeoutHierarchy.in_force's `group_timeout_s`
# argument (the timeout given by the caller) does not shadow.
_live_timeout_s = group_timeout_s


# torch 2.13 defaults: ProcessGroupNCCL.hpp kProcessGroupNCCLDefaultTimeout (10 min) and
# Backend.hpp kBackendDefaultTimeout (30 min, every other backend). A CPU-only build has no
# NCCL constant in Python, hence the literal.
NCCL_DEFAULT_TIMEOUT_S = 600.0
# ProcessGroupNCCL.cpp: getCvarInt(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 60 * 8).
NCCL_HEARTBEAT_DEFAULT_S = 480.0
# The NumelIn of the seeds' watchdog message: a whole flattened gradient bucket.
REFERENCE_NUMEL = 467_019_003


def backend_default_timeout_s(backend: str) -> float:
    """The timeout torch gives a group of ``backend`` created without ``timeout=``."""
    if str(backend).lower() == "nccl":
        from torch.distributed.constants import default_pg_nccl_timeout

        return (
            default_pg_nccl_timeout.total_seconds() if default_pg_nccl_timeout is not None else NCCL_DEFAULT_TIMEOUT_S
        )
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout.total_seconds()


def subgroup_timeouts_s() -> dict[str, float]:
    """Timeouts of the groups other than the world that this rank belongs to, by group name."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    world = compat.default_group()
    out: dict[str, float] = {}
    for pg in list(compat.group_names()):
        if pg is world:
            continue
        seconds = group_timeout_s(pg)
        if seconds is not None:
            out[str(pg.group_name)] = seconds
    return out


def _deepspeed_timeout(env: Mapping[str, str]) -> tuple[float | None, str]:
    constants = sys.modules.get("deepspeed.constants")
    if constants is not None and getattr(constants, "default_pg_timeout", None) is not None:
        return constants.default_pg_timeout.total_seconds(), "deepspeed.constants.default_pg_timeout (read at import)"
    raw = env.get("DEEPSPEED_TIMEOUT", "").strip()
    if raw.isdigit():
        return int(raw) * 60.0, f"DEEPSPEED_TIMEOUT={raw} (minutes)"
    return None, ""


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:g} s"


def _watchdog_timeouts() -> tuple[float | None, float | None, str]:
    """The watchdog's hang and peer-liveness timeouts: the running one's, else its configuration."""
    try:
        from ncclguard.watching.watchdog import WatchdogConfig, current_watchdog
    except ImportError:
        return None, None, ""
    running = current_watchdog()
    if running is not None:
        return running.config.hang_timeout_s, running.config.peer_timeout, "running watchdog"
    try:
        cfg = WatchdogConfig()
    except ValueError:  # a bad NCCLGUARD_WATCHDOG_* value: the watchdog will say so when started
        return None, None, ""
    return cfg.hang_timeout_s, cfg.peer_timeout, "WatchdogConfig (NCCLGUARD_WATCHDOG_*)"


# The parts of TimeoutHierarchy.in_force: each fills ``values`` (the model's fields) and ``sources``
# (where each came from, for the table) with one tier of the hierarchy.


def _watchdog_tier(values: dict[str, Any], sources: dict[str, str]) -> None:
    """The watchdog's hang and peer-liveness timeouts, where known."""
    hang, liveness, wd_source = _watchdog_timeouts()
    if hang is not None:
        values["watchdog_hang_s"], sources["watchdog_hang_s"] = hang, wd_source
    if liveness is not None:
        values["peer_liveness_s"], sources["peer_liveness_s"] = liveness, wd_source


def _group_tier(
    group: dist.ProcessGroup | None,
    backend: str | None,
    given_s: float | None,
    given_source: str,
    values: dict[str, Any],
    sources: dict[str, str],
) -> str:
    """The process-group timeout: ``given_s``, else the live group's, else the backend's default.

    Returns:
        The backend in force (the live group's, else ``backend``, else nccl where CUDA is available,
        else gloo).
    """
    live = _live_timeout_s(group)
    live_backend = str(dist.get_backend(group)) if live is not None else None
    chosen_backend = live_backend or backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if given_s is not None:
        values["group_timeout_s"], sources["group_timeout_s"] = float(given_s), given_source
    elif live is not None:
        values["group_timeout_s"], sources["group_timeout_s"] = live, f"live {live_backend} group"
    else:
        values["group_timeout_s"] = backend_default_timeout_s(chosen_backend)
        sources["group_timeout_s"] = f"{chosen_backend} default (no group yet)"
    return chosen_backend


def _config_tier(
    cfg: Config,
    heartbeat_timeout_s: float | None,
    eval_timeout_s: float | None,
    values: dict[str, Any],
    sources: dict[str, str],
) -> None:
    """The supervisor's heartbeat timeout and the evaluation deadline: as given, else the configuration's."""
    for field, given in (("heartbeat_timeout_s", heartbeat_timeout_s), ("eval_timeout_s", eval_timeout_s)):
        value = given if given is not None else getattr(cfg, field)
        if value is not None:
            values[field] = float(value)
            sources[field] = "given" if given is not None else f"Config.{field}"


def _deadline_tier(cfg: Config, op_numel: int, values: dict[str, Any], sources: dict[str, str]) -> None:
    """ncclguard's default per-op and barrier deadlines, as a call on the group would get them:
    capped below its timeout (``values["group_timeout_s"]``, filled first)."""
    pg = values["group_timeout_s"]
    policy = adaptive_timeout(op_numel, op_numel * 4, cfg)
    values["op_deadline_s"] = default_deadline(policy, pg, cfg)
    capped = ", capped" if values["op_deadline_s"] < policy else ""
    sources["op_deadline_s"] = f"{cfg.timeout_policy} policy for {op_numel} float32 elements{capped} (Config)"
    values["barrier_deadline_s"] = default_deadline(cfg.barrier_timeout_s, pg, cfg)
    capped = " (capped)" if values["barrier_deadline_s"] < cfg.barrier_timeout_s else ""
    sources["barrier_deadline_s"] = f"Config.barrier_timeout_s{capped}"


def _outside_tier(env: Mapping[str, str], backend: str, values: dict[str, Any], sources: dict[str, str]) -> None:
    """The timeouts of others: DeepSpeed's default, and NCCL's watchdog heartbeat when ``backend`` is nccl."""
    ds, ds_source = _deepspeed_timeout(env)
    if ds is not None:
        values["deepspeed_timeout_s"], sources["deepspeed_timeout_s"] = ds, ds_source
    if backend == "nccl":
        raw = env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "").strip()
        if raw.isdigit() and int(raw) > 0:
            values["nccl_heartbeat_s"], sources["nccl_heartbeat_s"] = float(raw), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
        else:
            values["nccl_heartbeat_s"], sources["nccl_heartbeat_s"] = NCCL_HEARTBEAT_DEFAULT_S, "torch default"


class TimeoutHierarchy(BaseModel):
    """Every timeout that decides who gives up first when a rank stalls, and their order.

    Inner layers must fire before outer ones, so that each gets its chance to report or recover
    before the next one ends the job. The order, checked on construction (:meth:`problems`):

    - per-op deadline < process-group timeout: ncclguard's deadline fires and reports while the
      backend still waits (at its own timeout NCCL's watchdog tears the process down);
    - watchdog hang timeout < process-group timeout: the same, for ncclguard's watchdog;
    - process-group timeout < heartbeat timeout: a supervisor outside the job that kills a rank
      whose training loop stopped sending progress heartbeats (e.g. nvidia-resiliency-ext's
      ``ft_launcher`` rank heartbeat timeout) must not kill a rank still waiting inside a
      collective that the backend has not given up on;
    - evaluation deadline < process-group timeout: ranks that finish evaluating first wait in the
      next collective for at most the group timeout (the seeds' hang);
    - evaluation deadline <= barrier deadline: the barrier after evaluation waits for the slowest
      evaluation that is still within its deadline.

    Missing values (None) are not checked. Shown but not ordered: the watchdog's peer-liveness
    timeout (a background thread's heartbeat, which keeps beating during a collective, so it
    detects dead processes and may be short), subgroups whose timeout differs from the world's
    (:meth:`notes`), DeepSpeed's default, NCCL's watchdog-thread heartbeat.

    Attributes:
        op_deadline_s: the deadline of one guarded collective.
        watchdog_hang_s: how long an op may be in flight before ncclguard's watchdog calls it a hang.
        group_timeout_s: the world process group's timeout.
        heartbeat_timeout_s: the progress-heartbeat timeout of a supervisor outside the job.
        eval_timeout_s: how long one evaluation pass may run.
        barrier_deadline_s: how long a barrier waits for the last rank.
        peer_liveness_s: after this long without a watchdog heartbeat a peer is lost.
        subgroup_timeouts_s: other live groups' timeouts, by group name.
        deepspeed_timeout_s: DeepSpeed's init_distributed default, when known.
        nccl_heartbeat_s: NCCL's watchdog-thread heartbeat, shown for NCCL only.
        sources: where each value came from, by field name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    op_deadline_s: float | None = Field(None, gt=0)
    watchdog_hang_s: float | None = Field(None, gt=0)
    group_timeout_s: float = Field(gt=0)
    heartbeat_timeout_s: float | None = Field(None, gt=0)
    eval_timeout_s: float | None = Field(None, gt=0)
    barrier_deadline_s: float | None = Field(None, gt=0)
    peer_liveness_s: float | None = Field(None, gt=0)
    subgroup_timeouts_s: dict[str, float] = {}
    deepspeed_timeout_s: float | None = Field(None, gt=0)
    nccl_heartbeat_s: float | None = Field(None, gt=0)
    sources: dict[str, str] = {}

    def problems(self) -> list[str]:
        """Each broken rule of the order, as a sentence that says what to change."""
        out = []
        op, hang, pg, hb = self.op_deadline_s, self.watchdog_hang_s, self.group_timeout_s, self.heartbeat_timeout_s
        ev, bar = self.eval_timeout_s, self.barrier_deadline_s
        if op is not None and op >= pg:
            out.append(
                f"per-op deadline ({_s(op)}) is not below the process-group timeout ({_s(pg)}): the backend gives up "
                "first and ncclguard cannot report; lower the deadline or raise timeout= of init_process_group"
            )
        for name, seconds in sorted(self.subgroup_timeouts_s.items()):
            if op is not None and op >= seconds:
                out.append(f"per-op deadline ({_s(op)}) is not below group {name}'s timeout ({_s(seconds)})")
        if hang is not None and hang >= pg:
            out.append(
                f"watchdog hang timeout ({_s(hang)}) is not below the process-group timeout ({_s(pg)}): the backend "
                "tears the job down before the watchdog reports; lower NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S"
            )
        if hb is not None and hb <= pg:
            out.append(
                f"heartbeat timeout ({_s(hb)}) is not above the process-group timeout ({_s(pg)}): the supervisor "
                "would kill a rank still waiting in a collective the backend has not given up on"
            )
        if ev is not None and ev >= pg:
            out.append(
                f"evaluation deadline ({_s(ev)}) is not below the process-group timeout ({_s(pg)}): ranks that finish "
                "first wait in the next collective for at most the group timeout, then fail"
            )
        if ev is not None and bar is not None and bar < ev:
            out.append(
                f"barrier deadline ({_s(bar)}) is shorter than the evaluation deadline ({_s(ev)}): the barrier after "
                "evaluation would give up on a rank that is still within its deadline"
            )
        return out

    def notes(self) -> list[str]:
        """Facts worth knowing that break no rule: subgroups with another timeout, DeepSpeed's default."""
        out = []
        for name, seconds in sorted(self.subgroup_timeouts_s.items()):
            if seconds != self.group_timeout_s:
                out.append(
                    f"group {name}'s timeout ({_s(seconds)}) differs from the world group's ({_s(self.group_timeout_s)}); "
                    "a group made by new_group without timeout= gets the backend default unless it was made after "
                    "ncclguard.init_process_group"
                )
        if self.deepspeed_timeout_s is not None and "live" in self.sources.get("group_timeout_s", ""):
            if self.deepspeed_timeout_s != self.group_timeout_s:
                out.append(
                    f"DeepSpeed's default timeout ({_s(self.deepspeed_timeout_s)}) differs from the live world group's "
                    f"({_s(self.group_timeout_s)}); it applies only to a group deepspeed.init_distributed creates itself"
                )
        return out

    @model_validator(mode="after")
    def _ordered(self) -> TimeoutHierarchy:
        broken = self.problems()
        if broken:
            raise ValueError("timeout hierarchy out of order: " + "; ".join(broken))
        return self

    def rows(self) -> list[dict[str, Any]]:
        """The effective table: one dict per timeout (name, seconds, rule, source)."""
        rows = [
            ("per-op deadline", self.op_deadline_s, "< process-group timeout", "op_deadline_s"),
            ("watchdog hang timeout", self.watchdog_hang_s, "< process-group timeout", "watchdog_hang_s"),
            ("process-group timeout", self.group_timeout_s, "", "group_timeout_s"),
            ("heartbeat timeout", self.heartbeat_timeout_s, "> process-group timeout", "heartbeat_timeout_s"),
            ("evaluation deadline", self.eval_timeout_s, "< process-group timeout", "eval_timeout_s"),
            ("barrier deadline", self.barrier_deadline_s, ">= evaluation deadline", "barrier_deadline_s"),
        ]
        out = [
            {"name": n, "seconds": v, "rule": r, "source": self.sources.get(k) or ("not set" if v is None else "given")}
            for n, v, r, k in rows
        ]
        for name, seconds in sorted(self.subgroup_timeouts_s.items()):
            out.append(
                {
                    "name": f"group {name} timeout",
                    "seconds": seconds,
                    "rule": "> per-op deadline",
                    "source": "live group",
                }
            )
        extra = [
            ("watchdog peer liveness", self.peer_liveness_s, "(dead-process detection)", "peer_liveness_s"),
            ("DeepSpeed default timeout", self.deepspeed_timeout_s, "", "deepspeed_timeout_s"),
            ("NCCL watchdog heartbeat", self.nccl_heartbeat_s, "(watchdog thread liveness)", "nccl_heartbeat_s"),
        ]
        out += [
            {"name": n, "seconds": v, "rule": r, "source": self.sources.get(k, "")}
            for n, v, r, k in extra
            if v is not None
        ]
        return out

    def render(self) -> str:
        """The effective table as plain text, then the broken rules and notes."""
        lines = [f"{'timeout':<28}{'seconds':>10}  {'rule':<26}source"]
        for r in self.rows():
            seconds = "-" if r["seconds"] is None else f"{r['seconds']:g}"
            lines.append(f"{r['name']:<28}{seconds:>10}  {r['rule']:<26}{r['source']}")
        lines += [f"PROBLEM: {p}" for p in self.problems()] + [f"note: {n}" for n in self.notes()]
        return "\n".join(lines)

    @classmethod
    def in_force(
        cls,
        *,
        config: Config | None = None,
        group: dist.ProcessGroup | None = None,
        backend: str | None = None,
        group_timeout_s: float | None = None,
        group_source: str = "given",
        heartbeat_timeout_s: float | None = None,
        eval_timeout_s: float | None = None,
        op_numel: int = REFERENCE_NUMEL,
        environ: Mapping[str, str] | None = None,
        validate: bool = True,
    ) -> TimeoutHierarchy:
        """Reads the hierarchy in force: the configuration, the watchdog, the live groups, DeepSpeed, NCCL.

        Args:
            config: the configuration (deadline policy, barrier, evaluation and heartbeat timeouts).
            group: the group whose timeout is the process-group timeout (default the world).
            backend: the backend to assume when no group is live (default: nccl where CUDA
                is available, else gloo).
            group_timeout_s: the process-group timeout, when known better than the live group.
            group_source: where ``group_timeout_s`` came from, for the table (e.g. ``TrainingArguments.ddp_timeout``).
            heartbeat_timeout_s: the supervisor's heartbeat timeout (default ``Config.heartbeat_timeout_s``).
            eval_timeout_s: the evaluation deadline (default ``Config.eval_timeout_s``).
            op_numel: the collective size the per-op deadline is computed for (float32).
            environ: environment to read ``DEEPSPEED_TIMEOUT`` and NCCL's heartbeat from.
            validate: raise on a broken order (False: return it; :meth:`problems` lists it).

        Raises:
            ValueError: ``validate`` and the order is broken (a pydantic ValidationError).
        """
        cfg = config or get_config()
        env = os.environ if environ is None else environ
        sources: dict[str, str] = {}
        values: dict[str, Any] = {}
        _watchdog_tier(values, sources)
        chosen_backend = _group_tier(group, backend, group_timeout_s, group_source, values, sources)
        _config_tier(cfg, heartbeat_timeout_s, eval_timeout_s, values, sources)
        _deadline_tier(cfg, op_numel, values, sources)
        values["subgroup_timeouts_s"] = subgroup_timeouts_s()
        _outside_tier(env, chosen_backend, values, sources)
        values["sources"] = sources
        if validate:
            return cls(**values)
        return cls.model_construct(**values)
