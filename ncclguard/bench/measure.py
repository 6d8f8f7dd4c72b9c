"""The measurement on one rank: every mode of one size, interleaved per iteration.

Modes take turns inside each iteration, in a rotating order (plain, safe, safe-atomic; then
safe, safe-atomic, plain; ...), so a burst of noise from the rest of the machine lands on all
modes alike and no mode always runs right after another. Every call is preceded by a barrier
(a 1-element all_reduce), and timed with ``perf_counter`` until it has completed on this rank
(on CUDA, after a device synchronize). Ranks share their times afterwards with one all_gather.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ncclguard._naming import REDUCE_OP_NAMES
from ncclguard.bench import check
from ncclguard.bench.arguments import OPS
from ncclguard.bench.memory import PeakMemory
from ncclguard.collectives.all_reduce import release_atomic_buffers, retained_atomic_bytes, safe_all_reduce
from ncclguard.errors import BenchCallFailed

__all__ = ["BenchCallFailed", "ModeRun", "SizeRun", "measure_size", "TORCH_OPS"]

# The bench's op names (nccl-tests' -o) to torch's ReduceOp, through the library's one naming table.
_BY_NAME = {name: op for op, name in REDUCE_OP_NAMES.items()}
TORCH_OPS = {name: _BY_NAME["PRODUCT" if name == "prod" else name.upper()] for name in OPS}


@dataclass
class ModeRun:
    """What one rank learned about one mode at one size (times of every rank, after the gather)."""

    mode: str
    chunks: int = 1
    rank_times_s: list[list[float]] = field(default_factory=list)  # [rank][iteration]
    rank_peak_bytes: list[int | None] = field(default_factory=list)  # [rank]: peak over the use before one call
    # [rank]: use after one call over the use before it, ncclguard's atomic buffers released first
    rank_kept_bytes: list[int | None] = field(default_factory=list)
    # [rank]: what ncclguard says it keeps after one call (retained_atomic_bytes)
    rank_kept_reported_bytes: list[int] = field(default_factory=list)
    wrong: int | None = None  # summed over ranks


@dataclass
class SizeRun:
    """Every mode measured at one size: element count, bytes, and each mode's :class:`ModeRun`."""

    numel: int
    nbytes: int
    modes: dict[str, ModeRun]


def _caller(mode: str, t: torch.Tensor, op: str, timeout: float | None, chunk_numel: int | None) -> Callable[[], int]:
    """A no-argument call of ``mode`` on ``t``; returns the chunks it used."""
    red = TORCH_OPS[op]
    if mode == "plain":

        def plain() -> int:
            try:
                dist.all_reduce(t, op=red)
            except RuntimeError as exc:  # DistBackendError and the group's timeout derive from it
                raise BenchCallFailed(f"plain: {exc}") from exc
            return 1

        return plain
    atomic = mode == "safe-atomic"

    def guarded() -> int:
        res = safe_all_reduce(t, red, timeout=timeout, chunk_numel=chunk_numel, atomic=atomic)
        if not res.ok:
            raise BenchCallFailed(f"{mode}: {res.error}")
        return res.chunks

    return guarded


def _gather(x: torch.Tensor, device: torch.device, world: int) -> list[torch.Tensor]:
    parts = [torch.zeros_like(x, device=device) for _ in range(world)]
    dist.all_gather(parts, x.to(device))
    return [p.cpu() for p in parts]


