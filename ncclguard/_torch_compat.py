"""The one door to torch.distributed's private APIs.

ncclguard reads what torch keeps private: the world's bookkeeping (group names, ranks, stores),
a group's backend timeout, the backend's sequence number and its flight recorder. Every such
access goes through a function here, and each is gated: a torch older than the version that
introduced the API, or one that renamed or removed it, gets :class:`~ncclguard.errors.TorchCompatError`
naming the API and the torch in use, instead of an ``AttributeError`` deep in a report. Tested on
torch 2.13 (CPU, gloo); ``tests/house/test_torch_compat.py`` exercises every entry.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.errors import TorchCompatError

__all__ = [
    "API_MIN_VERSION",
    "TORCH_VERSION",
    "abort_all_groups",
    "backend_timeout",
    "backend_timeout_reader",
    "default_group",
    "default_store",
    "destroy_world_quietly",
    "ddp_bucket_parameters",
    "ddp_buckets_rebuilt",
    "ddp_initial_buckets",
    "ddp_update_process_group",
    "init_stand_in_group",
    "dump_flight_recorder",
    "flight_recorder_available",
    "get_default_timeout_fn",
    "grad_scaler_forget_step",
    "group_names",
    "group_ranks",
    "group_store",
    "hook_world_teardown",
    "rank_not_in_group",
    "rebind_group_defaults",
    "routed_default_group",
    "sequence_number",
    "set_default_timeout_fn",
    "set_group_timeout",
    "work_error",
    "world",
    "world_attributes",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION: tuple[int, int] = _version(torch.__version__)

# The first torch release in which each private API has the shape used here. Below it, the
# entry refuses with a clear error rather than guessing at an older shape.
API_MIN_VERSION: dict[str, tuple[int, int]] = {
    "distributed_c10d._world": (2, 0),
    "distributed_c10d._get_default_group": (2, 0),
    "distributed_c10d._get_default_store": (2, 0),
    "distributed_c10d._rank_not_in_group": (2, 0),
    "distributed_c10d._update_default_pg": (2, 0),
    "distributed_c10d._get_default_timeout": (2, 2),
    "distributed_c10d._set_pg_timeout": (2, 4),
    "ProcessGroup._get_backend(device).options._timeout": (2, 2),
    "ProcessGroup._get_sequence_number_for_group": (2, 2),
    "torch._C._distributed_c10d._dump_fr_trace_json": (2, 7),
    "torch._C._distributed_c10d._dump_nccl_trace_json": (2, 5),
    "ProcessGroupNCCL._group_start": (2, 2),
    "torch.distributed.nn.functional defaults": (2, 0),
    "torch.testing._internal.distributed.fake_pg": (2, 2),
    "torch.utils.data.dataloader._BaseDataLoaderIter": (2, 0),
    "Reducer._get_zeros_like_grad_buckets": (2, 0),
    "DistributedDataParallel._has_rebuilt_buckets": (2, 0),
    "torch.distributed._compute_bucket_assignment_by_size": (2, 0),
    "GradScaler._per_optimizer_states": (2, 3),
}


def _gate(api: str) -> None:
    need = API_MIN_VERSION[api]
    if TORCH_VERSION < need:
        raise TorchCompatError(
            f"ncclguard needs torch's private {api}, present from torch {need[0]}.{need[1]}; this is torch "
            f"{torch.__version__}. Upgrade torch, or pin ncclguard to a release that supports it."
        )


def _missing(api: str, exc: BaseException | None = None) -> TorchCompatError:
    return TorchCompatError(
        f"torch {torch.__version__} has no usable {api} ({exc or 'attribute missing'}); ncclguard was tested "
        "on torch 2.13. Report this with your torch version; the rest of ncclguard keeps working."
    )


def _c10d() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d


@functools.cache
def _c10d_attr(name: str) -> Any:
    api = f"distributed_c10d.{name}"
    _gate(api)
    try:
        return getattr(_c10d(), name)
    except AttributeError as exc:
        raise _missing(api, exc) from None


def world() -> Any:
    """torch's ``_World`` singleton (``pg_names``, ``pg_map``, ...), read-only but its group counter; bound once."""
    return _c10d_attr("_world")


def world_attributes() -> dict[str, Any]:
    """The live ``__dict__`` of torch's ``_World`` (read-only): ``"_default_pg"`` is the group ``group=None``
    stands for, read by the recording wrappers without the property's call (a torch without the key: the property)."""
    return vars(world())


def default_group() -> dist.ProcessGroup:
    """The default (world) process group; raises ``ValueError`` from torch when there is none."""
    return _c10d_attr("_get_default_group")()


def default_store() -> dist.Store:
    """The default group's store (often a ``PrefixStore`` over the job's ``TCPStore``)."""
    return _c10d_attr("_get_default_store")()


