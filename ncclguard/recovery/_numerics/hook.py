"""The check of each gradient bucket's values before DDP all-reduces it: a DDP comm hook.

:meth:`GradCheck.install` registers :func:`checked_allreduce` on a ``DistributedDataParallel`` that
ncclguard built itself (the recovery engine's own wrapper: a wrapper of yours keeps its hook slot).
For each bucket the hook queues one scan of the bucket's input (:func:`~ncclguard.collectives.finite.extremes`:
its least and greatest value, left on the device, no host sync) and remembers the bucket's index
and parameters; then it reduces the bucket as DDP's own path does. :meth:`GradCheck.said` reads the
scans at the commit (on a GPU the one sync there, where the commit syncs already) and names the
flagged buckets and their parameters.

DDP's own path, which a registered hook replaces, multiplies each gradient by ``1 / world size``
while it copies it into the bucket (``reducer.cpp``, ``mark_variable_ready_dense``; a sparse
gradient is divided), then sums the bucket with one ``allreduce`` on the wrapper's group. The hook
does the same to the bucket, in the same order, so a run with it is bit-equal to one without it
(unlike torch's ``allreduce_hook``, which divides after the copy). That holds for DDP's defaults
(``gradient_as_bucket_view=False``), which are what the engine builds; a framework's wrapper
(Accelerate's, the HF Trainer's, Lightning's) is checked only where :func:`refusal` finds none of the
settings under which DDP divides in place instead, and its one hook slot free.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard._log import log
from ncclguard.collectives.finite import extremes, kind_of, unchecked_reason
from ncclguard.recovery._numerics.findings import NumericsSaid, bucket_finding, numerics_said

__all__ = ["GradCheck", "checked_allreduce", "comm_hook_of", "refusal"]


@dataclass
class _Wire:
    """The hook's state: the check it notes into and the wrapper whose group reduces the buckets."""

    check: GradCheck
    model: weakref.ref[torch.nn.Module]


