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

Each wrapper is one of two, which record the same (tests/recording/test_flight_records.py compares them):
the compiled one (``_hotpath.c``, built by setup.py where a C compiler is), which forwards the
caller's arguments untouched, and otherwise one generated here from ``_BODY`` with the op's own
parameter list. What a call costs, part by part: benchmarks/recording_breakdown.py.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ncclguard import _torch_compat as compat
from ncclguard.recording import sites
from ncclguard.recording.flight import hotpath, recorder
from ncclguard.recording.phase import MAIN, current_phase
from ncclguard.recording.record import OpKind
from ncclguard.recording.sites import user_files, user_frame

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
world = compat.world()  # torch's _World: default_pg (the group None stands for) and pg_names
_world_attributes = compat.world_attributes()  # its __dict__: "_default_pg", without the property
# torch's group -> name dict, which the wrappers read directly (torch 2.13 never replaces it; if a
# torch does, _counter_of sees it and points every wrapper, _wrappers, at the new one).
_names: list[dict[Any, str]] = [world.pg_names]
_wrappers: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
# The compiled wrapper (setup.py builds it where a C compiler is); None: the generated one serves.
_hotpath: ModuleType | None = hotpath


def _describe(data: Any) -> tuple[int, Any]:
    """(elements, dtype) of a tensor or a list of tensors; the dtype as a ``torch.dtype``, or
    ``""`` without a tensor (records name it when read)."""
    if isinstance(data, torch.Tensor):
        return data.numel(), data.dtype
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], torch.Tensor):
        return sum(t.numel() for t in data if isinstance(t, torch.Tensor)), data[0].dtype
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


# The parts of the wrapper's body, in the order benchmarks/recording_breakdown.py adds them to
# measure each (lines marked "# @part" belong to a part, "# !part" stand in for it while it is
# left out; _wrap drops the markers and, by default, keeps every part).
PARTS = ("thread", "describe", "counter", "site", "time", "phase", "record", "ring", "open", "close")

# The wrapper's body, compiled once per op with the op's own parameter list (see _wrap): named
# parameters cost less than unpacking *args/**kwargs on every call. Names in braces are filled in.
# It writes the record itself, as record.new_raw lays it out: one list, built in one step, holding
# what is at hand unformatted (the op's kind and ReduceOp, the torch.dtype, the user frame's code
# and offset); reading a record formats it (record.FlightRecord). Budget: 1.5 us a call, from the
# user's call to the backend's and back (benchmarks/recording_cost.py, recording_breakdown.py).
_BODY = """
def recorded({params}):
    _tid = get_ident()  # @thread
    if _tid in opened:  # inside a recorded call of this thread (safe_all_reduce's chunks): counted there  # @thread
        return original({call})  # @thread
    _tid = main.ident  # !thread
    _data = {data}  # @describe
    if type(_data) is tensor_type:  # @describe
        _numel = _data.numel()  # @describe
        _dtype = _data.dtype  # @describe
    else:  # @describe
        _numel, _dtype = describe(_data)  # @describe
    _numel, _dtype = 0, ""  # !describe
    try:  # @counter
        # group=None is torch's default group: _World's attribute, read without its property
        _name = pg_names[group if group is not None else world_attributes["_default_pg"]]  # @counter
        _count = counts[_name]  # @counter
    except (KeyError, TypeError):  # first use of the group, or a group torch does not know  # @counter
        _name, _count = counter_of(group, counts)  # @counter
    _seq = _count[0] + 1  # C_SEQ  # @counter
    _count[0] = _seq  # @counter
    _name, _seq = "?", 0  # !counter
    _frame = getframe(1)  # @site
    _code = _frame.f_code  # @site
    if _code.co_filename not in user_files:  # a library frame (DeepSpeed's), or a file not seen yet  # @site
        _frame = user_frame(_frame)  # @site
        _code = None if _frame is None else _frame.f_code  # @site
    _lasti = -1 if _frame is None else _frame.f_lasti  # @site
    _code, _lasti = None, -1  # !site
    _start = time()  # @time
    _start = 0.0  # !time
    _phase = main.path if _tid == main.ident else current_phase()  # @phase
    _phase = ""  # !phase
    _rec = [_seq, kind, {op}, _name, _numel, _dtype, _start, None, _phase, _code, _lasti, _tid, {is_async}, {peer}, None, None, None, None]  # @record
    recorder.ring.append(_rec)  # @ring
    opened[_tid] = _rec  # @open
    try:  # @record
        _out = original({call})  # @record
    except BaseException as _exc:  # @record
        finish(_rec, _exc)  # @record
        raise  # @record
    _out = original({call})  # !record
    if {is_async} and _out is not None:  # @open
        attach(_rec, _out)  # stays in flight until its Work completes (the watchdog's sweep)  # @open
        return _out  # @open
    try:  # @open
        if opened[_tid] is _rec:  # @open
            del opened[_tid]  # @open
        else:  # a record start()ed inside this call and left open  # @open
            finish(_rec)  # @open
            return _out  # @open
    except KeyError:  # cleared meanwhile (a world change)  # @open
        pass  # @open
    _rec[7] = time()  # END, the outcome: completed  # @close
    if _seq > _count[1]:  # C_DONE  # @close
        _count[1] = _seq  # @close
    return _out
"""
_PLAIN = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _cut(source: str, parts: tuple[str, ...]) -> str:
    """``source`` with the lines of ``parts`` ("# @part") and the stand-ins of the parts left out
    ("# !part"); the markers themselves removed."""
    out = []
    for raw in source.splitlines():
        code, sep, mark = raw.rpartition("  # ")
        if not sep or mark[:1] not in ("@", "!"):
            out.append(raw)
            continue
        if (mark[0] == "@") == (mark[1:] in parts):
            out.append(code)
    return "\n".join(out) + "\n"


