"""The state codec: an optimizer's, scheduler's or generator's state as tagged JSON beside its
tensors, never a pickle (what a peer sends or a snapshot holds is read back by :func:`from_json`
alone). Used by the heal, the snapshots and the adapters' own states.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ncclguard.errors import HealFailed

__all__ = ["from_json", "to_json"]


def to_json(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    """``value`` as tagged JSON, its tensors appended to ``tensors`` and named by their index.

    Args:
        value: an optimizer's, scheduler's or generator's state: tensors and JSON values, nested.
        tensors: where its tensors go (sent or packed beside the JSON).
        path: where ``value`` sits, for the error.

    Returns:
        JSON: ``{"t": i}`` a tensor, ``{"f": "nan"}`` a float JSON cannot hold, ``{"l"|"u": [...]}``
        a list or tuple, ``{"d": [[key, value], ...]}`` a dict (its int keys kept).

    Raises:
        HealFailed: a value of another type, or a dict key that is not str or int.
    """
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, list | tuple):
        items = [to_json(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"u" if isinstance(value, tuple) else "l": items}
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
            raise HealFailed(f"the optimizer's state at {path} has keys that are not str or int; heal cannot send it")
        return {"d": [[k, to_json(v, tensors, f"{path}[{k!r}]")] for k, v in value.items()]}
    raise HealFailed(
        f"the optimizer's state at {path} is a {type(value).__name__}; heal sends tensors and JSON values "
        "(None, bool, int, float, str, lists, tuples, dicts) only, never pickles"
    )


def from_json(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The value :func:`to_json` wrote, its tensors taken from ``tensors``.

    Raises:
        ValueError: an untagged object or an unknown tag (a value no ncclguard wrote).
        IndexError: a tensor index outside ``tensors``.
    """
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError(f"an untagged object in the optimizer's state: {sorted(value)[:5]}")
    ((tag, body),) = value.items()
    if tag == "t":
        return tensors[int(body)]
    if tag == "f":
        return float(body)
    if tag in ("l", "u"):
        items = [from_json(v, tensors) for v in body]
        return tuple(items) if tag == "u" else items
    if tag == "d":
        return {k: from_json(v, tensors) for k, v in body}
    raise ValueError(f"unknown tag {tag!r} in the optimizer's state")
