"""``python -m ncclguard.bench``: an all_reduce benchmark in nccl-tests' units, plain against guarded.

Modules, one idea each: :mod:`~ncclguard.bench.sizes` (parsing sizes), :mod:`~ncclguard.bench.arguments`
(the validated options), :mod:`~ncclguard.bench.memory` (will it fit, peak memory),
:mod:`~ncclguard.bench.check` (the correctness pass), :mod:`~ncclguard.bench.formulas` (the formulas),
:mod:`~ncclguard.bench.measure` (timing one size), :mod:`~ncclguard.bench.environment` (what it ran
on), :mod:`~ncclguard.bench.rows` (table, JSON, CSV), :mod:`~ncclguard.bench.plot`,
:mod:`~ncclguard.bench.rank` (one rank's run) and :mod:`~ncclguard.bench.main` (the entry point).
See docs/benchmark.md.
"""

from ncclguard.bench.main import main

__all__ = ["main"]
