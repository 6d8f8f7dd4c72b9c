"""nccl-tests' formulas for all_reduce, stated once.

- An iteration's time is the slowest rank's time for it (a collective is done when the last
  rank is done).
- time = mean over the timed iterations; min, p50 and max over the same iterations.
- algbw = bytes / time, in decimal GB/s (1 GB/s = 1e9 B/s).
- busbw = algbw x 2(n-1)/n for all_reduce on n ranks: the bytes each rank's link carries in a
  ring all_reduce, so busbw is comparable across rank counts and with the hardware's peak
  (nccl-tests, doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["FORMULAS", "TimeStats", "slowest_per_iteration", "summarize", "algbw_gbps", "busbw_factor", "busbw_gbps"]

FORMULAS: dict[str, str] = {
    "iteration time": "the slowest rank's time for that iteration (perf_counter around one call, after a barrier)",
    "time": "mean of the iteration times; min, p50, max over the same iterations",
    "algbw": "size in bytes / time, in GB/s (1e9 B/s)",
    "busbw": "algbw x 2(n-1)/n, n = ranks (all_reduce, as nccl-tests)",
    "x plain": "the mode's time / plain's time at the same size (mean: of the means; p50: of the medians)",
    "+peak": "extra peak memory of one call of the mode over one plain call (CUDA allocator peak, or host RSS high-water mark; memory kept from earlier calls is not in it)",
    "kept": "memory in use after one call of the mode over before it, ncclguard's buffers released first (CUDA allocated, or host RSS)",
    "#wrong": "elements that differ from the exact result, summed over ranks (--check, integer-valued data)",
}


@dataclass(frozen=True)
class TimeStats:
    """Iteration times of one size and mode, in microseconds."""

    mean_us: float
    min_us: float
    p50_us: float
    max_us: float

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


def slowest_per_iteration(rank_times_s: Sequence[Sequence[float]]) -> list[float]:
    """Each iteration's time: the maximum over ranks. ``rank_times_s[rank][iteration]`` in seconds.

    Raises:
        ValueError: no ranks, or ranks with different iteration counts.
    """
    if not rank_times_s:
        raise ValueError("no rank times to combine")
    lengths = {len(t) for t in rank_times_s}
    if len(lengths) != 1:
        raise ValueError(f"every rank must report the same number of iterations, got {sorted(lengths)}")
    return [float(t) for t in np.asarray(rank_times_s, dtype=np.float64).max(axis=0)]


def summarize(times_s: Sequence[float]) -> TimeStats:
    """Mean, min, median and max of ``times_s`` (seconds), in microseconds.

    Raises:
        ValueError: no times.
    """
    if not times_s:
        raise ValueError("no iteration times to summarize")
    us = np.asarray(times_s, dtype=np.float64) * 1e6
    return TimeStats(float(us.mean()), float(us.min()), float(np.median(us)), float(us.max()))


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth: ``nbytes / seconds`` in decimal GB/s."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds / 1e9


def busbw_factor(world_size: int) -> float:
    """all_reduce's bus bandwidth factor ``2(n-1)/n``."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size


def busbw_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all_reduce of ``nbytes`` that took ``seconds`` on ``world_size`` ranks."""
    return algbw_gbps(nbytes, seconds) * busbw_factor(world_size)
