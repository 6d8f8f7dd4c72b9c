"""Timing several cases side by side on every rank, for the diagnosis scripts in this folder.

Every iteration runs each case once, in a rotating order, after a barrier, so noise from other
jobs lands on all cases alike; an iteration's time is the slowest rank's (nccl-tests'
convention, :func:`ncclguard.bench.formulas.slowest_per_iteration`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def p50_of_slowest(cases: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict[str, float] | None:
    """Runs ``cases`` interleaved for ``warmup + iters`` rounds on every rank.

    Returns:
        On rank 0, the median over iterations of the slowest rank's time, in seconds, by case
        name (in the order of ``cases``); None on the other ranks.
    """
    import torch
    import torch.distributed as dist

    from ncclguard.bench.formulas import slowest_per_iteration

    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    token = torch.zeros(1)
    for it in range(iters + warmup):
        for k in range(len(names)):
            name = names[(it + k) % len(names)]
            dist.all_reduce(token)
            start = time.perf_counter()
            cases[name]()
            if it >= warmup:
                times[name].append(time.perf_counter() - start)
    mine = torch.tensor([times[n] for n in names], dtype=torch.float64)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    if dist.get_rank() != 0:
        return None
    return {n: statistics.median(slowest_per_iteration([p[i].tolist() for p in parts])) for i, n in enumerate(names)}
