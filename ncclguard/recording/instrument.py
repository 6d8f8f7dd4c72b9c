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
from ncclguard._naming import _DTYPE_NAMES as dtype_names
from ncclguard._naming import REDUCE_OP_NAMES, dtype_name
from ncclguard.recording.flight import recorder

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


# The wrapper's body, compiled once per op with the op's own parameter list (see _wrap): named
# parameters cost less than unpacking *args/**kwargs on every call. Names in braces are filled in.
# The recording itself is the recorder's hot path (open_fast, close_ok): two calls per op.
_BODY = """
def recorded({params}):
    _data = {data}
    if type(_data) is tensor_type:
        _numel = _data.numel()
        _dtype = dtype_names.get(_data.dtype) or dtype_name(_data.dtype)
    else:
        _numel, _dtype = describe(_data)
    _reduce_op = {op}
    if _reduce_op is None:
        _op = default_op
    else:
        try:
            _op = op_names.get(_reduce_op, bare)
        except TypeError:  # a premultiplied-sum op object (unhashable): the bare name
            _op = bare
    _is_async = {is_async}
    _pg = group if group is not None else world.default_pg
    _rec = open_fast(_op, world.pg_names.get(_pg, "?") if _pg is not None else "?", _numel, _dtype, _is_async, {peer})
    if _rec is None:  # inside a recorded call (safe_all_reduce's chunks): counted once, there
        return original({call})
    try:
        _out = original({call})
    except BaseException as _exc:
        finish(_rec, _exc)
        raise
    if _is_async and _out is not None:
        attach(_rec, _out)
    else:
        close_ok(_rec)
    return _out
"""
_PLAIN = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _wrap(spec: _Spec, original: Callable[..., Any], like: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The recording wrapper of ``original``: same parameters, same defaults (the very objects).
    ``like``: the function whose parameters to take instead (the benchmark wraps a no-op)."""
    params = list(inspect.signature(like or original).parameters.values())
    if not all(p.kind in _PLAIN for p in params) or any(p.name.startswith("_") for p in params):
        raise RuntimeError(f"torch.distributed.{spec.name} has a signature instrument() cannot mirror: {params}")
    # ReduceOp -> "all_reduce(SUM)": a dict lookup instead of formatting on every call.
    op_names = {red: f"{spec.name}({text})" for red, text in REDUCE_OP_NAMES.items()}
    # Everything the wrapper needs is bound here, once: it runs on every collective (budget 1.5 us;
    # benchmarks/recording_cost.py). The recorder's methods are bound once too (a bound method is
    # one lookup instead of two per call).
    namespace: dict[str, Any] = {
        "original": original,
        "op_names": op_names,
        "default_op": op_names[dist.ReduceOp.SUM] if spec.op is not None else spec.name,
        "bare": spec.name,
        "describe": _describe,
        "open_fast": recorder.open_fast,
        "close_ok": recorder.close_ok,
        "finish": recorder.finish,
        "attach": recorder.attach,
        "tensor_type": torch.Tensor,
        "world": compat.world(),
        "dtype_names": dtype_names,
        "dtype_name": dtype_name,
    }
    clash = [p.name for p in params if p.name in namespace]
    if clash:
        raise RuntimeError(f"torch.distributed.{spec.name}'s parameters {clash} clash with instrument()'s names")
    heads, args = [], []
    star = False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            heads.append("*")
            star = True
        if p.default is inspect.Parameter.empty:
            heads.append(p.name)
        else:
            namespace[f"_default{i}"] = p.default
            heads.append(f"{p.name}=_default{i}")
        args.append(p.name if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}")
    peer = spec.peer[1] if spec.peer is not None else None
    source = _BODY.format(
        params=", ".join(heads),
        call=", ".join(args),
        data=spec.data[1] if spec.data is not None else "None",
        op=spec.op[1] if spec.op is not None else "None",
        is_async="True" if spec.name in _ALWAYS_ASYNC else (f"bool({spec.async_op[1]})" if spec.async_op else "False"),
        # A send/recv numbers in "<group>:p2p" even when its peer argument is None (a group_dst).
        peer=f"(-1 if {peer} is None else {peer})" if peer is not None else "None",
    )
    exec(compile(source, f"<ncclguard.instrument:{spec.name}>", "exec"), namespace)
    recorded = functools.wraps(original)(namespace["recorded"])
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
