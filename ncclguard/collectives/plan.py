"""What safe_all_reduce knows before a call: a plan per group and, in it, a shape per kind of call.

A :class:`GroupPlan` holds what every call on one group needs and no call changes: the group's
description, this rank's call count on it, the devices its backend moves, the group timeout that
caps a default deadline (read again at most every :data:`TIMEOUT_TTL_S`, since
``_set_pg_timeout`` may change it). In it, a :class:`CallShape` per kind of call (op, tensor
class, dtype, numel, device, layout, chunking) holds what the input checks, the op's name, the
bytes, the chunk bounds and the deadline policy make of it. The first call of a shape checks the
input and computes these; the next ones look them up with one dict lookup, which is where the hot
path's speed comes from (benchmarks/small_call_cost.py).

Plans are per world (a :class:`~ncclguard.world.Slot`): a rebuilt world starts with none, and the
old world's are dropped when the world changes, since each holds its group and the reaper must be
able to free the abandoned ones.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.collectives.chunking import chunk_bounds
from ncclguard.collectives.groups import BACKEND_DEVICES, GroupInfo, group_info
from ncclguard.collectives.numbering import CallCount, call_count
from ncclguard.config import Config, get_config
from ncclguard.deadlines import adaptive_timeout, group_cap_s
from ncclguard.errors import TorchCompatError
from ncclguard.world import Slot, World, WorldChange, current_world, subscribe

__all__ = [
    "PLANS",
    "TIMEOUT_TTL_S",
    "CallShape",
    "GroupPlan",
    "Plans",
    "check_input",
    "hot",
    "forget_plans",
    "plan_for",
]

ReduceOp = dist.ReduceOp
_NEEDS_DTYPE_CHECK = frozenset({"AVG", "MIN", "MAX", "BAND", "BOR", "BXOR"})
# How old the group timeout behind a default deadline may be (see GroupPlan.default_timeout).
TIMEOUT_TTL_S = 0.01
# Shapes kept per group: a loop makes a few; varying sizes (metrics of a ragged batch) would make
# the cache grow without end, so it starts over when full.
_MAX_SHAPES = 256
_world = compat.world()  # torch's _World: default_pg is the group that None stands for


def check_input(tensor: Any, op: Any, chunk_numel: Any, backend: str | None) -> None:
    """Every check of safe_all_reduce's input that needs no other rank.

    Args:
        tensor: what was passed as the tensor.
        op: what was passed as the op.
        chunk_numel: what was passed as elements per chunk.
        backend: the group's backend, or None (a world of one).

    Raises:
        TypeError, ValueError: the input cannot be reduced as asked; the message says what to do.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"safe_all_reduce needs a torch.Tensor, got {type(tensor).__name__}; wrap data with torch.as_tensor(...)"
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"safe_all_reduce needs a dense tensor, got layout {tensor.layout}; call tensor.to_dense() first"
        )
    name = REDUCE_OP_NAMES.get(op) if isinstance(op, ReduceOp.RedOpType) else None
    if name is None:
        raise ValueError(f"unsupported op {op!r}; use one of ReduceOp.{', ReduceOp.'.join(REDUCE_OP_NAMES.values())}")
    if name in _NEEDS_DTYPE_CHECK:  # SUM, PRODUCT: every dtype; the others are checked below
        dt = tensor.dtype
        if name == "AVG" and not (dt.is_floating_point or dt.is_complex) and backend != "nccl":
            raise TypeError(
                f"ReduceOp.AVG on {dt} would truncate; reduce with ReduceOp.SUM and divide, or convert to a floating dtype"
            )
        if name in ("BAND", "BOR", "BXOR") and (dt.is_floating_point or dt.is_complex):
            raise TypeError(f"ReduceOp.{name} needs an integer or bool tensor, got {dt}")
        if name in ("MIN", "MAX") and dt.is_complex:
            raise TypeError(f"ReduceOp.{name} is not defined for complex tensors ({dt}); reduce .real/.imag or .abs()")
    if chunk_numel is not None and (
        isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0
    ):
        raise ValueError(f"chunk_numel must be a positive int (elements per chunk), got {chunk_numel!r}")
    if backend is not None:
        devices = BACKEND_DEVICES.get(backend)
        if devices is not None and tensor.device.type not in devices:
            raise ValueError(
                f"the tensor is on {tensor.device.type!r} but the group's backend {backend!r} moves "
                f"only {sorted(devices)} tensors; move it first, e.g. tensor.to('{sorted(devices)[0]}')"
            )