_quiet = threading.local()  # on while ncclguard destroys a world it rebuilds (destroy_world_quietly)


def destroy_world_quietly() -> None:
    """``destroy_process_group()`` of the whole world without :func:`hook_world_teardown`'s hooks:
    ncclguard's own rebuild, which is no end of the job (the store stays with the job). With no world
    (its ``init_process_group`` raised), torch's group counter goes back to 0 as the destroy sets it:
    the failed init counted a name, and the next one would key its handshake apart from its peers'."""
    if not dist.is_initialized():
        world().group_count = 0
        return
    _quiet.on = True
    try:
        dist.destroy_process_group()
    finally:
        _quiet.on = False


def hook_world_teardown(before: Callable[[], None]) -> Callable[[], None]:
    """Calls ``before`` when ``destroy_process_group()`` ends this process's world, however its caller
    reached it (``from torch.distributed import destroy_process_group`` binds torch's function before
    any wrapper exists): it calls ``_update_default_pg(None)`` through its module, after the groups'
    shutdown, before torch lets go of them and of their store. Not at ``_abort_process_group``, nor in
    :func:`destroy_world_quietly`. Returns what undoes it (a later hook over this one is left)."""
    api = "distributed_c10d._update_default_pg"
    _gate(api)
    c10d = _c10d()
    original = getattr(c10d, api.rsplit(".", 1)[1], None)
    if not callable(original):
        raise _missing(api)

    def _update_default_pg(pg: Any) -> Any:
        caller = sys._getframe(1).f_code.co_name  # torch's destroy of the world; not its abort, nor an init
        if pg is None and caller == "destroy_process_group" and not getattr(_quiet, "on", False):
            before()
        return original(pg)

    c10d._update_default_pg = _update_default_pg

    def undo() -> None:
        if getattr(c10d, "_update_default_pg", None) is _update_default_pg:
            c10d._update_default_pg = original

    return undo


def rank_not_in_group(group: dist.ProcessGroup) -> bool:
    """True when this rank is not a member of ``group``."""
    return bool(_c10d_attr("_rank_not_in_group")(group))


def group_names() -> dict[dist.ProcessGroup, str]:
    """A snapshot of every live group and its name (the main thread may add groups meanwhile)."""
    return dict(world().pg_names)


def group_ranks() -> dict[dist.ProcessGroup, dict[int, int]]:
    """A snapshot of every live group's global-to-group rank map."""
    return dict(world().pg_group_ranks)


def group_store(group: dist.ProcessGroup) -> dist.Store | None:
    """The store ``group`` was created with, or None when torch does not know the group."""
    entry = world().pg_map.get(group)
    return entry[1] if entry is not None else None


def backend_timeout(group: dist.ProcessGroup, device: Any = None) -> timedelta:
    """The timeout in force of ``group``'s backend for ``device`` (default: CPU)."""
    return timedelta(seconds=backend_timeout_reader(group, device)())


def backend_timeout_reader(group: dist.ProcessGroup, device: Any = None) -> Callable[[], float]:
    """A function that reads :func:`backend_timeout` in seconds at each call, at a third of its cost (the
    hot path reads it per call): the options object, which ``_set_pg_timeout`` changes in place, is found once."""
    api = "ProcessGroup._get_backend(device).options._timeout"
    _gate(api)
    try:
        options = group._get_backend(device or torch.device("cpu")).options
        options._timeout  # noqa: B018 - fail here, not at the first read
    except AttributeError as exc:
        raise _missing(api, exc) from None
    return lambda: options._timeout.total_seconds()


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Sets the default timeout of ops later started on ``group``."""
    _c10d_attr("_set_pg_timeout")(timeout, group)


def sequence_number(group: dist.ProcessGroup) -> int:
    """The backend's count of collectives run on ``group``, whoever issued them (Python or C++)."""
    api = "ProcessGroup._get_sequence_number_for_group"
    _gate(api)
    try:
        # torch's stubs (torch/_C/_distributed_c10d.pyi) do not declare this binding of ProcessGroup.
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise _missing(api, exc) from None


def get_default_timeout_fn() -> Callable[[Any], timedelta]:
    """torch's ``_get_default_timeout(backend)``, which ``new_group(timeout=None)`` consults."""
    fn = _c10d_attr("_get_default_timeout")
    if not callable(fn):
        raise _missing("distributed_c10d._get_default_timeout")
    return fn


def set_default_timeout_fn(fn: Callable[[Any], timedelta]) -> None:
    """Replaces torch's ``_get_default_timeout`` (``ncclguard.init_process_group`` does, reversibly)."""
    get_default_timeout_fn()  # gate and check before touching torch
    _c10d()._get_default_timeout = fn