def _sync(device: torch.device, token: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.all_reduce(token)  # a barrier every backend has on every device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_size(
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    modes: tuple[str, ...],
    op: str,
    *,
    iters: int,
    warmup: int,
    timeout: float | None,
    chunk_numel: int | None,
    check_data: bool,
    corrupt_rank: int | None,
    on_iteration: Callable[[], None] = lambda: None,
) -> SizeRun:
    """Measures every mode at one size on this rank; every rank must call it with the same arguments.

    Returns:
        The times of every rank (gathered), every rank's peak memory and memory kept between
        calls per mode, and the summed ``#wrong`` per mode when ``check_data``.

    Raises:
        BenchCallFailed: a guarded call failed (its error says why).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.empty(numel, dtype=dtype, device=device)
    check.fill(t, rank)  # the values do not change the speed; they keep the data finite for a while
    calls = {m: _caller(m, t, op, timeout, chunk_numel) for m in modes}
    runs = {m: ModeRun(m) for m in modes}
    token = torch.zeros(1, device=device)
    mine = _time_modes(calls, runs, modes, device, token, iters=iters, warmup=warmup, on_iteration=on_iteration)
    peak = PeakMemory(device)
    peaks = _peak_bytes(calls, modes, device, token, peak)
    kept = _kept_bytes(calls, modes, device, token, peak)
    release_atomic_buffers()  # the check pass and the next size start from nothing kept
    if check_data:
        _check_modes(t, calls, runs, modes, device, token, op=op, corrupt=rank == corrupt_rank)
    times = _gather(mine, device, world)
    peak_by_rank = _gather(peaks, device, world)
    kept_by_rank = _gather(kept, device, world)
    for j, m in enumerate(modes):
        runs[m].rank_times_s = [g[j].tolist() for g in times]
        runs[m].rank_peak_bytes = [None if int(g[j]) < 0 else int(g[j]) for g in peak_by_rank]
        runs[m].rank_kept_bytes = [None if int(g[j, 0]) < 0 else int(g[j, 0]) for g in kept_by_rank]
        runs[m].rank_kept_reported_bytes = [int(g[j, 1]) for g in kept_by_rank]
    return SizeRun(numel, numel * torch.empty((), dtype=dtype).element_size(), runs)


def _time_modes(
    calls: dict[str, Callable[[], int]],
    runs: dict[str, ModeRun],
    modes: tuple[str, ...],
    device: torch.device,
    token: torch.Tensor,
    *,
    iters: int,
    warmup: int,
    on_iteration: Callable[[], None],
) -> torch.Tensor:
    """Times ``warmup + iters`` iterations of every mode, in the rotating order (see the module doc);
    records each mode's chunks in ``runs``.

    Returns:
        This rank's seconds per call, ``[mode, iteration]``, the warm-up left out.
    """
    mine = torch.zeros(len(modes), iters, dtype=torch.float64)
    for it in range(warmup + iters):
        for k in range(len(modes)):
            j = (it + k) % len(modes)
            _sync(device, token)
            start = time.perf_counter()
            chunks = calls[modes[j]]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            runs[modes[j]].chunks = chunks
            if it >= warmup:
                mine[j, it - warmup] = elapsed
            on_iteration()
    return mine


def _peak_bytes(
    calls: dict[str, Callable[[], int]],
    modes: tuple[str, ...],
    device: torch.device,
    token: torch.Tensor,
    peak: PeakMemory,
) -> torch.Tensor:
    """Peak memory: one more call of each mode, alone, after the warm-up filled the caches.

    Returns:
        Per mode, the peak over the use before the call in bytes (-1: not measurable here).
    """
    peaks = torch.full((len(modes),), -1, dtype=torch.int64)
    for j, m in enumerate(modes):
        _sync(device, token)
        peak.start()
        calls[m]()
        got = peak.stop()
        peaks[j] = -1 if got is None else got
    return peaks


def _kept_bytes(
    calls: dict[str, Callable[[], int]],
    modes: tuple[str, ...],
    device: torch.device,
    token: torch.Tensor,
    peak: PeakMemory,
) -> torch.Tensor:
    """Memory kept between calls: from a state where ncclguard holds no buffer, one call of the
    mode, then what stays in use (measured) and what ncclguard reports it keeps.

    Returns:
        Per mode, ``[measured, reported]`` bytes (measured -1: not measurable here).
    """
    kept = torch.full((len(modes), 2), -1, dtype=torch.int64)
    for j, m in enumerate(modes):
        _sync(device, token)
        release_atomic_buffers()
        gc.collect()
        before = peak.current()
        calls[m]()
        after = peak.current()
        kept[j, 0] = -1 if before is None or after is None else max(after - before, 0)
        kept[j, 1] = retained_atomic_bytes()
    return kept


def _check_modes(
    t: torch.Tensor,
    calls: dict[str, Callable[[], int]],
    runs: dict[str, ModeRun],
    modes: tuple[str, ...],
    device: torch.device,
    token: torch.Tensor,
    *,
    op: str,
    corrupt: bool,
) -> None:
    """One call of each mode on known values (wrong ones on this rank when ``corrupt``); sets each
    mode's ``wrong`` in ``runs`` to the elements wrong, summed over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = torch.zeros(len(modes), dtype=torch.int64, device=device)
    for j, m in enumerate(modes):
        check.fill(t, rank, corrupt=corrupt, op=op)
        _sync(device, token)
        calls[m]()
        wrong[j] = check.count_wrong(t, op, world)
    dist.all_reduce(wrong)
    for j, m in enumerate(modes):
        runs[m].wrong = int(wrong[j].item())
