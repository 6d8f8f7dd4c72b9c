"""The state a step run again must find as the run without the fault had it: the module's buffers
and every random generator a step draws from (:class:`StepState`; a heal sends the generators with
:func:`generators_to_send`), an LR scheduler's rates after a resume from memory
(:func:`load_scheduler`), and DDP's gradient buckets across a re-wrap.

**The step's state** (:class:`StepState`). A failed step never reached ``optimizer.step()``, so the
parameters and the optimizer's state need no copy. Its forward may have changed buffers (BatchNorm's
running statistics) and drawn from the generators: torch's (dropout, on the CPU and on every CUDA
device), Python's ``random`` and NumPy's (data augmentation in user code). The recovery engine
(:mod:`ncclguard.recovery.engine`) takes a :class:`StepState` when a step begins and restores it
before each redo, whatever the framework.

**DDP's gradient buckets** carried across a re-wrap, so that a step redone on a rebuilt world sums
every gradient as the run without the fault did.

A ``DistributedDataParallel`` built with torch's defaults (``find_unused_parameters=False``)
reduces its first backward in one bucket per dtype and device; in the next forward it rebuilds its
buckets in the order that backward's gradients became ready, the first of 1 MiB and the others of
25 MiB (torch 2.13: ``compute_bucket_size_limits`` in ``torch/nn/parallel/distributed.py``, the
reducer's ``rebuild_buckets``). A wrapper built again after a rebuild starts from the first layout,
and a ring all-reduce adds an element's values in an order set by the element's place in its
bucket: a step redone in it summed some gradients in another order than the run without the fault
(3 gloo ranks, a BERT classifier of 2.05M float32 parameters, AdamW, rank 2 killed at step 4: 35 of
the 41 parameters ended different after 10 steps, by up to 2.4e-7).

:class:`~ncclguard.recovery.recovering.RecoveringStep` keeps the old layout for the wrapper it
builds itself, after every rebuild:

- :func:`kept_layout` reads the old wrapper's buckets before it is dropped;
- :func:`share_layout` gives every rank of the new world the reading of one rank that kept its
  wrapper (a restarted rank has none; it takes part in the same broadcast);
- :func:`wrap_in_layout` builds the new wrapper with those buckets as its first ones
  (:func:`~ncclguard._torch_compat.ddp_initial_buckets`), and checks that it took them. Its reducer
  then runs as in the run without the fault: the same buckets, DDP's own arithmetic (the non-finite
  check's comm hook, :mod:`ncclguard.recovery._numerics.hook`, does the same, bit for bit).
  After its first backward it rebuilds them as any wrapper does (a broadcast in the next forward),
  in the order that backward's gradients became ready: the same order again.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import TorchCompatError

__all__ = [
    "Layout",
    "StepState",
    "bucket_layout",
    "drawn_generators",
    "generator_digests",
    "generators_to_send",
    "kept_layout",
    "layout_source",
    "load_scheduler",
    "restore_sent_generators",
    "share_layout",
    "wrap_in_layout",
]


@dataclass(frozen=True)
class StepState:
    """A module's buffers and the generator states, as they were.

    Attributes:
        buffers: copies of the module's buffers, in ``module.buffers()`` order.
        cpu_rng: torch's CPU generator state.
        cuda_rng: every CUDA device's generator state; empty where CUDA is not initialized.
        py_rng: Python's ``random`` state.
        np_rng: NumPy's legacy global generator state, or None without NumPy.
    """

    buffers: tuple[torch.Tensor, ...]
    cpu_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]
    py_rng: Any = None
    np_rng: Any = None

    @classmethod
    def take(cls, module: torch.nn.Module) -> StepState:
        """Copies ``module``'s buffers and the generator states now."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        buffers = tuple(b.detach().clone() for b in module.buffers())
        return cls(buffers, torch.get_rng_state(), cuda, random.getstate(), _numpy_state())

    def restore(self, module: torch.nn.Module) -> None:
        """Puts the buffers back into ``module`` (the same module, or one of the same structure)
        and the generators back as they were.

        Raises:
            ValueError: ``module`` has another number of buffers than the one taken.
        """
        with torch.no_grad():
            for live, kept in zip(module.buffers(), self.buffers, strict=True):
                live.copy_(kept)
        self.restore_generators()

    def restore_generators(self) -> None:
        """Puts every generator back as it was (the buffers are left alone)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
        if self.py_rng is not None:
            random.setstate(self.py_rng)
        if self.np_rng is not None:
            import numpy

            numpy.random.set_state(self.np_rng)


def generators_to_send(state: StepState) -> dict[str, Any]:
    """The generator states of ``state`` as tensors and JSON values (what a heal can carry).

    Args:
        state: a step's snapshot.

    Returns:
        A dict for :func:`restore_sent_generators`.
    """
    sent: dict[str, Any] = {"cpu": state.cpu_rng, "cuda": list(state.cuda_rng), "py": state.py_rng}
    if state.np_rng is not None:
        name, keys, pos, has_gauss, cached = state.np_rng
        sent["np"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return sent


def generator_digests(state: StepState) -> dict[str, str]:
    """A short digest of each generator of ``state``: ranks seeded alike state the same ones.

    Args:
        state: a step's snapshot.

    Returns:
        By generator name (``torch``, ``cuda``, ``random``, ``numpy``; those present), the first 16
        hex digits of the BLAKE2 hash of its state.
    """
    return _digests(state.cpu_rng, state.cuda_rng, state.py_rng, state.np_rng)


def drawn_generators(state: StepState) -> dict[str, str]:
    """:func:`generator_digests` of the generators drawn from since ``state`` was taken (their
    state now is another): those a redo draws from. A generator nobody draws from in a step (an
    unseeded ``random`` or NumPy, which differ in every process) is left out.

    Args:
        state: the step's snapshot, as the step found the generators.

    Returns:
        By generator name, the digest of its state in ``state``, for each one whose state moved.
    """
    cuda = tuple(torch.cuda.get_rng_state_all()) if state.cuda_rng and torch.cuda.is_initialized() else ()
    now = _digests(torch.get_rng_state(), cuda, random.getstate() if state.py_rng is not None else None, _numpy_state())
    return {k: v for k, v in generator_digests(state).items() if now.get(k) != v}


def _digests(cpu: torch.Tensor, cuda: tuple[torch.Tensor, ...], py: Any, np_rng: Any) -> dict[str, str]:
    def digest(*parts: bytes) -> str:
        h = hashlib.blake2b(digest_size=8)
        for part in parts:
            h.update(part)
        return h.hexdigest()

    out = {"torch": digest(cpu.numpy().tobytes())}
    if cuda:
        out["cuda"] = digest(*(t.numpy().tobytes() for t in cuda))
    if py is not None:
        version, internal, gauss = py
        out["random"] = digest(array.array("Q", internal).tobytes(), repr((version, gauss)).encode())
    if np_rng is not None:
        name, keys, pos, has_gauss, cached = np_rng
        out["numpy"] = digest(keys.tobytes(), repr((name, int(pos), int(has_gauss), float(cached))).encode())
    return out


def restore_sent_generators(sent: dict[str, Any]) -> None:
    """Sets every generator from what :func:`generators_to_send` made (on another process).

    Raises:
        ValueError, TypeError, KeyError: ``sent`` is not of that shape.
    """
    torch.set_rng_state(sent["cpu"])
    if sent.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(sent["cuda"]))
    py = sent.get("py")
    if py is not None:
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    np_state = sent.get("np")
    if np_state is not None:
        import numpy

        name, keys, pos, has_gauss, cached = np_state
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a core dependency
        return None
    return numpy.random.get_state()


def load_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """Loads an LR scheduler's state and puts the learning rates it was at back into its optimizer.

    A scheduler's ``load_state_dict`` restores its counters, not the optimizer's ``lr``; a scheduler
    made anew (the HF Trainer's, when its loop is entered again after a join) has just written the
    schedule's first rate there. A checkpoint resume loads the optimizer's state too, which carries
    the rates; a resume fed from memory keeps the optimizer as it is, so the rates are set here.

    Args:
        scheduler: a torch LR scheduler, or Accelerate's wrapper of one.
        state: what its ``state_dict()`` gave.
    """
    scheduler.load_state_dict(state)
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps one
    optimizer, rates = getattr(inner, "optimizer", None), getattr(inner, "_last_lr", None)
    if optimizer is None or not isinstance(rates, list) or len(rates) != len(optimizer.param_groups):
        return
    for group, lr in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = lr


# DDP's gradient buckets.

#: Gradient buckets in the order a reducer all-reduces them, each a list of indices into the
#: module's ``named_parameters()``, in the order of the bucket's buffer.
Layout = list[list[int]]


def bucket_layout(model: torch.nn.Module | None) -> Layout | None:
    """The gradient buckets of ``model`` as its reducer holds them now.

    Args:
        model: a ``DistributedDataParallel``; anything else has no buckets.

    Returns:
        The layout, or None (not a DDP wrapper, or a torch that does not show its buckets).
    """
    if not isinstance(model, DistributedDataParallel):
        return None
    index = {id(p): i for i, (_, p) in enumerate(model.module.named_parameters())}
    try:
        buckets = compat.ddp_bucket_parameters(model)
    except TorchCompatError as exc:
        log.warning("DDP's gradient buckets cannot be read (%s); a redone step may differ in the last bits", exc)
        return None
    return [[index[id(p)] for p in bucket] for bucket in buckets]


def kept_layout(model: torch.nn.Module | None, steps: int) -> Layout | None:
    """The layout a new wrapper should start from: the old wrapper's, read before it is dropped.

    A wrapper that ran one step and failed in the next before that step's forward has not rebuilt
    its buckets yet (the forward rebuilds them), and the order they would take is not shown: the
    layout read is the first one, and the step redone may then differ from a run without the fault
    in the last bits, which is logged here.

    Args:
        model: the old wrapper (anything else: None).
        steps: the steps it committed.
    """
    layout = bucket_layout(model)
    if layout is None or model is None or steps < 1:
        return layout
    try:
        rebuilt = compat.ddp_buckets_rebuilt(model)
    except TorchCompatError:
        return layout
    # With find_unused_parameters=True (and no static graph) DDP never rebuilds: its first layout is its last.
    rebuilds = not getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", False)
    if rebuilds and not rebuilt:
        log.warning(
            "DDP had not rebuilt its gradient buckets yet (the step failed before the forward that rebuilds them, "
            "after the wrapper's first step): the step is redone in DDP's first bucket layout, and its gradients "
            "may differ from a run without the fault in the last bits"
        )
    return layout


def layout_source(joined: Iterable[int]) -> int:
    """The rank whose buckets every rank's new wrapper takes after a rebuild: the lowest that did not
    join (a restarted rank's wrapper never stepped; it is also the rank that sends the heal).

    Args:
        joined: the ranks that joined in this rebuild (restarted processes).

    Returns:
        That rank; 0 where every rank joined.
    """
    fresh = set(joined)
    return next((r for r in range(dist.get_world_size()) if r not in fresh), 0)


def share_layout(layout: Layout | None, source: int, module: torch.nn.Module) -> Layout | None:
    """Every rank's copy of rank ``source``'s layout: one broadcast on the default group, which
    every rank of the world calls (the same ``source`` everywhere).

    Args:
        layout: this rank's reading (what ``source`` sends; ignored elsewhere).
        source: the rank whose layout every rank takes.
        module: the unwrapped module (the same architecture on every rank): its parameter count
            sizes the message, its first parameter's device carries it (as DDP's own broadcasts).

    Returns:
        ``source``'s layout, or None where it had none.
    """
    params = [p for _, p in module.named_parameters()]
    n = len(params)
    # [buckets, each bucket's length..., the indices...], -1 after: at most 1 + 2n values.
    message = torch.full((1 + 2 * n,), -1, dtype=torch.int64)
    if dist.get_rank() == source and layout is not None:
        flat = [len(layout), *(len(b) for b in layout), *itertools.chain.from_iterable(layout)]
        message[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
    device = params[0].device if params else torch.device("cpu")
    carried = message.to(device)
    dist.broadcast(carried, src=source)
    values = carried.cpu().tolist()
    count = values[0]
    if count < 0:
        return None
    lengths, rest = values[1 : 1 + count], values[1 + count :]
    out: Layout = []
    for length in lengths:
        out.append(rest[:length])
        rest = rest[length:]
    return out


def wrap_in_layout(
    module: torch.nn.Module,
    layout: Layout | None,
    build: Callable[[torch.nn.Module], DistributedDataParallel] = DistributedDataParallel,
) -> DistributedDataParallel:
    """``build(module)`` whose first backward reduces in ``layout``; every rank of the world calls
    it with the same layout (:func:`share_layout`).

    With no layout, or one that does not fit (other parameters), the wrapper keeps DDP's first
    layout; where that differs from ``layout`` it is logged: the step redone may then differ from
    a run without the fault in the last bits.

    Args:
        module: the unwrapped module.
        layout: the old wrapper's buckets, or None.
        build: what makes the wrapper (a framework's own, with its DDP arguments: Lightning's
            ``DDPStrategy._setup_model``); default ``DistributedDataParallel`` with torch's defaults.

    Returns:
        The new wrapper (its constructor broadcasts rank 0's parameters and buffers).
    """
    if layout is None:
        return build(module)
    params = [p for _, p in module.named_parameters()]
    if not all(0 <= i < len(params) for bucket in layout for i in bucket):
        _warn(layout, "other parameters")
        return build(module)
    try:
        with compat.ddp_initial_buckets([[params[i] for i in bucket] for bucket in layout]):
            model = build(module)
    except TorchCompatError as exc:
        log.warning("DDP cannot be given its gradient buckets (%s)", exc)
        model = build(module)
    got = bucket_layout(model)
    if got != layout:
        _warn(layout, "?" if got is None else f"{len(got)} buckets")
    return model


def _warn(layout: Layout, got: str) -> None:
    log.warning(
        "the new DDP wrapper did not take the gradient buckets of the one before the rebuild (%d buckets; it has "
        "%s): the step redone may differ from a run without the fault in the last bits",
        len(layout),
        got,
    )
