"""After a rebuild: point a DDP wrapper and a data loader's sharding at the new world.

What a framework built on the old world keeps: its ``DistributedDataParallel`` wrapper holds the
old (abandoned) process group, and its sampler holds the old rank and world size. The HF Trainer
and Accelerate integrations call these after :func:`~ncclguard.recovery.rebuild.rebuild_world`;
so can a hand-written loop.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard import _torch_compat as compat
from ncclguard._log import log

__all__ = ["repoint_ddp", "repoint_sampler", "rewrapped_ddp", "unwrapped"]


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``DistributedDataParallel`` wraps (``model`` itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def repoint_ddp(model: torch.nn.Module) -> bool:
    """Points ``model`` (a ``DistributedDataParallel``) at the current default group, in place.

    The wrapper stays the same object, so every reference a framework holds to it (the HF
    Trainer's loop variable, ``trainer.model_wrapped``, ``accelerator._models``) follows. Its
    reducer is reset, so a step whose backward failed half way can be run again, and its buckets
    are rebuilt on the new group at the next backward (a collective every member makes).

    Args:
        model: the wrapper; anything else is left alone.

    Returns:
        True when it was re-pointed; False when it is not a DDP wrapper or already on the group.

    Raises:
        TorchCompatError: this torch has no ``DistributedDataParallel._update_process_group``.
    """
    if not isinstance(model, DistributedDataParallel) or not dist.is_initialized():
        return False
    group = compat.default_group()
    if model.process_group is group:
        return False
    compat.ddp_update_process_group(model, group)
    return True


def rewrapped_ddp(model: DistributedDataParallel) -> DistributedDataParallel:
    """A new ``DistributedDataParallel`` of ``model``'s module on the current default group, with
    ``model``'s settings.

    After a rebuild that admitted restarted ranks, every rank of the new world wraps its module
    again: a wrapper re-pointed in place keeps the gradient buckets it rebuilt after its first step,
    where a restarted rank's wrapper has the initial ones, and DDP reduces bucket by bucket. New
    wrappers start from the same layout everywhere (the constructor's, from the parameters' order,
    or the one given with :func:`~ncclguard.recovery._step.state.wrap_in_layout`).

    A bucket size left to DDP's default stays the default: DDP then rebuilds its buckets with a
    first one of 1 MiB, where an explicit 25 MiB would make every bucket 25 MiB, and the buckets
    after the redo would differ from the run without the fault (torch 2.13,
    ``_BucketCapacityConfig.create``: ``is_using_default = bucket_cap_mb is None``).

    Args:
        model: the old wrapper (on the abandoned group, or on a restarted rank's stand-in).

    Returns:
        The new wrapper (its constructor broadcasts rank 0's parameters and buffers).
    """
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    kwargs: dict[str, Any] = {
        "device_ids": model.device_ids,
        "output_device": model.output_device,
        "find_unused_parameters": model.find_unused_parameters,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "static_graph": model.static_graph,
    }
    if not getattr(model, "bucket_bytes_cap_default", False):
        kwargs["bucket_cap_mb"] = model.bucket_bytes_cap / (1024 * 1024)
    caps = getattr(model, "bucket_bytes_cap_list", None)
    if caps and "bucket_cap_mb_list" in accepted:
        kwargs["bucket_cap_mb_list"] = [cap / (1024 * 1024) for cap in caps]
    for name in ("batched_grad_copy", "mixed_precision", "skip_all_reduce_unused_params"):
        if name in accepted and hasattr(model, name):
            kwargs[name] = getattr(model, name)
    # torch 2.13 renamed broadcast_buffers (a FutureWarning); False keeps the old meaning (no sync at
    # init either), which only the old name says.
    sync = model.broadcast_buffers
    if sync and "forward_sync_buffers" in accepted:
        kwargs["forward_sync_buffers"] = True
    else:
        kwargs["broadcast_buffers"] = sync
    return DistributedDataParallel(model.module, **kwargs)


def repoint_sampler(loader: Any, rank: int, size: int) -> list[str]:
    """Re-shards ``loader`` for ``rank`` of ``size``: takes effect at its next ``iter()``.

    Handles what shards the data loaders of the frameworks ncclguard integrates: torch's
    ``DistributedSampler`` (``num_replicas``, ``rank``, and the per-rank length it derives from
    them) and Accelerate's ``BatchSamplerShard`` (``num_processes``, ``process_index``). Call it
    between epochs: both read these attributes while they iterate, so a change inside an epoch
    would repeat or skip batches of that epoch.

    Args:
        loader: a ``DataLoader`` (or Accelerate's ``DataLoaderShard``).
        rank: this rank in the new world.
        size: the new world's size.

    Returns:
        What was re-pointed, in words (empty when the loader shards nothing ncclguard knows).
    """
    done: list[str] = []
    seen: set[int] = set()
    for obj in _samplers(loader):
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.utils.data.distributed.DistributedSampler):
            before = (obj.rank, obj.num_replicas)
            obj.rank, obj.num_replicas = rank, size
            # As DistributedSampler.__init__ derives them from the dataset's length.
            n = len(obj.dataset)  # type: ignore[arg-type]
            if obj.drop_last and n % size != 0:
                obj.num_samples = math.ceil((n - size) / size)
            else:
                obj.num_samples = math.ceil(n / size)
            obj.total_size = obj.num_samples * size
            done.append(f"DistributedSampler rank/num_replicas {before} -> {(rank, size)}")
        elif hasattr(obj, "num_processes") and hasattr(obj, "process_index") and hasattr(obj, "batch_sampler"):
            before = (obj.process_index, obj.num_processes)
            obj.process_index, obj.num_processes = rank, size
            done.append(f"{type(obj).__name__} process_index/num_processes {before} -> {(rank, size)}")
    if done:
        log.info("repoint_sampler: %s", "; ".join(done))
    return done


def _samplers(loader: Any) -> list[Any]:
    """The sampler objects a loader shards with: its sampler, its batch sampler, and theirs."""
    found: list[Any] = []
    for name in ("sampler", "batch_sampler"):
        obj = getattr(loader, name, None)
        for _ in range(3):  # a batch sampler wraps a batch sampler wraps a sampler, at most
            if obj is None:
                break
            found.append(obj)
            obj = getattr(obj, "batch_sampler", None) or getattr(obj, "sampler", None)
    return found
