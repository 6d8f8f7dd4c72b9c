"""``python -m ncclguard.bench``: spawns ranks on this host, or runs as one rank under torchrun.

Without torchrun's variables it checks memory for all its ranks, then re-runs itself as
``--nproc`` ranks with :func:`ncclguard.testing.launch.spawn` and exits with the worst rank's status.
Under a launcher every rank measures, and rank 0 prints and writes the results.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ncclguard.bench.arguments import BenchOptions, parse_options
from ncclguard.bench.memory import MemoryRefused, ensure_fits
from ncclguard.testing.launch import spawn, under_launcher

__all__ = ["main", "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED"]

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


def _backend(opts: BenchOptions) -> str:
    if opts.backend != "auto":
        return opts.backend
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _refuse(message: str) -> int:
    print(f"python -m ncclguard.bench: refused: {message}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def _spawn_ranks(opts: BenchOptions, argv: Sequence[str]) -> int:
    backend = _backend(opts)
    if backend == "nccl" and opts.nproc > torch.cuda.device_count():
        return _refuse(
            f"--nproc {opts.nproc} needs one GPU per rank with nccl, but {torch.cuda.device_count()} "
            "are visible; lower --nproc or use --backend gloo"
        )
    if backend == "gloo":  # with GPUs each rank checks its own device once it runs
        try:
            ensure_fits(opts.numels(), opts.element_size, opts.dtype, opts.modes, opts.check, opts.nproc)
        except MemoryRefused as exc:
            return _refuse(str(exc))
    res = spawn([sys.executable, "-m", "ncclguard.bench", *argv], opts.nproc, timeout_s=opts.job_timeout, capture=False)
    if res.timed_out:
        print(
            f"python -m ncclguard.bench: the ranks did not finish within --job-timeout {opts.job_timeout:g} s",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    codes = [r.returncode for r in res.ranks]
    if all(c == 0 for c in codes):
        return EXIT_OK
    return EXIT_REFUSED if all(c in (0, EXIT_REFUSED) for c in codes) else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (0 ok, 1 failed check/busbw/collective, 2 refused)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv)
    if not under_launcher():
        return _spawn_ranks(opts, argv)
    from ncclguard.bench.rank import run_rank

    rc = run_rank(opts, _backend(opts))
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave at once, like tests/workers/rankkit.done: a failed guarded call leaves its op queued in
    # the backend, and tearing a gloo group down at exit sometimes aborts the process
    # ("terminate called without an active exception", seen here on 2 of 6 clean runs).
    os._exit(rc)
