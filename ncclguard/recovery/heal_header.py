"""What a heal's source announces before any tensor moves (:class:`Header`: every tensor's name,
dtype and shape, the optimizer's state as tagged JSON), and the receiver's check of it against its
own module and optimizer (:func:`check_header`), made before any byte is applied.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ncclguard.recovery.state_json import from_json, to_json

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Header",
    "TensorEntry",
    "check_header",
    "dtype_of",
    "make_header",
    "module_tensors",
    "nbytes",
]

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # NOTES.md: on gloo, chunks much smaller than this cost per call


class TensorEntry(BaseModel):
    """One tensor of the transfer: where it goes, and what it must look like."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(max_length=4096)
    dtype: str = Field(max_length=64)
    shape: list[int] = Field(max_length=64)


class Header(BaseModel):
    """What the source announces before any tensor moves.

    Attributes:
        tensors: the manifest, module tensors first (``module_tensors`` of them), then the
            optimizer's, in the order their bytes are sent.
        optimizer: the optimizer's ``state_dict`` as tagged JSON (:func:`to_json`), or None.
        extra: what the framework's adapter sends besides (a trainer's state, a scheduler's, the
            generators), as tagged JSON whose tensors follow the optimizer's, or None.
        step: the step the receivers should run next (the one the others redo), or None.
        error: why the source sends nothing (every rank then stops), or None.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    tensors: list[TensorEntry] = Field(default_factory=list)
    module_tensors: int = Field(default=0, ge=0)
    optimizer: Any = None
    extra: Any = None
    step: int | None = None
    chunk_bytes: int = Field(default=DEFAULT_CHUNK_BYTES, ge=1)
    error: str | None = Field(default=None, max_length=4096)


def dtype_of(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return found


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*(("p:" + n, p) for n, p in module.named_parameters()), *(("b:" + n, b) for n, b in module.named_buffers())]


def _entry(name: str, t: torch.Tensor) -> TensorEntry:
    return TensorEntry(name=name, dtype=str(t.dtype), shape=list(t.shape))


def nbytes(e: TensorEntry) -> int:
    return math.prod(e.shape) * dtype_of(e.dtype).itemsize


def make_header(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None, chunk: int, extra: Any = None
) -> tuple[Header, list[torch.Tensor]]:
    named = module_tensors(module)
    sent = [t.detach() for _, t in named]
    opt_tensors: list[torch.Tensor] = []
    opt_json = to_json(optimizer.state_dict(), opt_tensors, "state_dict") if optimizer is not None else None
    extra_json = to_json(extra, opt_tensors, "extra") if extra is not None else None  # its tensors follow
    entries = [_entry(n, t) for n, t in named] + [_entry(f"o:{i}", t) for i, t in enumerate(opt_tensors)]
    header = Header(
        tensors=entries, module_tensors=len(named), optimizer=opt_json, extra=extra_json, step=step, chunk_bytes=chunk
    )
    return header, sent + [t.detach() for t in opt_tensors]


def check_header(
    header: Header, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, limit: int
) -> str | None:
    """Why this receiver refuses ``header`` (None: it accepts)."""
    if header.error is not None:
        return None  # every rank stops on the source's error anyway
    own = module_tensors(module)
    if header.module_tensors != len(own):
        return f"the source sends {header.module_tensors} module tensors, this module has {len(own)}"
    for (name, t), e in zip(own, header.tensors, strict=False):
        if (e.name, e.dtype, e.shape) != (name, str(t.dtype), list(t.shape)):
            return f"{e.name} {e.dtype}{e.shape} does not match this module's {name} {t.dtype}{list(t.shape)}"
    try:
        total = sum(nbytes(e) for e in header.tensors)
    except ValueError as exc:
        return str(exc)
    if total > limit:
        return f"the source would send {total} bytes, over this receiver's bound of {limit} (max_bytes=)"
    if (header.optimizer is None) != (optimizer is None):
        return "the source and this rank disagree on whether there is an optimizer to heal"
    if optimizer is not None:
        try:
            groups = from_json(header.optimizer, [torch.empty(0)] * len(header.tensors))["param_groups"]
            theirs = [len(g["params"]) for g in groups]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return f"the optimizer's state cannot be read ({exc})"
        mine = [len(g["params"]) for g in optimizer.param_groups]
        if theirs != mine:
            return f"the source's optimizer has parameter groups of sizes {theirs}, this one {mine}"
    return None
