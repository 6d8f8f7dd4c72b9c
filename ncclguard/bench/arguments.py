"""The benchmark's options: argparse reads the command line, one pydantic model holds the invariants.

Names follow nccl-tests where it has one (``-b/-e/-f``, ``-n`` is ``--iters``, ``-w`` is
``--warmup``, ``-o`` is ``--op``, ``-d`` is ``--dtype``, ``-c`` is ``--check``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ncclguard.bench.sizes import format_bytes, parse_bytes, parse_numel, sweep_bytes

__all__ = ["MODES", "DTYPES", "OPS", "BenchOptions", "build_parser", "parse_options"]

Mode = Literal["plain", "safe", "safe-atomic"]
MODES: tuple[Mode, ...] = ("plain", "safe", "safe-atomic")
# nccl-tests' names first, torch's spellings as aliases; value: the torch dtype's name.
DTYPES: dict[str, str] = {
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "double": "float64",
    "float64": "float64",
}
OPS: tuple[str, ...] = ("sum", "prod", "min", "max", "avg")
DEFAULT_BYTES = 32 * 1024**2  # nccl-tests' default: one size of 32 MiB


class BenchOptions(BaseModel):
    """A validated benchmark configuration (every invariant of the options is stated here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    numel: int | None = Field(None, gt=0, description="one size in elements; overrides the byte sweep")
    minbytes: int = Field(DEFAULT_BYTES, gt=0)
    maxbytes: int = Field(DEFAULT_BYTES, gt=0)
    stepfactor: int = Field(2, ge=1)
    dtype: str = "float32"
    op: Literal["sum", "prod", "min", "max", "avg"] = "sum"
    iters: int = Field(20, ge=1)
    warmup: int = Field(5, ge=0)
    chunk_numel: int | None = Field(None, gt=0)
    timeout: float | None = Field(None, gt=0, description="seconds per guarded call, and the process group's timeout")
    modes: tuple[Mode, ...] = MODES
    check: bool = False
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    min_busbw: float | None = Field(None, ge=0)
    nproc: int = Field(2, ge=1)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    job_timeout: float = Field(6 * 3600.0, gt=0)
    corrupt_rank: int | None = Field(None, ge=0, description="test hook: this rank sends wrong data in --check")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(DTYPES)}")
        return DTYPES[value]

    @field_validator("modes")
    @classmethod
    def _modes_once_in_order(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(f"give at least one mode of {', '.join(MODES)}")
        # One fixed order (plain first), so every rank and every report lists modes alike.
        return tuple(m for m in MODES if m in value)

    @model_validator(mode="after")
    def _consistent(self) -> BenchOptions:
        if self.numel is None:
            sweep_bytes(self.minbytes, self.maxbytes, self.stepfactor)  # raises on a bad sweep
        if self.op == "avg" and not self.dtype.startswith(("float", "bfloat")):
            raise ValueError(f"--op avg on {self.dtype} would truncate; use a floating dtype or --op sum")
        if self.corrupt_rank is not None and not self.check:
            raise ValueError("--corrupt-rank is a test hook of --check; add --check")
        return self

    @property
    def element_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return {"int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4}.get(self.dtype, 8)

    def numels(self) -> list[int]:
        """The element counts to measure, in order (a byte sweep is rounded down to whole elements)."""
        if self.numel is not None:
            return [self.numel]
        counts: list[int] = []
        for nbytes in sweep_bytes(self.minbytes, self.maxbytes, self.stepfactor):
            n = max(1, nbytes // self.element_size)
            if n not in counts:
                counts.append(n)
        return counts

    def describe_sizes(self) -> str:
        """The sizes in words, for messages."""
        counts = self.numels()
        if len(counts) == 1:
            return f"{counts[0]} x {self.dtype} ({format_bytes(counts[0] * self.element_size)})"
        return (
            f"{len(counts)} sizes from {format_bytes(counts[0] * self.element_size)} to "
            f"{format_bytes(counts[-1] * self.element_size)} of {self.dtype}"
        )


# Field name -> the flag a user typed, for error messages.
_FLAGS = {"json_path": "json", "csv_path": "csv", "plot_path": "plot"}


def _arg(parse):  # argparse shows ArgumentTypeError's text as is
    def convert(text: str):
        try:
            return parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 2


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m ncclguard.bench``."""
    p = argparse.ArgumentParser(
        prog="ncclguard bench",  # also python -m ncclguard.bench: one CLI, one name in its help
        description="all_reduce benchmark with nccl-tests conventions: plain dist.all_reduce against "
        "ncclguard.safe_all_reduce, side by side. Spawns its own ranks on this host unless started by torchrun.",
        epilog="exit status: 0 ok; 1 --check found wrong values, the average busbw fell below --min-busbw, "
        "or a collective failed; 2 refused (bad options, or the sizes do not fit in memory).",
    )
    size = p.add_argument_group("sizes (one --numel, or a byte sweep -b/-e/-f with K/M/G = 1024-based)")
    size.add_argument("--numel", type=_arg(parse_numel), help="elements, e.g. 5e8, 1e6, 2**20")
    size.add_argument("-b", "--minbytes", type=_arg(parse_bytes), default=None, help="first size (default 32M)")
    size.add_argument("-e", "--maxbytes", type=_arg(parse_bytes), default=None, help="last size (default: -b)")
    size.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step (default 2)")
    run = p.add_argument_group("what to run")
    run.add_argument(
        "-d", "--dtype", "--datatype", dest="dtype", default="float", help=f"one of {', '.join(DTYPES)} (default float)"
    )
    run.add_argument("-o", "--op", default="sum", choices=OPS, help="reduction (default sum)")
    run.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size and mode (default 20)")
    run.add_argument(
        "-w",
        "--warmup",
        "--warmup_iters",
        dest="warmup",
        type=int,
        default=5,
        help="untimed iterations first (default 5)",
    )
    run.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        metavar="MODE",
        choices=MODES,
        help="any of plain, safe, safe-atomic (default: all three, interleaved per iteration)",
    )
    run.add_argument(
        "--chunk-numel", type=_arg(parse_numel), help="elements per chunk of safe modes (default: the size policy)"
    )
    run.add_argument(
        "--timeout",
        type=float,
        help="seconds: deadline of each guarded call and the process group timeout "
        "(default: ncclguard's size-based deadline; the backend's group timeout)",
    )
    run.add_argument(
        "-c", "--check", action="store_true", help="also run a correctness pass with integer-valued data (#wrong)"
    )
    launch = p.add_argument_group("ranks")
    launch.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to spawn on this host when not under torchrun (default: CUDA devices, else 2)",
    )
    launch.add_argument(
        "--backend", default="auto", choices=("auto", "gloo", "nccl"), help="auto: nccl with CUDA, else gloo"
    )
    launch.add_argument(
        "--job-timeout", type=float, default=6 * 3600.0, help="seconds the self-spawned job may run in all"
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", dest="json_path", type=Path, help="write configuration, environment and raw times here")
    out.add_argument("--csv", dest="csv_path", type=Path, help="write one row per size and mode here")
    out.add_argument("--plot", dest="plot_path", type=Path, help="plot busbw against size (needs matplotlib)")
    out.add_argument("--min-busbw", type=float, help="exit 1 if a mode's average busbw (GB/s) is below this")
    # Test hook (docs/benchmark.md): rank R contributes wrong values in the --check pass.
    p.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_options(argv: Sequence[str] | None = None) -> BenchOptions:
    """Parses and validates ``argv``; exits with status 2 and a message on bad input (argparse's way)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    fields = vars(ns).copy()
    if fields["numel"] is not None and (fields["minbytes"] is not None or fields["maxbytes"] is not None):
        parser.error("give either --numel or a byte sweep -b/-e/-f, not both")
    if fields["minbytes"] is None:
        fields["minbytes"] = DEFAULT_BYTES
    if fields["maxbytes"] is None:
        fields["maxbytes"] = fields["minbytes"]
    if fields["nproc"] is None:
        fields["nproc"] = _default_nproc()
    try:
        return BenchOptions(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            (f"--{_FLAGS.get(str(e['loc'][0]), str(e['loc'][0]).replace('_', '-'))}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        parser.error(problems)
        raise  # parser.error exits; this line is never reached
