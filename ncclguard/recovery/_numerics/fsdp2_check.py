"""The check of FSDP2's gradients before they are reduced: each FSDP module's reduce-scatter.

FSDP2 has no comm hook as DDP does; it takes a custom reduce-scatter per module
(``FSDPModule.set_custom_reduce_scatter``, torch 2.13). :func:`install` gives every FSDP module that
holds parameters a :class:`CheckedReduceScatter`: it queues one scan of the module's flat
reduce-scatter input (this rank's gradients, after FSDP2's pre-division, before the reduction) into
the same :class:`~ncclguard.recovery._numerics.hook.GradCheck` DDP's hook fills, then makes torch's
own call (``DefaultReduceScatter``'s: ``dist.reduce_scatter_single`` into a buffer from
``torch.empty``), so the result is bit-equal to FSDP2's own path. A module is a "bucket": its index
counts the FSDP modules that hold parameters, in module order; its parameters are those it shards
itself (not a nested FSDP module's).

On a GPU the scan runs on FSDP2's reduce-scatter stream, before the reduction; the commit reads it
after the backward, once FSDP2 has made the default stream wait for that stream. Not run on a GPU
yet: ``on_nonfinite="auto"`` leaves FSDP2 unchecked (docs/numerics.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery._numerics.hook import GradCheck

__all__ = ["CheckedReduceScatter", "install"]


class CheckedReduceScatter:
    """One FSDP module's reduce-scatter, its input scanned first (FSDP2's ``ReduceScatter`` protocol:
    ``allocate`` and a call)."""

    def __init__(self, check: GradCheck, index: int, params: list[torch.Tensor]) -> None:
        self.check, self.index, self.params = check, index, params

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for FSDP2's reduce-scatter, as its default allocates one."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        """Notes the scan of ``input_tensor``, then reduces it as FSDP2's default does."""
        self.check.note(self.index, input_tensor, self.params)
        return dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


def install(check: GradCheck, model: torch.nn.Module) -> int:
    """Puts the check on every FSDP module of ``model`` that holds parameters of its own.

    Args:
        check: the engine's check (its findings named from ``model``'s parameter names).
        model: the module after ``fully_shard`` (FSDP2), the root included.

    Returns:
        How many modules carry it (0: none holds parameters; nothing is checked).
    """
    from torch.distributed.fsdp import FSDPModule

    index = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        inner = {
            id(p)
            for sub in module.modules()
            if sub is not module and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        own = [p for p in module.parameters() if id(p) not in inner]
        if own:
            module.set_custom_reduce_scatter(CheckedReduceScatter(check, index, own))  # type: ignore[arg-type]
            index += 1
    if index:
        check.watch(model, {id(p): name for name, p in model.named_parameters()})
    return index
