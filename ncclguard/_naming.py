"""How ncclguard names things in records, errors and reports: ops, dtypes, rank sets, this host.

One place, so that a fingerprint, a flight record and a report spell a dtype or a rank set alike.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HOSTNAME", "REDUCE_OP_NAMES", "address_toward", "dtype_name", "node_address", "node_name", "rank_ranges"]

HOSTNAME: str = socket.gethostname()


@functools.lru_cache(maxsize=16)
def address_toward(peer: str) -> str | None:
    """This host's source address toward ``peer`` (an address or hostname), or None.

    A UDP socket's ``connect`` only asks the kernel for the route: no packet is sent. Two hosts that
    share a hostname (containers, namespaces, ``localhost`` images) still differ here.
    """
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM):
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
    except OSError:
        return None
    return None


def node_address() -> str | None:
    """This host's address toward the job's master (``MASTER_ADDR``), or None without one."""
    master = os.environ.get("MASTER_ADDR", "").strip().strip("[]")
    return address_toward(master) if master else None


def node_name(host: str, address: str | None) -> str:
    """How reports name a host: ``node7``, or ``node7 (10.0.0.7)`` when its address is known."""
    return f"{host} ({address})" if address else host


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
