"""instrument(): record every public ``torch.distributed`` collective in the flight recorder.

The wrappers replace the functions in both ``torch.distributed`` and
``torch.distributed.distributed_c10d`` (the same objects), so the user's calls, DeepSpeed's
(``deepspeed.comm`` calls ``torch.distributed.<op>`` at call time) and torch's own helpers built
on them (``all_gather_object`` -> ``all_gather``) are recorded. Code that bound a function
before ``instrument()`` (``from torch.distributed import all_reduce``) keeps the original: call
``instrument()`` right after ``init_process_group``. DDP's gradient all-reduces run in C++ and
are not seen (torch's own flight recorder, ``TORCH_FR_BUFFER_SIZE``, sees those).

A call made while the thread is already inside a recorded collective (the chunks of
``safe_all_reduce``) is not recorded again, so sequence numbers stay one per user-level call.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ncclguard import _torch_compat as compat
from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.diagnosis.flight import recorder

__all__ = ["INSTRUMENTED_OPS", "instrument", "uninstrument", "is_instrumented"]

# op -> the parameter that holds the data it sends (its size is the record's numel).
_DATA_PARAM: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_single": "input_tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "broadcast": "tensor",
    "reduce": "tensor",
    "barrier": None,
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
INSTRUMENTED_OPS: tuple[str, ...] = tuple(_DATA_PARAM)
_P2P_PEER = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
_ALWAYS_ASYNC = {"isend", "irecv"}
_lock = threading.Lock()
# name -> the original function, for as long as the wrappers are installed.
_originals: dict[str, Callable[..., Any]] = {}


def _describe(data: Any) -> tuple[int, str]:
    """(elements, dtype) of a tensor or a list of tensors."""
    if isinstance(data, torch.Tensor):
        return data.numel(), dtype_name(data.dtype)
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], torch.Tensor):
        return sum(t.numel() for t in data if isinstance(t, torch.Tensor)), dtype_name(data[0].dtype)
    return 0, ""


@dataclass(frozen=True)
class _Spec:
    """Where a function's arguments sit, found once from its signature."""

    name: str
    data: tuple[int, str] | None  # (position, name)
    group: tuple[int, str]
    async_op: tuple[int, str] | None
    op: tuple[int, str] | None
    peer: tuple[int, str] | None


def _spec(name: str, fn: Callable[..., Any]) -> _Spec:
    params = list(inspect.signature(fn).parameters)

    def where(param: str | None) -> tuple[int, str] | None:
        return (params.index(param), param) if param is not None and param in params else None

    group = where("group")
    if group is None:
        raise RuntimeError(
            f"torch.distributed.{name} has no 'group' parameter in this torch; instrument() needs updating"
        )
    return _Spec(name, where(_DATA_PARAM[name]), group, where("async_op"), where("op"), where(_P2P_PEER.get(name)))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[int, str] | None, default: Any = None) -> Any:
    if where is None:
        return default
    pos, name = where
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _wrap(spec: _Spec, original: Callable[..., Any]) -> Callable[..., Any]:
    # Everything the wrapper needs is bound here, once: it runs on every collective (budget: 5 us).
    always_async = spec.name in _ALWAYS_ASYNC
    p2p = spec.name in _P2P_PEER
    data_at, group_at, op_at, peer_at = spec.data, spec.group, spec.op, spec.peer
    async_pos = spec.async_op[0] if spec.async_op is not None else -1
    # ReduceOp -> "all_reduce(SUM)": a dict lookup instead of formatting on every call.
    op_names = {red: f"{spec.name}({text})" for red, text in REDUCE_OP_NAMES.items()}
    default_op = op_names[dist.ReduceOp.SUM] if op_at is not None else spec.name
    start, finish, attach = recorder.start, recorder.finish, recorder.attach
    opened, get_ident = recorder._open, threading.get_ident  # recorder.busy(), inline
    tensor_type, world = torch.Tensor, compat.world()

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if opened.get(get_ident()):  # inside a recorded call (safe_all_reduce's chunks): count it once
            return original(*args, **kwargs)
        n = len(args)
        data = (args[data_at[0]] if n > data_at[0] else kwargs.get(data_at[1])) if data_at is not None else None
        if type(data) is tensor_type or isinstance(data, tensor_type):
            numel, dtype = data.numel(), dtype_name(data.dtype)
        else:
            numel, dtype = _describe(data)
        op = default_op
        if op_at is not None:
            reduce_op = args[op_at[0]] if n > op_at[0] else kwargs.get(op_at[1])
            if reduce_op is not None:
                try:
                    op = op_names.get(reduce_op, spec.name)
                except TypeError:  # a premultiplied-sum op object (unhashable): the bare name
                    op = spec.name
        group = args[group_at[0]] if n > group_at[0] else kwargs.get("group")
        is_async = always_async or (
            async_pos >= 0 and bool(args[async_pos] if n > async_pos else kwargs.get("async_op"))
        )
        peer = _arg(args, kwargs, peer_at, -1) if p2p else None
        pg = group if group is not None else world.default_pg
        rec = start(op, world.pg_names.get(pg, "?") if pg is not None else "?", numel, dtype, None, is_async, peer)
        try:
            out = original(*args, **kwargs)
        except BaseException as exc:
            finish(rec, exc)
            raise
        if is_async and out is not None:
            attach(rec, out)
        else:
            finish(rec)
        return out

    recorded.__ncclguard_original__ = original  # type: ignore[attr-defined]
    return recorded


def instrument(ops: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Wraps the public ``torch.distributed`` collectives so each call is flight-recorded.

    Idempotent: instrumenting twice wraps once. Call it right after ``init_process_group`` and
    before ``deepspeed.initialize`` or any ``from torch.distributed import ...``.

    Args:
        ops: names to wrap (default: all of :data:`INSTRUMENTED_OPS` this torch has).

    Returns:
        The names wrapped now or before.

    Raises:
        ValueError: a name in ``ops`` is not one of :data:`INSTRUMENTED_OPS`.
    """
    names = list(INSTRUMENTED_OPS if ops is None else ops)
    unknown = [n for n in names if n not in _DATA_PARAM]
    if unknown:
        raise ValueError(f"cannot instrument {unknown}: choose from {list(INSTRUMENTED_OPS)}")
    with _lock:
        for name in names:
            if name in _originals:
                continue
            original = getattr(dist, name, None)
            if original is None:  # an op this torch does not have (all_gather_single before 2.x)
                continue
            wrapper = _wrap(_spec(name, original), original)
            _originals[name] = original
            setattr(dist, name, wrapper)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, wrapper)
        return sorted(_originals)


def uninstrument() -> list[str]:
    """Puts back the exact original functions (``dist.all_reduce is`` the original again).

    Returns:
        The names restored.
    """
    with _lock:
        restored = sorted(_originals)
        for name, original in _originals.items():
            wrapper = getattr(dist, name, None)
            setattr(dist, name, original)
            if getattr(c10d, name, None) is wrapper:
                setattr(c10d, name, original)
        _originals.clear()
        return restored


def is_instrumented(name: str = "all_reduce") -> bool:
    """True while ``torch.distributed.<name>`` is the recording wrapper."""
    return name in _originals
