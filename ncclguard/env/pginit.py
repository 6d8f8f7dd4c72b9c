"""``ncclguard.init_process_group``: torch's, after the network plan is applied, and with subgroups
that inherit the world group's timeout.

Two pitfalls it removes. NCCL and gloo read their interface variables when the group is
created, so the plan must be in the environment before ``init_process_group``, not after. And
``new_group(timeout=None)`` gets the *backend default* (10 min for NCCL, 30 min for gloo), not
the timeout given to ``init_process_group``: torch fills it from
``distributed_c10d._get_default_timeout(backend)`` (torch 2.13, ``_new_group_with_tag`` and
``split_group``). After this wrapper, that default is the world group's timeout.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.deadlines import to_seconds
from ncclguard.env.hierarchy import group_timeout_s
from ncclguard.env.hostview import prepare_sockets
from ncclguard.env.netenv import NetPlan, apply, detect
from ncclguard.env.sockets import GLOO_VAR, NCCL_VAR, SocketPlan
from ncclguard.errors import TorchCompatError

__all__ = ["ProcessGroupInit", "init_process_group", "restore_default_timeout"]


class ProcessGroupInit(BaseModel):
    """What :func:`init_process_group` did.

    Attributes:
        backend: the world group's backend.
        timeout_s: the world group's timeout, read back from the live group.
        plan: the network plan detected (None with ``apply_env=False``).
        sockets: the socket plan applied: which interface gloo and NCCL bind, and why
            (:mod:`ncclguard.env.sockets`; None with ``apply_env=False``).
        applied: the variables set from the plan (the user's own are never in it).
        subgroups_inherit: later groups made without ``timeout=`` get ``timeout_s``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str
    timeout_s: float | None
    plan: NetPlan | None
    sockets: SocketPlan | None = None
    applied: dict[str, str]
    subgroups_inherit: bool


class _Patch:
    """torch's ``_get_default_timeout`` as ncclguard patched it, so that subgroups inherit the world
    group's timeout (one patch per process: torch's default is process-wide).

    Attributes:
        lock: guards the fields.
        original: torch's own function, while patched.
        world: the world group this wrapper created, weakly.
        timeout: that world group's timeout.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.original: Callable[[Any], timedelta] | None = None
        self.world: weakref.ref[dist.ProcessGroup] | None = None
        self.timeout: timedelta | None = None


_patch = _Patch()


def _default_timeout(backend: Any) -> timedelta:
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    # Only for the world group this wrapper created: after destroy_process_group and a plain
    # torch init, torch's own default applies again.
    ref, timeout, original = _patch.world, _patch.timeout, _patch.original
    if ref is not None and world is not None and ref() is world and timeout is not None:
        return timeout
    assert original is not None
    return original(backend)


def _inherit(world: dist.ProcessGroup, seconds: float) -> bool:
    with _patch.lock:
        if _patch.original is None:
            try:
                current = compat.get_default_timeout_fn()
            except TorchCompatError as exc:
                log.warning("%s; subgroups keep the backend default timeout: pass timeout= to new_group", exc)
                return False
            _patch.original = current
            compat.set_default_timeout_fn(_default_timeout)
        _patch.world = weakref.ref(world)
        _patch.timeout = timedelta(seconds=seconds)
    return True


def restore_default_timeout() -> None:
    """Puts torch's own ``_get_default_timeout`` back: new groups get the backend default again."""
    with _patch.lock:
        if _patch.original is not None:
            compat.set_default_timeout_fn(_patch.original)
        _patch.original, _patch.world, _patch.timeout = None, None, None


def _peer_of(init_method: str | None) -> str | None:
    # None lets detect() take MASTER_ADDR itself (and say so in the plan).
    if init_method and init_method.startswith("tcp://"):
        return urlsplit(init_method).hostname
    return None


def init_process_group(
    backend: str | None = None,
    *,
    timeout: float | timedelta | None = None,
    master_addr: str | None = None,
    apply_env: bool = True,
    override: bool = False,
    inherit_timeout: bool = True,
    **kwargs: Any,
) -> ProcessGroupInit:
    """Detects and applies the network plan, then calls ``torch.distributed.init_process_group``.

    Args:
        backend: as for torch (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, None).
        timeout: the world group's timeout, in seconds or as a timedelta (None: torch's default).
        master_addr: the peer to route to (default: the host of a ``tcp://`` init_method, else
            ``MASTER_ADDR``, else the default route).
        apply_env: detect and apply the plan (False: leave the environment alone). The socket
            interfaces are set only where the default would bind a loopback or unroutable address
            (:func:`ncclguard.env.sockets.decide`); ``NCCLGUARD_NET_PLAN=0`` leaves them alone.
        override: let the plan replace the other variables the user set (the socket interfaces the
            user set are always kept, and checked).
        inherit_timeout: later groups created without ``timeout=`` get this group's timeout.
        **kwargs: passed on to torch (``init_method``, ``rank``, ``world_size``, ``store``, ...).

    Returns:
        What was applied and the timeout in force.

    Raises:
        TypeError, ValueError: a bad ``timeout`` or master address (before anything is changed).
        BadInterface: an interface the user named does not exist or has no route to the master
            (before anything is changed).
        Whatever torch's init_process_group raises.
    """
    seconds = None if timeout is None else to_seconds(timeout)
    plan: NetPlan | None = None
    sockets: SocketPlan | None = None
    applied: dict[str, str] = {}
    if apply_env:
        plan = detect(master_addr if master_addr is not None else _peer_of(kwargs.get("init_method")))
        for warning in plan.warnings:
            log.warning("%s", warning)
        sockets = prepare_sockets(net=plan)
        applied = sockets.to_set()
        # The socket interfaces are the socket plan's alone: where it leaves the default, so does this.
        socket_vars = (GLOO_VAR, NCCL_VAR, "NCCL_SOCKET_FAMILY")
        rest = {k: v for k, v in plan.environment.items() if k not in socket_vars}
        applied.update(apply(plan.model_copy(update={"environment": rest}), override=override))
    if seconds is not None:
        kwargs["timeout"] = timedelta(seconds=seconds)
    dist.init_process_group(backend=backend, **kwargs)
    world = compat.default_group()
    in_force = group_timeout_s(world)
    inherits = False
    if inherit_timeout and in_force is not None:
        inherits = _inherit(world, in_force)
    log.info(
        "process group up: backend %s, timeout %s s, interface %s%s",
        dist.get_backend(),
        in_force,
        plan.interface if plan else "(not detected)",
        ", subgroups inherit the timeout" if inherits else "",
    )
    return ProcessGroupInit(
        backend=str(dist.get_backend()),
        timeout_s=in_force,
        plan=plan,
        sockets=sockets,
        applied=applied,
        subgroups_inherit=inherits,
    )
