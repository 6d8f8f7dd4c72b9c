"""Demo act: a short benchmark, plain dist.all_reduce against safe_all_reduce, in nccl-tests' units."""

from __future__ import annotations

import argparse
import subprocess
import sys

TITLE = "Benchmark: what guarding costs (2 ranks, gloo, 1 KiB to 4 MiB, with --check)"
# A few seconds on 2 cores; the full sweep to 1 GiB is benchmarks/run_gloo_2ranks.py.
ARGS = [
    "-b",
    "1K",
    "-e",
    "4M",
    "-f",
    "16",
    "--iters",
    "5",
    "--warmup",
    "2",
    "--check",
    "--nproc",
    "2",
    "--backend",
    "gloo",
    "--job-timeout",
    "90",
]  # the bench bounds its own ranks; 120 s below bounds the bench


def run(args: argparse.Namespace) -> int:
    """Runs ``python -m ncclguard.bench`` (it spawns its own ranks) and passes on its exit status."""
    cmd = [sys.executable, "-m", "ncclguard.bench", *ARGS]
    print("$ python -m ncclguard.bench " + " ".join(ARGS), flush=True)
    try:
        return subprocess.run(cmd, timeout=120).returncode
    except subprocess.TimeoutExpired:
        print("the benchmark did not finish within 120 s")
        return 1