def _first(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


def checked_allreduce(state: _Wire, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: notes the bucket's scan, then reduces it as DDP's own path does.

    Args:
        state: the check and the wrapper (given at registration).
        bucket: the bucket DDP hands over.

    Returns:
        The future of the reduced bucket.
    """
    buffer = bucket.buffer()
    state.check.note(bucket.index(), buffer, bucket.parameters())
    model = state.model()
    group: Any = model.process_group if model is not None else dist.group.WORLD
    size = group.size()
    # DDP's own arithmetic (reducer.cpp): a multiply by the reciprocal for a dense bucket, a divide
    # for a sparse one; anything else would differ from a run without the hook in the last bit.
    if buffer.layout is torch.strided:
        buffer.mul_(1.0 / size)
    else:
        buffer.div_(size)
    return group.allreduce([buffer]).get_future().then(_first)


# DDP checks a hook's annotations as objects; this module's are strings (PEP 563).
checked_allreduce.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def comm_hook_of(model: torch.nn.Module) -> str | None:
    """The comm hook a ``DistributedDataParallel`` carries, by name (DDP takes one), or None.

    Read from DDP's own bookkeeping (torch 2.13): a Python hook in ``_comm_hooks`` (``register_comm_hook``,
    DDP's ``mixed_precision``), a built-in one in the wrapper's logging data.

    Raises:
        AttributeError: this torch keeps neither.
    """
    hooks, logged = getattr(model, "_comm_hooks", None), getattr(model, "_get_ddp_logging_data", None)
    if not isinstance(hooks, list) or not callable(logged):
        raise AttributeError("DistributedDataParallel._comm_hooks")
    name = getattr(hooks[0][0], "__qualname__", "a hook") if hooks else logged().get("comm_hook")
    return str(name) if name else None


def refusal(model: torch.nn.Module) -> str | None:
    """Why the hook cannot go on a framework's wrapper, or None when it can and stays bit-equal.

    DDP divides a gradient in place (``div_``) where ``gradient_as_bucket_view=True`` finds it in its
    bucket already, and with ``batched_grad_copy=True`` (one flat ``div_`` per bucket); the hook's
    multiply by ``1 / world size`` would differ there in the last bit on a world whose size is not a
    power of two.
    """
    if not isinstance(model, DistributedDataParallel):
        return f"it is a {type(model).__name__}, not a DistributedDataParallel"
    try:
        hook = comm_hook_of(model)
    except AttributeError:
        return f"torch {torch.__version__} does not say whether the wrapper carries a comm hook"
    if hook is not None:
        return f"the wrapper carries a comm hook already ({hook}): DDP takes one, and it stays"
    for setting in ("gradient_as_bucket_view", "batched_grad_copy"):
        if getattr(model, setting, False):
            return f"{setting}=True: DDP divides in place there, which the check could not match bit for bit"
    return None


class GradCheck:
    """This rank's bucket scans of one attempt of a step, filled by the hook, read at the commit.

    Attributes:
        installed: a wrapper carries the hook (set by :meth:`install`).
    """

    def __init__(self) -> None:
        self.installed = False
        self._pending: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
        self._passed = 0
        self._names: dict[int, str] = {}
        self._reasons_said: set[str] = set()
        self._on: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # the wrappers that carry the hook
        self.hooked: dict[int, weakref.ref[torch.Tensor]] = {}  # the parameters with a hook of their own (param_check)

    def install(self, model: torch.nn.Module, module: torch.nn.Module) -> None:
        """Registers the hook on ``model`` (a ``DistributedDataParallel`` of ``module`` with no hook
        yet: one ncclguard built), before its first backward.

        Args:
            model: the wrapper.
            module: the module it wraps, whose parameter names the findings give.

        Raises:
            RuntimeError: from DDP, when the wrapper has a hook already or ran a backward.
        """
        self._names = {id(p): name for name, p in module.named_parameters()}
        model.register_comm_hook(_Wire(self, weakref.ref(model)), checked_allreduce)  # type: ignore[operator]
        self._on.add(model)
        self.installed = True

    def watch(self, model: torch.nn.Module, names: dict[int, str]) -> None:
        """Takes ``model`` as checked by another path than DDP's hook (FSDP2's reduce-scatter,
        :mod:`ncclguard.recovery._numerics.fsdp2_check`), its parameters named by ``names`` (by ``id``)."""
        self._names = dict(names)
        self._on.add(model)
        self.installed = True

    def carries(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` carries this check's hook (a wrapper re-pointed in place keeps it)."""
        return model in self._on

    def clear(self) -> None:
        """Forgets the scans noted so far (a new attempt starts)."""
        self._pending.clear()
        self._passed = 0

    def note(self, index: int, buffer: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Queues the scan of one bucket's input (from the hook, before the bucket is changed).

        Args:
            index: the bucket's index.
            buffer: its flattened gradients, as this rank contributes them.
            params: its parameters, in its order.
        """
        why = unchecked_reason(buffer)
        if why is None:
            self._pending.append((index, extremes(buffer), params))
            return
        self._passed += 1
        if why not in self._reasons_said:  # once per kind of reason: a model says it every step
            self._reasons_said.add(why)
            log.info("non-finite check: gradient bucket %d passed through unchecked: %s", index, why)

    def said(self) -> NumericsSaid:
        """What this rank states at the commit: the scans read (one host sync on a GPU) and the
        flagged buckets named.

        Returns:
            The statement's :class:`~ncclguard.recovery._numerics.findings.NumericsSaid`.
        """
        pending = self._pending
        if not pending:
            return NumericsSaid(checked=0, passed=self._passed)
        values = torch.stack([pair for _, pair, _ in pending]).cpu().tolist()
        flagged, seen = [], set()
        for (index, _, params), pair in zip(pending, values, strict=True):
            kind = kind_of(pair)
            if kind is not None and index not in seen:  # a bucket reduced twice in one attempt: named once
                seen.add(index)
                flagged.append(bucket_finding(index, kind, [self._names.get(id(p), "?") for p in params]))
        return numerics_said(len({i for i, _, _ in pending}), self._passed, flagged)
