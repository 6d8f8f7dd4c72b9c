"""From measured times to rows, and from rows to a rich table, JSON and CSV.

Every derived number of a row comes from :mod:`ncclguard.bench.formulas`; the JSON keeps the raw
per-rank times next to it, so anyone can recompute the row.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ncclguard.bench.formulas import FORMULAS, algbw_gbps, busbw_gbps, slowest_per_iteration, summarize
from ncclguard.bench.measure import SizeRun
from ncclguard.bench.sizes import format_bytes

__all__ = ["build_rows", "summary", "render_table", "write_json", "write_csv", "CSV_FIELDS"]

CSV_FIELDS = [
    "size_bytes",
    "numel",
    "dtype",
    "op",
    "mode",
    "chunks",
    "time_us",
    "min_us",
    "p50_us",
    "max_us",
    "algbw_gbps",
    "busbw_gbps",
    "ratio_to_plain",
    "ratio_to_plain_p50",
    "extra_peak_over_plain_bytes",
    "kept_between_calls_bytes",
    "kept_reported_bytes",
    "wrong",
]


def _extra_peak(run: SizeRun, mode: str) -> int | None:
    """Max over ranks of (this mode's peak - plain's peak), or None without plain or a measurement."""
    if "plain" not in run.modes:
        return None
    pairs = zip(run.modes[mode].rank_peak_bytes, run.modes["plain"].rank_peak_bytes, strict=True)
    diffs = [a - b for a, b in pairs if a is not None and b is not None]
    return max(diffs) if diffs else None


def _max_known(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def build_rows(runs: Sequence[SizeRun], dtype: str, op: str, world_size: int) -> list[dict[str, Any]]:
    """One row per size and mode, with the derived numbers and the raw times (microseconds)."""
    rows = []
    for run in runs:
        slowest = {m: slowest_per_iteration(r.rank_times_s) for m, r in run.modes.items()}
        stats = {m: summarize(s) for m, s in slowest.items()}
        for mode, r in run.modes.items():
            st = stats[mode]
            plain = stats.get("plain")
            rows.append(
                {
                    "size_bytes": run.nbytes,
                    "numel": run.numel,
                    "dtype": dtype,
                    "op": op,
                    "mode": mode,
                    "chunks": r.chunks,
                    "time_us": st.to_dict(),
                    "algbw_gbps": round(algbw_gbps(run.nbytes, st.mean_us / 1e6), 6),
                    "busbw_gbps": round(busbw_gbps(run.nbytes, st.mean_us / 1e6, world_size), 6),
                    "ratio_to_plain": round(st.mean_us / plain.mean_us, 4) if plain else None,
                    "ratio_to_plain_p50": round(st.p50_us / plain.p50_us, 4) if plain else None,
                    "extra_peak_over_plain_bytes": _extra_peak(run, mode),
                    "kept_between_calls_bytes": _max_known(r.rank_kept_bytes),
                    "kept_reported_bytes": _max_known(list(r.rank_kept_reported_bytes)),
                    "wrong": r.wrong,
                    "iteration_times_us": [round(t * 1e6, 3) for t in slowest[mode]],
                    "rank_times_us": [[round(t * 1e6, 3) for t in ts] for ts in r.rank_times_s],
                    "rank_peak_bytes": r.rank_peak_bytes,
                    "rank_kept_bytes": r.rank_kept_bytes,
                    "rank_kept_reported_bytes": r.rank_kept_reported_bytes,
                }
            )
    return rows


def summary(rows: Sequence[dict[str, Any]], min_busbw: float | None) -> dict[str, Any]:
    """Average busbw per mode (nccl-tests' "Avg bus bandwidth"), wrong values, and the check.

    Returns:
        ``avg_busbw_gbps`` by mode, ``wrong`` (total, or None without --check), ``failures``
        (what makes the run fail, in words) and ``exit_code`` (0 or 1).
    """
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    avg = {m: round(float(np.mean([r["busbw_gbps"] for r in rows if r["mode"] == m])), 6) for m in modes}
    checked = [r["wrong"] for r in rows if r["wrong"] is not None]
    wrong = sum(checked) if checked else None
    failures = []
    if wrong:
        bad = sorted({f"{r['mode']} at {format_bytes(r['size_bytes'])}" for r in rows if r["wrong"]})
        failures.append(f"--check: {wrong} wrong values ({', '.join(bad)})")
    if min_busbw is not None:
        for m, v in avg.items():
            if v < min_busbw:
                failures.append(f"--min-busbw: average busbw of {m} is {v:.3f} GB/s, below {min_busbw:g} GB/s")
    return {"avg_busbw_gbps": avg, "wrong": wrong, "failures": failures, "exit_code": 1 if failures else 0}


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _peak(v: int | None, mode: str) -> str:
    if mode == "plain":
        return "-"
    if v is None:
        return "n/a"
    return ("+" if v >= 0 else "-") + format_bytes(abs(v))


def _kept(measured: int | None, reported: int | None) -> str:
    """Memory kept between calls as measured; where it cannot be measured, what ncclguard reports."""
    if measured is None:
        return "n/a" if not reported else f"n/a ({format_bytes(reported)})"
    return format_bytes(measured)


def render_table(
    rows: Sequence[dict[str, Any]], world_size: int, summ: dict[str, Any], console: Console | None = None
) -> None:
    """Prints the results table, the formulas under it, and the averages (rank 0 calls this)."""
    # Off a terminal (a log file, a pipe) rich would assume 80 columns; the table needs ~150.
    console = console or Console(width=None if Console().is_terminal else 170)
    with_check = any(r["wrong"] is not None for r in rows)
    kinds = ", ".join(dict.fromkeys(f"{r['dtype']} {r['op']}" for r in rows))
    table = Table(
        title=f"all_reduce ({kinds}) on {world_size} ranks: plain dist.all_reduce vs ncclguard.safe_all_reduce",
        title_justify="left",
    )
    # Two-line headers keep the table narrow enough for a terminal of 120 columns.
    for name in (
        "size",
        "count",
        "mode",
        "chunks",
        "time\n(us)",
        "min\n(us)",
        "p50\n(us)",
        "max\n(us)",
        "algbw\n(GB/s)",
        "busbw\n(GB/s)",
        "x plain\n(mean)",
        "x plain\n(p50)",
        "+peak\nmemory",
        "kept\nbetween\ncalls",
    ):
        # fold, never "…": a truncated number is worse than a wrapped one
        table.add_column(name, justify="left" if name == "mode" else "right", overflow="fold")
    if with_check:
        table.add_column("#wrong", justify="right")
    previous = None
    for i, r in enumerate(rows):
        t = r["time_us"]
        cells = [
            format_bytes(r["size_bytes"]) if r["size_bytes"] != previous else "",
            str(r["numel"]) if r["size_bytes"] != previous else "",
            r["mode"],
            str(r["chunks"]),
            f"{t['mean_us']:.1f}",
            f"{t['min_us']:.1f}",
            f"{t['p50_us']:.1f}",
            f"{t['max_us']:.1f}",
            f"{r['algbw_gbps']:.3f}",
            f"{r['busbw_gbps']:.3f}",
            _ratio(r["ratio_to_plain"]) if r["mode"] != "plain" else "-",
            _ratio(r["ratio_to_plain_p50"]) if r["mode"] != "plain" else "-",
            _peak(r["extra_peak_over_plain_bytes"], r["mode"]),
            _kept(r["kept_between_calls_bytes"], r["kept_reported_bytes"]),
        ]
        if with_check:
            cells.append("-" if r["wrong"] is None else str(r["wrong"]))
        last_of_size = i + 1 == len(rows) or rows[i + 1]["size_bytes"] != r["size_bytes"]
        table.add_row(*cells, end_section=last_of_size)
        previous = r["size_bytes"]
    console.print(table)
    for name, text in FORMULAS.items():
        if name != "#wrong" or with_check:
            console.print(f"  {name}: {text}", highlight=False)
    avg = ", ".join(f"{m} {v:.3f}" for m, v in summ["avg_busbw_gbps"].items())
    console.print(f"  Avg bus bandwidth (GB/s): {avg}", highlight=False)
    for f in summ["failures"]:
        console.print(f"[bold red]FAILED[/] {f}")


def write_json(
    path: Path,
    config: dict[str, Any],
    environment: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    summ: dict[str, Any],
) -> None:
    """Writes the whole run: configuration, environment, formulas, rows with raw times, summary."""
    doc = {
        "benchmark": "all_reduce",
        "config": config,
        "environment": environment,
        "formulas": FORMULAS,
        "results": list(rows),
        "summary": summ,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Writes one CSV row per size and mode (times in microseconds, bandwidths in GB/s)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            t = r["time_us"]
            w.writerow(
                {
                    **{k: r[k] for k in CSV_FIELDS if k in r},
                    "time_us": t["mean_us"],
                    "min_us": t["min_us"],
                    "p50_us": t["p50_us"],
                    "max_us": t["max_us"],
                }
            )
