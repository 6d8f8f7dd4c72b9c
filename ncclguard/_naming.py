"""How ncclguard names things in records, errors and reports: ops, dtypes, rank sets, this host.

One place, so that a fingerprint, a flight record and a report spell a dtype or a rank set alike.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HOSTNAME", "REDUCE_OP_NAMES", "dtype_name", "rank_ranges"]

HOSTNAME: str = socket.gethostname()

REDUCE_OP_NAMES: dict[Any, str] = {
    dist.ReduceOp.SUM: "SUM",
    dist.ReduceOp.AVG: "AVG",
    dist.ReduceOp.PRODUCT: "PRODUCT",
    dist.ReduceOp.MIN: "MIN",
    dist.ReduceOp.MAX: "MAX",
    dist.ReduceOp.BAND: "BAND",
    dist.ReduceOp.BOR: "BOR",
    dist.ReduceOp.BXOR: "BXOR",
}

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (cached: it is called on the collective's path)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 3, 5, 6, 7]`` -> ``"0-1,3,5-7"``; duplicates and order do not matter."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
