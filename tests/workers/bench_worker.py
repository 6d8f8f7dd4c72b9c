"""Rank side of tests/bench/test_bench.py under torchrun: one rank of ``python -m ncclguard.bench ARGS``."""

from __future__ import annotations

import sys

import rankkit

from ncclguard.bench.arguments import parse_options
from ncclguard.bench.rank import run_rank
from ncclguard.testing.launch import under_launcher

# The same path as `torchrun -m ncclguard.bench ARGS` takes (bench.main.main under a launcher),
# minus its final os._exit, so the rank can save what it returned.
rankkit.put("under_launcher", under_launcher())
rankkit.put("rc", run_rank(parse_options(sys.argv[1:]), "gloo"))
rankkit.done()
