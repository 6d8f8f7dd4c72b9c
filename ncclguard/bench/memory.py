"""Memory: will the sizes fit before we start, how much more does a guarded call take at its peak,
and how much does a mode keep between calls.

The up-front check counts what the benchmark itself holds per rank: the buffer, the private copy
``safe-atomic`` keeps (``safe_all_reduce(atomic=True)`` reduces in a tensor-sized buffer kept
between calls), the block of the correctness pass, and a fixed allowance for the runtime (``import torch`` plus a process group is
about 250 MB of RSS here). gloo on CPU reduces in place without a scratch copy (the plain rows'
``rank_peak_bytes`` in benchmarks/results/sweep.json are 0 up to 1 GiB).

The peak is measured, not estimated: on CUDA with ``torch.cuda.max_memory_allocated``; on Linux
CPU with the resident-set high-water mark ``VmHWM``, reset by writing ``5`` to
``/proc/self/clear_refs`` (proc(5)).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ncclguard.bench.sizes import format_bytes
from ncclguard.errors import MemoryRefused

__all__ = ["CHECK_BLOCK", "MemoryRefused", "need_per_rank", "ensure_fits", "PeakMemory"]

RUNTIME_BYTES = 512 * 1024**2  # per rank on the host: torch, the process group, Python
DEVICE_RESERVE_BYTES = 1024**3  # per GPU: NCCL's buffers and the CUDA context
USABLE = 0.9  # never plan to use the last 10 % of what is free
CHECK_BLOCK = 1 << 22  # elements the correctness pass compares at a time


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs for one size, by what holds them."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def need_per_rank(
    numel: int, element_size: int, modes: tuple[str, ...], check: bool, on_gpu: bool
) -> tuple[Need, Need]:
    """What one rank needs on the host and on its device for ``numel`` elements.

    Returns:
        (host need, device need); the device need is empty without a GPU.
    """
    data = {"buffer": numel * element_size}
    if "safe-atomic" in modes:
        data["safe-atomic copy"] = numel * element_size
    if check:
        data["check block"] = min(numel, CHECK_BLOCK) * 2  # a bool mask and an index, roughly
    host = {"runtime": RUNTIME_BYTES}
    if on_gpu:
        return Need(host), Need({**data, "NCCL and CUDA context": DEVICE_RESERVE_BYTES})
    return Need({**host, **data}), Need({})


def _largest_fitting(
    available: int, ranks: int, element_size: int, modes: tuple[str, ...], check: bool, on_gpu: bool
) -> int:
    """The largest element count whose need fits ``available`` bytes for ``ranks`` ranks (0 if none)."""
    lo, hi = 0, 1 << 50
    while lo < hi:  # need grows with numel, so bisect
        mid = (lo + hi + 1) // 2
        host, device = need_per_rank(mid, element_size, modes, check, on_gpu)
        need = device.total if on_gpu else host.total * ranks
        lo, hi = (mid, hi) if need <= available else (lo, mid - 1)
    return lo


def _available(on_gpu: bool, device: torch.device | None) -> int:
    if on_gpu:
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * USABLE)
    return int(psutil.virtual_memory().available * USABLE)


def ensure_fits(
    numels: list[int],
    element_size: int,
    dtype: str,
    modes: tuple[str, ...],
    check: bool,
    ranks_on_host: int,
    device: torch.device | None = None,
) -> None:
    """Refuses sizes that will not fit in this host's RAM (all its ranks) or in one GPU.

    Args:
        numels: the sizes to run, in elements.
        element_size: bytes per element.
        dtype: the dtype's name, for the message.
        modes: the modes to run (``safe-atomic`` needs a second copy).
        check: whether the correctness pass runs.
        ranks_on_host: ranks sharing this host's RAM.
        device: the CUDA device of this rank, or None for CPU tensors.

    Raises:
        MemoryRefused: the largest size does not fit; says what it needs, what is free, and
            the largest ``--numel`` that would fit.
    """
    on_gpu = device is not None and device.type == "cuda"
    biggest = max(numels)
    host, dev = need_per_rank(biggest, element_size, modes, check, on_gpu)
    checks = [("host RAM", host.total * ranks_on_host, _available(False, None), host, ranks_on_host)]
    if on_gpu:
        checks.append((f"GPU memory of {device}", dev.total, _available(True, device), dev, 1))
    for where, need, available, parts, ranks in checks:
        if need <= available:
            continue
        fit = _largest_fitting(available, ranks, element_size, modes, check, on_gpu and where != "host RAM")
        per = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.parts.items())
        hint = (
            f"what fits: --numel {_round_down(fit)} ({format_bytes(_round_down_int(fit) * element_size)}), "
            f"or a sweep up to -e {_pow2_suffix(fit * element_size)}"
            if fit > 0
            else "nothing fits: free memory or run fewer ranks per host (--nproc)"
        )
        if "safe-atomic" in modes and fit > 0:
            hint += "; without safe-atomic (--modes plain safe) larger sizes fit"
        raise MemoryRefused(
            f"refusing {biggest} x {dtype} ({format_bytes(biggest * element_size)}): it needs about "
            f"{format_bytes(need)} of {where} for {ranks} rank(s) (per rank: {per}), but only "
            f"{format_bytes(available)} is available ({int(USABLE * 100)} % of free); {hint}"
        )


def _round_down_int(numel: int) -> int:
    """``numel`` rounded down to two significant digits (what :func:`_round_down` prints)."""
    if numel < 100:
        return numel
    scale = 10 ** (len(str(numel)) - 2)
    return numel // scale * scale


def _round_down(numel: int) -> str:
    """A count that fits, as one would type it: 1161464115 -> ``1.1e9``."""
    n = _round_down_int(numel)
    if n < 10_000:
        return str(n)
    digits, exp = str(n)[:2], len(str(n)) - 1
    return f"{digits[0]}e{exp}" if digits[1] == "0" else f"{digits[0]}.{digits[1]}e{exp}"


def _pow2_suffix(nbytes: int) -> str:
    """The largest power-of-two byte size <= ``nbytes`` in -e's notation (``4G``, ``512M``)."""
    p = 1 << (nbytes.bit_length() - 1)
    for suffix, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if p >= scale:
            return f"{p // scale}{suffix}"
    return str(p)


