"""An exact digest of a tensor's bytes, computed where the tensor lives (no host copy), that any
single flipped bit changes; and the digests of a model's replicated state (pure, no communication).

The tensor's bytes are read as signed integer words of its element's width (``uint8`` for 1-byte
elements, ``int16``, ``int32``, ``int64``), multiplied by odd position weights (``2i + 1`` within a
chunk of :data:`CHUNK` words) and summed exactly: words of up to 4 bytes in ``int32``, 8-byte words in
``int64``, each sum wrapping modulo its width (on the CPU one dot product, which reads the words once:
about 1 ms per million parameters here; on a GPU the products are summed in ``int64``). The chunks' sums, then the
tensors' digests, are folded with an odd multiplier (``h = h * FOLD + s`` modulo 2**64).

Why one flipped bit always shows: a bit flip changes one word by ``±2**k`` (``k`` below the word's
width); times an odd weight that is still not 0 modulo the width (nor modulo 2**64), and a fold by an
odd number is invertible modulo 2**64. Integer sums do not depend on the order of the additions, so
every rank's digest of equal bytes is equal whatever the device's reduction order. Position weights
also tell apart two words swapped. Two different tensors can collide (as in any 64-bit checksum);
a drift of one bit, or of a few, is what a replica check looks for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CHUNK", "FOLD", "digest_hex", "optimizer_tensors", "replica_digests", "tensor_digest"]

CHUNK = 1 << 20  # words per weighted chunk (the weights are cached per device, 4 or 8 MiB)
FOLD = 0x100000001B3  # an odd multiplier (FNV-1's 64-bit prime): folding is invertible modulo 2**64
_MASK = (1 << 64) - 1
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.arange(CHUNK, device=device, dtype=dtype) * 2 + 1
    return w


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of signed words (its element's width; 16-byte elements
    as two ``int64`` words each)."""
    flat = t.detach().reshape(-1)  # a copy only for a non-contiguous tensor
    size = flat.element_size()
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if size in _WORDS:
        return flat.view(_WORDS[size])
    return flat.view(torch.uint8).view(torch.int64) if size % 8 == 0 else flat.view(torch.uint8)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The digest of ``t``'s bytes (see the module doc), as a 0-d ``int64`` tensor on ``t``'s device:
    nothing is read on the host, so on a GPU it runs without a synchronisation.

    Args:
        t: any dense tensor (any dtype, any layout of strides; an empty one digests to 0).

    Returns:
        A 0-d ``int64`` tensor.
    """
    words = _words(t)
    wide = words.element_size() == 8
    work = torch.int64 if wide else torch.int32
    weights = _weights(words.device, work)
    h = torch.zeros((), dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), CHUNK):
        part = words[lo : lo + CHUNK]
        if part.dtype != work:
            part = part.to(work)
        w = weights[: part.numel()]
        # On the CPU a dot product (exact, wrapping in the word's width) reads the words once; elsewhere
        # the products are summed in int64. Either way the result depends on the bytes alone.
        s = torch.dot(part, w) if part.device.type == "cpu" else (part * w).sum(dtype=torch.int64)
        h = h * FOLD + s.to(torch.int64)
    return h


def _fold(tensors: Iterable[torch.Tensor]) -> int | None:
    """The tensors' digests folded in order, read on the host once per device; None: no tensor."""
    by_device: dict[torch.device, torch.Tensor] = {}
    count = 0
    for t in tensors:
        h = by_device.get(t.device)
        d = tensor_digest(t)
        by_device[t.device] = d if h is None else h * FOLD + d
        count += 1
    if not count:
        return None
    total = 0
    for device in sorted(by_device, key=str):
        total = (total * FOLD + int(by_device[device].item())) & _MASK
    return total ^ count  # the count: an empty tensor added or lost shows too


def digest_hex(value: int) -> str:
    """A digest as 16 hex digits."""
    return f"{value & _MASK:016x}"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (Adam's moments, its step count), in its parameters' order and
    by key within each: the same order on every replica."""
    found: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                    found.append(value)
    return found


def replica_digests(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, str]:
    """What a rank states of its replica: a digest of its parameters and one of its optimizer's
    state, each as 16 hex digits (a part with no tensor is left out). Buffers are not digested:
    they may differ between healthy replicas (DDP's ``broadcast_buffers=False``).

    Args:
        module: the unwrapped module.
        optimizer: its optimizer, or None.

    Returns:
        ``{"parameters": ..., "optimizer": ...}``.
    """
    said: dict[str, str] = {}
    with torch.no_grad():
        params = _fold(p for p in module.parameters() if p.layout == torch.strided)
        state = _fold(optimizer_tensors(optimizer)) if optimizer is not None else None
    if params is not None:
        said["parameters"] = digest_hex(params)
    if state is not None:
        said["optimizer"] = digest_hex(state)
    return said