@dataclass(frozen=True, slots=True)
class CallShape:
    """One kind of call on a group, checked and computed once.

    Attributes:
        op: the ReduceOp (held: the cache key has its id).
        opname: e.g. ``"all_reduce(SUM)"``.
        wire_op: the op sent to the backend (SUM for an AVG the backend lacks).
        avg_by_hand: the backend has no AVG: the wire sums, then the result is divided.
        dtype: the dtype's name, e.g. ``"float32"``.
        numel: elements.
        nbytes: bytes.
        bounds: the chunks' ``[start, stop)`` element ranges.
        chunks: how many (``len(bounds)``).
        direct: one chunk: a contiguous tensor goes on the wire as it is.
        verify_default: what ``verify=None`` means for this size (at or above the chunking
            threshold: verify).
        policy_s: the default deadline before the group's cap (:func:`~ncclguard.deadlines.adaptive_timeout`).
    """

    op: Any
    opname: str
    wire_op: Any
    avg_by_hand: bool
    dtype: str
    numel: int
    nbytes: int
    bounds: tuple[tuple[int, int], ...]
    chunks: int
    direct: bool
    verify_default: bool
    policy_s: float


class GroupPlan:
    """What a call on one live group needs, looked up once (see the module's docstring).

    Attributes:
        info: the group's description.
        group: the process group.
        name: its name.
        backend: its backend's name.
        multi: the group has more than one rank (a world of one reduces nothing).
        count: this rank's call count on the group (:mod:`ncclguard.collectives.rendezvous`).
        config: the configuration the shapes were computed under.
        shapes: the shapes of the calls made so far (see :meth:`shape`).
    """

    __slots__ = (
        "info",
        "group",
        "name",
        "backend",
        "multi",
        "count",
        "config",
        "shapes",
        "_read_timeout",
        "_read_at",
        "_cap",
        "_wait_s",
        "_wait",
    )

    def __init__(self, info: GroupInfo, count: CallCount, config: Config) -> None:
        self.info = info
        self.group = info.group
        self.name = info.name
        self.backend = info.backend
        self.multi = info.size > 1
        self.count = count
        self.config = config
        self.shapes: dict[tuple[Any, ...], CallShape] = {}
        self._read_timeout: Any = None
        self._read_at = -math.inf
        self._cap = math.inf
        self._wait_s = -1.0
        self._wait = timedelta(0)

    def use_config(self, config: Config) -> None:
        """Recomputes under ``config`` from the next call on (the caller saw it is not :attr:`config`)."""
        self.shapes = {}
        self.config = config
        self._read_at = -math.inf

    def shape(self, tensor: Any, op: Any, chunk_numel: Any) -> CallShape:
        """The shape of a call on ``tensor``: the cached one, or checked and computed now.

        The cache key is everything the input checks and the shape read: the op by identity
        (hashing a ReduceOp costs more than the rest of the key; the shape holds the op, so its
        id cannot be reused while the entry lives), dtype, numel, device (a CPU tensor's as True:
        one attribute read instead of building a ``torch.device``), layout and ``chunk_numel``.
        Input the cache does not take (not a tensor, a ``chunk_numel`` that is not an int) is
        checked on every call.

        Args:
            tensor: the call's tensor.
            op: its op.
            chunk_numel: its elements per chunk, or None.

        Returns:
            The shape.

        Raises:
            TypeError, ValueError: bad input (:func:`check_input`).
        """
        key: tuple[Any, ...] | None = None
        if isinstance(tensor, torch.Tensor) and (chunk_numel is None or type(chunk_numel) is int):
            key = (id(op), tensor.dtype, tensor.numel(), tensor.is_cpu or tensor.device, tensor.layout, chunk_numel)
            shape = self.shapes.get(key)
            if shape is not None:
                return shape
        check_input(tensor, op, chunk_numel, self.backend)
        config = self.config
        numel = tensor.numel()
        nbytes = numel * tensor.element_size()
        bounds = tuple(chunk_bounds(numel, chunk_numel, config))
        name = REDUCE_OP_NAMES[op]
        avg_by_hand = name == "AVG" and self.backend != "nccl"
        shape = CallShape(
            op=op,
            opname=f"all_reduce({name})",
            wire_op=ReduceOp.SUM if avg_by_hand else op,
            avg_by_hand=avg_by_hand,
            dtype=dtype_name(tensor.dtype),
            numel=numel,
            nbytes=nbytes,
            bounds=bounds,
            chunks=len(bounds),
            direct=len(bounds) == 1,
            verify_default=numel >= config.chunk_direct_below,
            policy_s=adaptive_timeout(numel, nbytes, config),
        )
        if key is not None:
            if len(self.shapes) >= _MAX_SHAPES:
                self.shapes = {}
            self.shapes[key] = shape
        return shape

    def timeout_s(self) -> float | None:
        """The group's timeout in force, read live (``_set_pg_timeout`` may change it any time),
        from the first device backend that answers (its reader is cached: the scan costs more)."""
        if self._read_timeout is not None:
            try:
                return float(self._read_timeout())
            except RuntimeError:
                self._read_timeout = None
        for device in getattr(self.group, "_device_types", []):
            try:
                reader = compat.backend_timeout_reader(self.group, device)
                seconds = reader()
            except (TorchCompatError, RuntimeError):
                continue
            self._read_timeout = reader
            return float(seconds)
        return None

    def default_timeout(self, shape: CallShape, now: float) -> float:
        """The default deadline of a call of ``shape``: its policy's, capped below the group's
        timeout (:func:`~ncclguard.deadlines.group_cap_s`). The group's timeout is read again
        when the last read is :data:`TIMEOUT_TTL_S` old (``now`` is ``time.monotonic()``), so a
        default deadline follows a changed group timeout within that time."""
        if now - self._read_at >= TIMEOUT_TTL_S:
            group_timeout = self.timeout_s()
            self._cap = math.inf if group_timeout is None else group_cap_s(group_timeout, self.config)
            self._read_at = now
        policy, cap = shape.policy_s, self._cap
        return policy if policy < cap else cap

    def whole_wait(self, seconds: float) -> timedelta:
        """``timedelta(seconds=seconds)``, cached for the last value (a default deadline repeats)."""
        if self._wait_s != seconds:
            self._wait, self._wait_s = timedelta(seconds=seconds), seconds
        return self._wait


