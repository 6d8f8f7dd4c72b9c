"""Where each rank's snapshot is replicated: its buddy, on another host where there is one.

A host lost whole takes every snapshot its ranks held, their own and the replicas they kept for
others. So a rank's replica goes to a rank of the *next* host (hosts in the order their first rank
appears), at the same place among that host's ranks; with one host, to the next rank. Every rank
computes the same placement from the same list of host names, gathered once per world.
"""

from __future__ import annotations

import os
import zlib

from ncclguard._naming import HOSTNAME

__all__ = ["buddies", "host_key", "host_number", "sources"]


def host_key() -> str:
    """This process's host, as the launcher placed it: torchrun's node rank (``GROUP_RANK``) with
    the hostname, so that two hosts that share a hostname (containers, a default /etc/hosts) are
    still told apart, and two node ranks on one machine (a test's simulated hosts) are too."""
    return f"{HOSTNAME}/{os.environ.get('GROUP_RANK', '0')}"


def host_number(key: str) -> int:
    """A host key as a non-negative int that fits a tensor of int64 (gathered with one collective)."""
    return zlib.crc32(key.encode())


def buddies(hosts: list[int]) -> list[int]:
    """The rank that holds each rank's replica.

    Args:
        hosts: each rank's host (any ints; equal ints, one host).

    Returns:
        ``buddy[r]`` for every rank ``r``; ``-1`` for a world of one (nowhere to put it). With one
        host, ``r + 1`` (cyclic); otherwise the rank at ``r``'s place among its host's ranks on the
        next host (cyclic over that host's ranks when it has fewer).
    """
    n = len(hosts)
    if n < 2:
        return [-1] * n
    order: list[int] = []
    ranks_of: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        if h not in ranks_of:
            order.append(h)
            ranks_of[h] = []
        ranks_of[h].append(r)
    if len(order) == 1:
        return [(r + 1) % n for r in range(n)]
    out = []
    for r, h in enumerate(hosts):
        here = ranks_of[h]
        there = ranks_of[order[(order.index(h) + 1) % len(order)]]
        out.append(there[here.index(r) % len(there)])
    return out


def sources(buddy: list[int], rank: int) -> list[int]:
    """The ranks whose replicas ``rank`` holds (sorted)."""
    return [r for r, b in enumerate(buddy) if b == rank]