def _counter_of(pg: Any, counts: dict[str, Any]) -> tuple[str, Any]:
    """The slow path of a wrapper's counter: the group's name read through torch's ``_World``
    (``"?"``: no group, or one torch does not know), and its counter, made on first use."""
    if pg is None:
        pg = world.default_pg
    try:
        name = world.pg_names.get(pg) if pg is not None else None
    except TypeError:  # an unhashable group: torch refuses it itself
        name = None
    if name is not None and world.pg_names is not _names[0]:
        _names[0] = world.pg_names  # torch replaced its dict: the wrappers read the new one
        for fn in list(_wrappers):  # the generated ones; the compiled ones read _names[0]
            if hasattr(fn, "__globals__"):
                fn.__globals__["pg_names"] = _names[0]
    p2p = counts is recorder.p2p_counts
    return (name or "?"), recorder.count(name or "?", p2p)


def _wrap(
    spec: _Spec,
    original: Callable[..., Any],
    like: Callable[..., Any] | None = None,
    parts: tuple[str, ...] = PARTS,
    compiled: bool | None = None,
) -> Callable[..., Any]:
    """The recording wrapper of ``original``: same parameters, same defaults (the very objects).

    Args:
        spec: where the op's arguments sit.
        original: the function to call.
        like: the function whose parameters to take instead (the benchmarks wrap a no-op).
        parts: the parts of the body to keep (all; the breakdown measures fewer).
        compiled: the compiled wrapper (``_hotpath``), the generated Python one (False), or the
            compiled one where it was built (None). Only the whole body has a compiled form.

    Raises:
        RuntimeError: the op's signature is one the wrapper cannot mirror, or ``compiled=True``
            without a compiled wrapper.
    """
    signature = inspect.signature(like or original)
    params = list(signature.parameters.values())
    if not all(p.kind in _PLAIN for p in params) or any(p.name.startswith("_") for p in params):
        raise RuntimeError(f"torch.distributed.{spec.name} has a signature instrument() cannot mirror: {params}")
    if compiled is None:
        compiled = _hotpath is not None and parts == PARTS
    if compiled and (_hotpath is None or parts != PARTS):
        raise RuntimeError("the compiled recording wrapper is not built here (or cannot cut parts)")
    # Everything the wrapper needs is bound here, once: it runs on every collective.
    namespace: dict[str, Any] = {
        "original": original,
        "kind": OpKind(spec.name, spec.op is not None),
        "describe": _describe,
        "recorder": recorder,
        "opened": recorder.opened,
        "counts": recorder.p2p_counts if spec.peer is not None else recorder.counts,
        "counter_of": _counter_of,
        "finish": recorder.finish,
        "attach": recorder.attach,
        "tensor_type": torch.Tensor,
        "world": world,
        "world_attributes": _world_attributes,
        "pg_names": _names[0],
        "names": _names,
        "get_ident": threading.get_ident,
        "getframe": sys._getframe,
        "user_files": user_files,
        "is_framework": sites._is_framework,
        "user_frame": user_frame,
        "time": time.time,
        "main": MAIN,
        "current_phase": current_phase,
    }
    clash = [p.name for p in params if p.name in namespace]
    if clash:
        raise RuntimeError(f"torch.distributed.{spec.name}'s parameters {clash} clash with instrument()'s names")
    if compiled:
        assert _hotpath is not None
        recorded: Any = _hotpath.Wrapper(original, namespace["kind"], _compiled_spec(spec, params), namespace)
        recorded.__signature__ = signature
    else:
        recorded = _generated(spec, params, namespace, parts)
    recorded = functools.wraps(original)(recorded)
    recorded.__ncclguard_original__ = original
    _wrappers.add(recorded)
    return cast(Callable[..., Any], recorded)