@contextmanager
def routed_default_group(group: dist.ProcessGroup) -> Iterator[None]:
    """Makes ``group``, over the world's ranks numbered the same, the default group inside the block,
    so ``group=None`` collectives use it. Raises ``RuntimeError`` when there is no default group, or
    ``group`` does not span the world in order."""
    w = world()
    saved = w.default_pg
    if saved is None:
        raise RuntimeError("routed_default_group needs an initialized default process group")
    if dist.get_world_size(group) != dist.get_world_size() or dist.get_rank(group) != dist.get_rank():
        raise RuntimeError("the routed group must span every rank of the world with the same rank numbers")
    w.default_pg = group
    try:
        yield
    finally:
        w.default_pg = saved


def flight_recorder_available() -> bool:
    """True when this torch can dump its flight recorder as JSON."""
    try:
        _gate("torch._C._distributed_c10d._dump_fr_trace_json")
    except TorchCompatError:
        return False
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def dump_flight_recorder(*, only_active: bool = False, nccl: bool = False) -> str:
    """torch's own flight recorder as JSON text: every backend op it recorded, C++-issued ones too.

    Args:
        only_active: only the entries not yet completed.
        nccl: the NCCL recorder (``_dump_nccl_trace_json``, started and completed states), not the
            backend-neutral one (gloo included).

    Raises:
        TorchCompatError: this torch has no such dump."""
    api = "torch._C._distributed_c10d." + ("_dump_nccl_trace_json" if nccl else "_dump_fr_trace_json")
    _gate(api)
    fn = getattr(torch._C._distributed_c10d, api.rsplit(".", 1)[1], None)
    if fn is None:
        raise _missing(api)
    raw = fn(includeCollectives=True, onlyActive=only_active)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def abort_all_groups() -> tuple[list[str], list[str]]:
    """Calls ``abort()`` on every process group, newest first, NCCL's inside one group call. Returns
    (names aborted, ``"name: error"`` for each group whose abort raised)."""
    groups = sorted(group_names().items(), key=lambda kv: kv[1], reverse=True)
    nccl = None
    try:
        backend = default_group()._get_backend(torch.device("cuda"))
        c10d = _c10d()
        if c10d.is_nccl_available() and isinstance(backend, c10d.ProcessGroupNCCL):
            _gate("ProcessGroupNCCL._group_start")
            nccl = backend
    except (RuntimeError, ValueError, AttributeError):
        nccl = None
    aborted, failed = [], []
    # As torch's _abort_process_group: NCCL aborts inside one group call, so the communicators'
    # aborts cannot deadlock each other (pytorch#119797).
    if nccl is not None:
        nccl._group_start()
    for pg, name in groups:
        try:
            pg.abort()
            aborted.append(name)
        except Exception as exc:  # noqa: BLE001 - one group's failure must not stop the others
            failed.append(f"{name}: {exc}")
    if nccl is not None:
        nccl._group_end()
    return aborted, failed


def rebind_group_defaults(abandoned: Collection[dist.ProcessGroup]) -> list[str]:
    """Unbinds abandoned groups from the defaults of ``torch.distributed.nn.functional``, whose functions
    default to ``group=group.WORLD`` as it was at import (``torch._dynamo``, which DDP imports, imports it):
    after a rebuild they would run on the abandoned group and keep it alive. Each such default becomes
    ``None``, the default group of the moment. The module is not imported here.

    Args:
        abandoned: the groups no longer in use.

    Returns:
        The names of the functions changed.
    """
    _gate("torch.distributed.nn.functional defaults")
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return []
    gone = {id(g) for g in abandoned}
    changed = []
    for name, fn in list(vars(module).items()):
        if not isinstance(fn, types.FunctionType) or fn.__module__ != module.__name__ or not fn.__defaults__:
            continue
        if any(id(d) in gone for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if id(d) in gone else d for d in fn.__defaults__)
            changed.append(name)
    return changed


def work_error(work: Any) -> BaseException | None:
    """The error a completed ``Work`` ended with, or None. ``Work.exception()`` is deprecated, and some
    builds cannot return its ``exception_ptr`` (torch 2.11.0+cu130 raised ``TypeError: Unable to convert
    function return value`` for a successful NCCL op on an H100): there ``work.wait()``, which returns
    at once on a completed op, raises the recorded error instead."""
    try:
        exc = work.exception()
    except TypeError:
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 - the backend's error, returned to the caller
            return err
        return None
    return exc if isinstance(exc, BaseException) else None