class Plans:
    """One world's plans, by process group (``by_group``; built under ``lock``).

    Args:
        world: the world they belong to (the slot's factory passes it).
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.by_group: dict[dist.ProcessGroup, GroupPlan] = {}


PLANS: Slot[Plans] = Slot("safe_all_reduce plans", Plans)


class _Hot:
    """The current world's plans as the hot path reads them, re-pointed by subscription when the
    world changes: safe_all_reduce reads ``hot.by_group`` (plan_for's cache hit, inline) with the
    attribute lookups of a module global, instead of two Python calls (``current_world().get(PLANS)``)
    on every collective. The plans themselves live in the World."""

    __slots__ = ("by_group", "plans")

    def __init__(self, plans: Plans) -> None:
        self.plans = plans
        self.by_group = plans.by_group


hot = _Hot(current_world().get(PLANS))


def plan_for(group: dist.ProcessGroup | None) -> GroupPlan | None:
    """The current world's plan of ``group`` (None: the default group), built on first use.

    Args:
        group: a process group, ``dist.group.WORLD`` or None.

    Returns:
        The plan, or None when no process group is initialized (a world of one).

    Raises:
        ValueError: this rank is not a member of ``group``.
    """
    plans = hot.plans
    try:
        plan = plans.by_group.get(_world.default_pg if group is None else group)
    except (TypeError, AttributeError):  # an unhashable group (group_info explains), or no _world yet
        plan = None
    if plan is not None:
        return plan
    info = group_info(group)
    if info is None:
        return None
    with plans.lock:
        plan = plans.by_group.get(info.group)
        if plan is None:
            plan = plans.by_group[info.group] = GroupPlan(info, call_count(info), get_config())
    return plan


def forget_plans(world: World | None = None) -> None:
    """Drops the plans of ``world`` (default: the current one). Each holds its group alive.

    Args:
        world: the world whose plans to drop.
    """
    plans = hot.plans if world is None else world.get(PLANS)
    with plans.lock:
        plans.by_group.clear()


def _follow_world(change: WorldChange) -> None:
    """Plans of the new world from now on; the old world's groups are abandoned: let them go (the
    reaper frees them)."""
    plans = change.new.get(PLANS)
    hot.plans, hot.by_group = plans, plans.by_group
    if change.old is not change.new:
        forget_plans(change.old)


subscribe(_follow_world)