_HWM = re.compile(r"^VmHWM:\s+(\d+) kB", re.MULTILINE)
_RSS = re.compile(r"^VmRSS:\s+(\d+) kB", re.MULTILINE)
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _kib(pattern: re.Pattern[str], status: str) -> int:
    """The kB value of one line of /proc/self/status. Raises ValueError when the line is absent."""
    found = pattern.search(status)
    if found is None:
        raise ValueError(f"no {pattern.pattern!r} in /proc/self/status")
    return int(found.group(1))


class PeakMemory:
    """Measures how far one call raises this process's memory above where it started.

    On CUDA: bytes allocated by the caching allocator. On Linux CPU: resident set size. Elsewhere
    (no ``/proc/self/clear_refs``) :meth:`stop` returns None.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def start(self) -> None:
        """Resets the high-water mark to the current use and remembers the current use."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        try:
            _CLEAR_REFS.write_text("5")
            self._base = _kib(_RSS, _STATUS.read_text()) * 1024
        except (OSError, ValueError):
            self._base = -1

    def current(self) -> int | None:
        """Bytes in use now: allocated by the CUDA caching allocator, or this process's resident
        set (``VmRSS``); None where it cannot be read."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        try:
            return _kib(_RSS, _STATUS.read_text()) * 1024
        except (OSError, ValueError):
            return None

    def stop(self) -> int | None:
        """Bytes of the peak above the use at :meth:`start`, or None where it cannot be measured."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        if self._base < 0:
            return None
        try:
            peak = _kib(_HWM, _STATUS.read_text()) * 1024
        except (OSError, ValueError):
            return None
        # The kernel updates RSS counters in batches of pages per thread, so a call that
        # allocates nothing can read a few KiB below its start: that is zero.
        return max(peak - self._base, 0)
