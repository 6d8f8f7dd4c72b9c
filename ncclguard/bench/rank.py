"""One rank of the benchmark: join the group, agree that the sizes fit, measure, and (rank 0) report."""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ncclguard.bench.arguments import BenchOptions
from ncclguard.bench.environment import describe_job
from ncclguard.bench.measure import BenchCallFailed, SizeRun, measure_size
from ncclguard.bench.memory import MemoryRefused, ensure_fits
from ncclguard.bench.rows import build_rows, render_table, summary, write_csv, write_json
from ncclguard.bench.sizes import format_bytes

__all__ = ["run_rank"]

EXIT_FAILED, EXIT_REFUSED = 1, 2


def _say(text: str) -> None:
    print(f"python -m ncclguard.bench [rank {dist.get_rank()}]: {text}", file=sys.stderr, flush=True)


def _agree(ok: bool, device: torch.device) -> list[bool]:
    """Every rank's ``ok``, on every rank (so all ranks stop together, nobody waits in a collective)."""
    mine = torch.tensor([int(ok)], device=device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [bool(p.item()) for p in parts]


def _fits(opts: BenchOptions, device: torch.device) -> str | None:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    try:
        ensure_fits(
            opts.numels(),
            opts.element_size,
            opts.dtype,
            opts.modes,
            opts.check,
            local,
            device if device.type == "cuda" else None,
        )
    except MemoryRefused as exc:
        return str(exc)
    return None


def run_rank(opts: BenchOptions, backend: str) -> int:
    """Runs the benchmark as this rank of a launched job.

    Returns:
        0, 1 (wrong values, busbw below --min-busbw, or a failed call) or 2 (refused); the same
        on every rank.
    """
    device = _join(opts, backend)
    if _refused(opts, device):
        return EXIT_REFUSED
    # Every rank goes on from here (they agreed), so describe_job may exchange with all of them.
    environment = describe_job(device, backend)
    numels = opts.numels()
    runs = _measure_all(opts, device, numels)
    if runs is None:
        return EXIT_FAILED
    world = dist.get_world_size()
    rows = build_rows(runs, opts.dtype, opts.op, world)
    summ = summary(rows, opts.min_busbw)
    if dist.get_rank() == 0:
        _report(opts, backend, numels, environment, rows, summ)
    return summ["exit_code"]


def _join(opts: BenchOptions, backend: str) -> torch.device:
    """Joins the job's process group (this rank's GPU for nccl, else the CPU).

    Returns:
        The device the bench measures on.
    """
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=opts.timeout)} if opts.timeout else {}
    dist.init_process_group(backend, **kwargs)
    return device


def _refused(opts: BenchOptions, device: torch.device) -> bool:
    """Whether the job cannot run as asked: ``--corrupt-rank`` names no rank, or the sizes do not fit
    on some rank's host. The ranks agree, so all refuse together; one of them says why."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if opts.corrupt_rank is not None and opts.corrupt_rank >= world:
        if rank == 0:
            _say(f"refused: --corrupt-rank {opts.corrupt_rank} is not a rank of this {world}-rank job")
        return True
    problem = _fits(opts, device)
    answers = _agree(problem is None, device)
    if not all(answers):
        if problem is not None and (rank == 0 or int(os.environ.get("LOCAL_RANK", "0")) == 0):
            _say(f"refused: {problem}")
        elif rank == 0:
            _say(f"refused: the sizes do not fit on the hosts of ranks {[r for r, ok in enumerate(answers) if not ok]}")
        return True
    return False


def _measure_all(opts: BenchOptions, device: torch.device, numels: list[int]) -> list[SizeRun] | None:
    """Measures every size in ``numels``, with a progress bar on rank 0.

    Returns:
        One run per size, or None when a guarded call failed (said, then the bench stops).
    """
    dtype = getattr(torch, opts.dtype)
    per_size = (opts.warmup + opts.iters) * len(opts.modes)
    # Only rank 0 draws the bar; the others keep a disabled one, so the loop has one shape.
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=dist.get_rank() != 0,
    )
    runs: list[SizeRun] = []
    with progress:
        task = progress.add_task("all_reduce", total=per_size * len(numels))
        tick = functools.partial(progress.advance, task)
        for numel in numels:
            progress.update(task, description=f"all_reduce {format_bytes(numel * opts.element_size)}")
            try:
                runs.append(
                    measure_size(
                        numel,
                        dtype,
                        device,
                        opts.modes,
                        opts.op,
                        iters=opts.iters,
                        warmup=opts.warmup,
                        timeout=opts.timeout,
                        chunk_numel=opts.chunk_numel,
                        check_data=opts.check,
                        corrupt_rank=opts.corrupt_rank,
                        on_iteration=tick,
                    )
                )
            except BenchCallFailed as exc:
                _say(f"a guarded call failed at {numel} elements, stopping: {exc}")
                return None
    return runs


def _report(
    opts: BenchOptions,
    backend: str,
    numels: list[int],
    environment: dict[str, Any],
    rows: list[dict[str, Any]],
    summ: dict[str, Any],
) -> None:
    """Rank 0's report: the table, and the JSON, CSV and plot files asked for."""
    world = dist.get_world_size()
    render_table(rows, world, summ)
    config = {**opts.model_dump(mode="json"), "numels": numels, "backend": backend, "world_size": world}
    if opts.json_path:
        write_json(opts.json_path, config, environment, rows, summ)
    if opts.csv_path:
        write_csv(opts.csv_path, rows)
    if opts.plot_path:
        from ncclguard.bench.plot import plot_busbw

        plot_busbw(
            opts.plot_path,
            rows,
            f"all_reduce {opts.dtype}, {world} ranks, {backend} ({', '.join(environment['hosts'])})",
        )