def ddp_update_process_group(ddp: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Points a ``DistributedDataParallel`` at ``group`` in place (``_update_process_group``): the reducer's
    state is reset, so a forward may follow a backward that did not finish, and the next backward
    rebuilds the buckets on the new group. A hook of ``register_comm_hook`` keeps its own state."""
    update = getattr(ddp, "_update_process_group", None)
    if not callable(update):
        raise _missing("DistributedDataParallel._update_process_group")
    update(group)


def grad_scaler_forget_step(scaler: Any) -> None:
    """Forgets what a ``GradScaler`` noted in a step that is redone (``_per_optimizer_states``, which
    ``update()`` resets): ``unscale_`` marks each optimizer unscaled until ``update()``, so a redo would
    raise "unscale_() has already been called ...". The scale and growth tracker are left as they are."""
    _gate("GradScaler._per_optimizer_states")
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None or not callable(getattr(states, "clear", None)):
        raise _missing("GradScaler._per_optimizer_states")
    states.clear()


def ddp_bucket_parameters(ddp: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The parameters of each gradient bucket of a ``DistributedDataParallel``, in the order its reducer
    all-reduces them, each bucket's in its buffer's order, from ``Reducer._get_zeros_like_grad_buckets``
    (DDP's join hook uses it), which holds zeros the size of the gradients for the call's moment only.

    Raises:
        TorchCompatError: this torch has no such method, or ``ddp`` has no reducer.
    """
    api = "Reducer._get_zeros_like_grad_buckets"
    _gate(api)
    read = getattr(getattr(ddp, "reducer", None), "_get_zeros_like_grad_buckets", None)
    if not callable(read):
        raise _missing(api)
    return [list(bucket.parameters()) for bucket in read()]


def ddp_buckets_rebuilt(ddp: torch.nn.Module) -> bool:
    """Whether a ``DistributedDataParallel`` has rebuilt its gradient buckets (``_has_rebuilt_buckets``): with
    ``find_unused_parameters=False`` it does once, in the forward after its first backward, in that order.

    Raises:
        TorchCompatError: this torch keeps no such flag.
    """
    api = "DistributedDataParallel._has_rebuilt_buckets"
    _gate(api)
    value = getattr(ddp, "_has_rebuilt_buckets", None)
    if not isinstance(value, bool):
        raise _missing(api)
    return value


@contextmanager
def ddp_initial_buckets(buckets: list[list[torch.Tensor]]) -> Iterator[None]:
    """Inside the block, a ``DistributedDataParallel`` built over exactly the parameters of ``buckets``
    starts with those gradient buckets instead of its first layout: DDP's constructor takes it from
    ``torch.distributed._compute_bucket_assignment_by_size`` and hands the reducer that list reversed
    (``_ddp_init_helper``; run on torch 2.13, and 2.11 with CUDA), which answers ``buckets`` here.

    Args:
        buckets: the parameters of each bucket, in the order the reducer is to all-reduce them,
            each bucket's in the order of its buffer.

    Raises:
        TorchCompatError: this torch has no such function.
    """
    api = "torch.distributed._compute_bucket_assignment_by_size"
    _gate(api)
    torch_own = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if not callable(torch_own):
        raise _missing(api)
    wanted = sorted(id(p) for bucket in buckets for p in bucket)

    def assign(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if sorted(id(t) for t in tensors) != wanted:
            return torch_own(tensors, *args, **kwargs)
        at = {id(t): i for i, t in enumerate(tensors)}
        indices = [[at[id(p)] for p in bucket] for bucket in buckets]
        limits = [sum(p.numel() * p.element_size() for p in bucket) for bucket in buckets]
        return indices[::-1], limits[::-1]  # DDP reverses both for its reducer

    setattr(dist, "_compute_bucket_assignment_by_size", assign)  # noqa: B010 - a private name, put back below
    try:
        yield
    finally:
        setattr(dist, "_compute_bucket_assignment_by_size", torch_own)  # noqa: B010


def init_stand_in_group(init: Callable[..., Any] | None = None) -> None:
    """Makes a stand-in default group: a world of one on torch's ``fake`` backend (``fake_pg``), whose
    collectives return at once, self-consistent in a world of one (Lightning's ``strategy.broadcast``
    returns the caller's object, DDP's constructor finds nothing to sync); no device is needed.

    Args:
        init: torch's ``init_process_group`` (default ``torch.distributed.init_process_group``).

    Raises:
        TorchCompatError: this torch has no fake backend.
    """
    _gate("torch.testing._internal.distributed.fake_pg")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        raise _missing("torch.testing._internal.distributed.fake_pg", exc) from None
    (init or dist.init_process_group)("fake", store=FakeStore(), rank=0, world_size=1)


def dataloader_iter_class() -> type:
    """The class of every DataLoader's iterator (``dataloader._BaseDataLoaderIter``): its ``__next__``,
    where the main thread waits for a batch, reaches single- and multi-process loaders alike.

    Raises:
        TorchCompatError: this torch has no such class.
    """
    api = "torch.utils.data.dataloader._BaseDataLoaderIter"
    _gate(api)
    from torch.utils.data import dataloader

    cls = getattr(dataloader, "_BaseDataLoaderIter", None)
    if not isinstance(cls, type) or "__next__" not in cls.__dict__:
        raise _missing(api)
    return cls
