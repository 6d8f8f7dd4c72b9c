"""python -m ncclguard.bench: real 2-rank gloo runs through both launch paths, plus its pure parts.

Launches (each ~5-8 s on 2 cores): the CLI spawning its own ranks (a passing --check sweep with
--json/--csv/--plot), the CLI under torchrun (through tests/harness.py), the CLI with a corrupted
rank (--check must fail, exit 1), and the CLI refusing a size that cannot fit (exit 2, no ranks).

The torchrun launch runs tests/workers/bench_worker.py on 2 ranks: each rank runs the bench's own rank
path with the test's options (1024 bfloat16 elements, op max, chunks of 300, --check, --json) and saves
that it ran under a launcher and its return code; the JSON holds the three modes, none wrong.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from harness import REPO, run_ranks

from ncclguard.bench import check
from ncclguard.bench.arguments import parse_options
from ncclguard.bench.formulas import busbw_factor, slowest_per_iteration, summarize
from ncclguard.bench.measure import ModeRun, SizeRun
from ncclguard.bench.memory import MemoryRefused, ensure_fits
from ncclguard.bench.rows import CSV_FIELDS, build_rows, summary
from ncclguard.bench.sizes import format_numel, parse_bytes, parse_numel, sweep_bytes

MODES = ["plain", "safe", "safe-atomic"]
SWEEP = [256, 2048, 16384]  # -b 1K -e 64K -f 8 in float32 elements


def _bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Runs the CLI as a user would, outside any launcher (so it spawns its own ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # gloo always: on a machine with GPUs "auto" would pick nccl and one rank per GPU.
    cmd = [sys.executable, "-m", "ncclguard.bench", "--backend", "gloo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)


def _recomputed_busbw(row: dict, world: int) -> float:
    slowest = [max(col) for col in zip(*row["rank_times_us"], strict=True)]
    return row["size_bytes"] / (statistics.fmean(slowest) * 1e-6) / 1e9 * 2 * (world - 1) / world


# --- launches -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-spawned")
    proc = _bench(
        "-b",
        "1K",
        "-e",
        "64K",
        "-f",
        "8",
        "--iters",
        "4",
        "--warmup",
        "1",
        "--check",
        "--nproc",
        "2",
        "--json",
        str(out / "r.json"),
        "--csv",
        str(out / "r.csv"),
        "--plot",
        str(out / "r.png"),
    )
    return proc, out


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-torchrun")
    job = run_ranks(
        "bench_worker",
        2,
        "--numel",
        "2**10",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--check",
        "--dtype",
        "bfloat16",
        "--op",
        "max",
        "--chunk-numel",
        "300",
        "--json",
        str(out / "r.json"),
        launcher="torchrun",
        timeout_s=120,
    )
    return job, json.loads((out / "r.json").read_text())


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-corrupted")
    proc = _bench(
        "--numel",
        "1000",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--modes",
        "plain",
        "safe",
        "--check",
        "--corrupt-rank",
        "1",
        "--json",
        str(out / "r.json"),
    )
    return proc, json.loads((out / "r.json").read_text())


def test_self_spawned_run_passes_and_prints_the_table(spawned):
    proc, _ = spawned
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all_reduce (float32 sum) on 2 ranks" in proc.stdout
    for formula in (
        "busbw: algbw x 2(n-1)/n",
        "algbw: size in bytes / time",
        "#wrong:",
        "Avg bus bandwidth (GB/s): plain",
    ):
        assert formula in proc.stdout


def test_json_has_configuration_environment_and_raw_times(spawned):
    doc = json.loads((spawned[1] / "r.json").read_text())
    assert set(doc) == {"benchmark", "config", "environment", "formulas", "results", "summary"}
    cfg = doc["config"]
    assert (cfg["numels"], cfg["modes"], cfg["iters"], cfg["warmup"], cfg["backend"], cfg["world_size"]) == (
        SWEEP,
        MODES,
        4,
        1,
        "gloo",
        2,
    )
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["nccl"] is None and env["gloo"].startswith("bundled with torch")
    assert env["world_size"] == 2 and len(env["hosts"]) == 1
    assert [r["rank"] for r in env["ranks"]] == [0, 1] and all(r["device"] == "cpu" for r in env["ranks"])
    assert env["ncclguard_config"]["max_inflight"] >= 1
    assert [(r["numel"], r["mode"]) for r in doc["results"]] == [(n, m) for n in SWEEP for m in MODES]
    for row in doc["results"]:
        assert row["size_bytes"] == row["numel"] * 4 and row["chunks"] == 1
        assert len(row["rank_times_us"]) == 2 and all(len(t) == 4 for t in row["rank_times_us"])
        assert row["wrong"] == 0
        assert set(row["time_us"]) == {"mean_us", "min_us", "p50_us", "max_us"}
    assert doc["summary"] == {**doc["summary"], "wrong": 0, "failures": [], "exit_code": 0}
    for row in doc["results"]:  # what ncclguard says it keeps: the atomic buffer, as large as the tensor
        want = row["size_bytes"] if row["mode"] == "safe-atomic" else 0
        assert row["kept_reported_bytes"] == want and row["rank_kept_reported_bytes"] == [want, want]
        assert row["kept_between_calls_bytes"] >= 0


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-kept")
    proc = _bench("--numel", "4e6", "--iters", "1", "--warmup", "0", "--nproc", "2", "--json", str(out / "r.json"))
    return proc, json.loads((out / "r.json").read_text())


def test_memory_kept_between_calls_is_measured(kept):
    proc, doc = kept
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["mode"]: r for r in doc["results"]}
    size = 4_000_000 * 4
    # safe-atomic keeps a tensor-sized buffer between calls: the resident set says so (give or take
    # the process's own allocations during a call, up to ~2 MB seen), although its +peak is about zero.
    assert size - (1 << 20) <= rows["safe-atomic"]["kept_between_calls_bytes"] <= size + (4 << 20)
    assert rows["safe-atomic"]["kept_reported_bytes"] == size
    for mode in ("plain", "safe"):  # nothing of ncclguard's; the process's own allocations move RSS by ~2 MB
        assert rows[mode]["kept_between_calls_bytes"] < size / 4 and rows[mode]["kept_reported_bytes"] == 0
    assert "kept:" in proc.stdout  # the formula is printed under the table


def test_busbw_and_times_follow_the_formulas_from_the_raw_times(spawned):
    doc = json.loads((spawned[1] / "r.json").read_text())
    by_size = {}
    for row in doc["results"]:
        slowest = [max(col) for col in zip(*row["rank_times_us"], strict=True)]
        assert row["iteration_times_us"] == slowest
        t = row["time_us"]
        assert t["mean_us"] == pytest.approx(statistics.fmean(slowest), abs=1e-3)
        assert (t["min_us"], t["max_us"]) == (min(slowest), max(slowest))
        assert t["p50_us"] == pytest.approx(statistics.median(slowest), abs=1e-3)
        assert row["busbw_gbps"] == pytest.approx(_recomputed_busbw(row, 2), abs=1e-6)
        assert row["algbw_gbps"] == pytest.approx(row["busbw_gbps"], abs=1e-6)  # 2(n-1)/n = 1 for n = 2
        by_size.setdefault(row["numel"], {})[row["mode"]] = row
    for rows in by_size.values():
        for mode in ("safe", "safe-atomic"):
            want = rows[mode]["time_us"]["mean_us"] / rows["plain"]["time_us"]["mean_us"]
            assert rows[mode]["ratio_to_plain"] == pytest.approx(want, rel=1e-3)


def test_csv_and_plot_are_written(spawned):
    with (spawned[1] / "r.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS
    assert [(int(r["numel"]), r["mode"]) for r in rows] == [(n, m) for n in SWEEP for m in MODES]
    assert all(r["wrong"] == "0" for r in rows)
    assert (spawned[1] / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_under_torchrun_uses_the_launched_ranks(torchrun):
    job, doc = torchrun
    assert [job[r]["under_launcher"] for r in (0, 1)] == [True, True]
    assert [job[r]["rc"] for r in (0, 1)] == [0, 0]
    assert doc["config"]["world_size"] == 2 and doc["config"]["numels"] == [1024]
    assert [(r["mode"], r["chunks"], r["dtype"], r["op"], r["wrong"]) for r in doc["results"]] == [
        ("plain", 1, "bfloat16", "max", 0),
        ("safe", 4, "bfloat16", "max", 0),
        ("safe-atomic", 4, "bfloat16", "max", 0),
    ]
    for row in doc["results"]:
        assert row["size_bytes"] == 2048
        assert row["busbw_gbps"] == pytest.approx(_recomputed_busbw(row, 2), abs=1e-6)


def test_a_corrupted_rank_fails_check_with_exit_1(corrupted):
    proc, doc = corrupted
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Rank 1 sends 3 everywhere: every element is wrong on both ranks.
    assert [(r["mode"], r["wrong"]) for r in doc["results"]] == [("plain", 2000), ("safe", 2000)]
    assert doc["summary"]["wrong"] == 4000 and doc["summary"]["exit_code"] == 1
    assert doc["summary"]["failures"] == ["--check: 4000 wrong values (plain at 3.91 KiB, safe at 3.91 KiB)"]
    assert "FAILED --check: 4000 wrong values" in proc.stdout


def test_a_size_that_cannot_fit_is_refused_before_any_rank_starts():
    proc = _bench("--numel", "1e12", timeout_s=60)
    assert proc.returncode == 2
    assert "refused: refusing 1000000000000 x float32" in proc.stderr
    assert "what fits: --numel " in proc.stderr and "[rank" not in proc.stderr


# --- pure parts -----------------------------------------------------------------------------------


def test_sizes_parse_safely():
    assert [parse_numel(s) for s in ("5e8", "1e6", "2**20", "2^10", "1_000", "2.5e7")] == [
        500_000_000,
        1_000_000,
        1_048_576,
        1024,
        1000,
        25_000_000,
    ]
    for bad in ("1.5", "1e-3", "0", "-4", "abc", "2**99", "__import__('os')", "1e999999"):
        with pytest.raises(ValueError):
            parse_numel(bad)
    assert [parse_bytes(s) for s in ("1K", "64M", "1G", "8KiB", "100")] == [1024, 64 << 20, 1 << 30, 8192, 100]
    with pytest.raises(ValueError, match="form N, NK"):
        parse_bytes("1.5G")
    assert sweep_bytes(1024, 1 << 30, 2)[-1] == 1 << 30 and len(sweep_bytes(1024, 1 << 30, 2)) == 21
    assert [format_numel(n) for n in (10**8, 2**20, 123456)] == ["1e8", "2**20", "123456"]


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--numel", "1.5"], "not a whole number"),
        (["--numel", "10", "-b", "1K"], "either --numel or a byte sweep"),
        (["-b", "2G", "-e", "1K"], "must not exceed -e"),
        (["--iters", "0"], "--iters: Input should be greater than or equal to 1"),
        (["--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--op", "avg", "--dtype", "int32"], "would truncate"),
        (["--modes", "fast"], "invalid choice: 'fast'"),
        (["--corrupt-rank", "1"], "add --check"),
    ],
)
def test_bad_options_exit_2_with_a_message(argv, phrase, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_options(argv)
    assert exc.value.code == 2
    assert phrase in capsys.readouterr().err


def test_options_defaults_follow_nccl_tests():
    o = parse_options(["--nproc", "2"])
    assert (o.numels(), o.iters, o.warmup, o.op, o.dtype, o.modes) == ([8 << 20], 20, 5, "sum", "float32", tuple(MODES))
    assert parse_options(["--modes", "safe", "plain", "--nproc", "2"]).modes == ("plain", "safe")


def test_formulas_on_four_ranks():
    assert busbw_factor(4) == 1.5 and busbw_factor(8) == 1.75
    assert slowest_per_iteration([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    s = summarize([1e-3, 3e-3, 2e-3])
    assert (s.mean_us, s.min_us, s.p50_us, s.max_us) == pytest.approx((2000, 1000, 2000, 3000))
    run = SizeRun(
        1000,
        4000,
        {
            m: ModeRun(
                m,
                rank_times_s=[[1e-3, 2e-3]] * 3 + [[2e-3, 2e-3]],
                rank_peak_bytes=[10, 10, 10, 10 if m == "plain" else 4010],
            )
            for m in ("plain", "safe")
        },
    )
    rows = build_rows([run], "float32", "sum", 4)
    assert rows[0]["time_us"]["mean_us"] == 2000 and rows[0]["algbw_gbps"] == 0.002 and rows[0]["busbw_gbps"] == 0.003
    assert rows[1]["ratio_to_plain"] == 1.0 and rows[1]["extra_peak_over_plain_bytes"] == 4000


def test_min_busbw_fails_on_the_average_of_a_mode():
    rows = [{"mode": "plain", "busbw_gbps": b, "wrong": None, "size_bytes": 8} for b in (1.0, 3.0)]
    assert summary(rows, 1.9)["exit_code"] == 0
    bad = summary(rows, 2.5)
    assert bad["exit_code"] == 1 and bad["avg_busbw_gbps"] == {"plain": 2.0}
    assert bad["failures"] == ["--min-busbw: average busbw of plain is 2.000 GB/s, below 2.5 GB/s"]


@pytest.mark.parametrize(
    "dtype, op",
    [
        (dtype, op)
        for dtype in (torch.int8, torch.uint8, torch.int64, torch.float16, torch.bfloat16, torch.float64)
        for op in ("sum", "prod", "min", "max", "avg")
        if op != "avg" or dtype.is_floating_point  # avg on integers is refused by the options
    ],
)
def test_check_counts_exactly_what_a_local_reduction_gets_wrong(dtype, op):
    world, n = 9, 1001
    parts = []
    for r in range(world):
        t = torch.empty(n, dtype=dtype)
        check.fill(t, r)
        parts.append(t)
    stacked = torch.stack(parts).to(torch.float64)
    reduced = {
        "sum": stacked.sum(0),
        "prod": stacked.prod(0),
        "min": stacked.min(0).values,
        "max": stacked.max(0).values,
        "avg": stacked.sum(0) / world,
    }[op]
    if dtype.is_floating_point:
        reduced = reduced.to(dtype)
    else:  # wrap like integer arithmetic does
        reduced = reduced.to(torch.int64).to(dtype)
    assert check.count_wrong(reduced, op, world) == 0
    check.fill(parts[3], 3, corrupt=True, op=op)
    corrupted = torch.stack(parts).to(torch.float64)
    bad = {
        "sum": corrupted.sum(0),
        "prod": corrupted.prod(0),
        "min": corrupted.min(0).values,
        "max": corrupted.max(0).values,
        "avg": corrupted.sum(0) / world,
    }[op]
    bad = bad.to(dtype) if dtype.is_floating_point else bad.to(torch.int64).to(dtype)
    assert check.count_wrong(bad, op, world) == n


def test_memory_refusal_names_what_fits():
    with pytest.raises(MemoryRefused, match=r"what fits: --numel \S+ .*a sweep up to -e \d+[KMG]") as exc:
        ensure_fits([10**13], 4, "float32", ("plain", "safe", "safe-atomic"), False, 2)
    assert "safe-atomic copy" in str(exc.value) and "without safe-atomic" in str(exc.value)
    ensure_fits([1000], 4, "float32", ("plain",), True, 2)  # fits: no exception