def _compiled_spec(spec: _Spec, params: list[inspect.Parameter]) -> dict[str, Any]:
    """Where the compiled wrapper finds each argument: (position, name, default) or None."""

    def entry(where: tuple[int, str] | None) -> tuple[int, str, Any] | None:
        if where is None:
            return None
        default = params[where[0]].default
        return (where[0], where[1], None if default is inspect.Parameter.empty else default)

    return {
        "data": entry(spec.data),
        "group": entry(spec.group),
        "op": entry(spec.op),
        "async_op": entry(spec.async_op),
        "peer": entry(spec.peer),
        "always_async": spec.name in _ALWAYS_ASYNC,
        "p2p": spec.peer is not None,
        "names": tuple(p.name for p in params),
        "required": tuple(i for i, p in enumerate(params) if p.default is inspect.Parameter.empty),
        "positional": sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params),
    }


def _generated(
    spec: _Spec, params: list[inspect.Parameter], namespace: dict[str, Any], parts: tuple[str, ...]
) -> Callable[..., Any]:
    """The Python wrapper: _BODY with the op's own parameter list, compiled once."""
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
    source = _cut(_BODY, parts).format(
        params=", ".join(heads),
        call=", ".join(args),
        data=spec.data[1] if spec.data is not None else "None",
        op=spec.op[1] if spec.op is not None else "None",
        # Kept as passed (a record reads it with bool()): no call on the path.
        is_async="True" if spec.name in _ALWAYS_ASYNC else (spec.async_op[1] if spec.async_op else "False"),
        # A send/recv numbers in "<group>:p2p" even when its peer argument is None (a group_dst).
        peer=f"(-1 if {peer} is None else {peer})" if peer is not None else "None",
    )
    exec(compile(source, f"<ncclguard.instrument:{spec.name}>", "exec"), namespace)
    return cast(Callable[..., Any], namespace["recorded"])


def instrument(ops: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Wraps the public ``torch.distributed`` collectives so each call is flight-recorded.

    Idempotent: instrumenting twice wraps once. Call it right after ``init_process_group`` and
    before ``deepspeed.init_distributed`` (DeepSpeed binds ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` when its communication backend starts) or any
    ``from torch.distributed import ...``.

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
