"""What should_commit's store round costs at 8, 64 and 1,024 simulated ranks against one TCPStore.

Each simulated rank runs the real commit round (``ncclguard.recovery.commit._settle``: the
settle-once round of ``store/rounds.py`` with the commit rule, statements and verdict through the
codec) on a thread of its own with its own TCPStore client, against one real TCPStore server (libuv)
in this process. The ranks live in ``--procs`` worker processes (one thread per rank). Every rank
runs ``--rounds`` commits back to back: each commit waits for the verdict, so the rounds pace
themselves. A clean step: every statement has no problem and the same sequence number.

Measured per size:

- ``round_wall_ms``: per round, from the first rank's entry to the last rank's return (wall clock,
  one host), median and p90 over the rounds after ``--warmup``. With every simulated rank on the
  same 2 cores this is mostly CPU contention between the ranks' threads and the server; a real
  job has a core per rank.
- ``rank_ms``: the median per-rank time in the round (entry to return, waiting included).
- ``settler_cpu_ms``: what only the settling rank adds to the round's critical path, measured
  alone in this process: one ``multi_get`` of every statement from the server, decoding them and
  deciding the verdict (median of 20).
- ``serial_round_ms``: every request of one round (every rank's and the settler's) issued by one
  client in sequence, with no thread contention: the server's work per round, which bounds a
  round where each rank has a core of its own (the store serves requests one at a time).
- ``requests_per_rank``: store requests per rank per round, by the protocol: 5 (``set``, ``add``,
  ``wait``, ``get``, and after the round the delete of its statement of the round before); the
  settler makes a ``multi_get`` and a ``compare_set`` instead of the ``wait`` and ``get``; rank 0
  deletes 3 more keys of the round before.

Usage: python benchmarks/commit_cost.py [--ranks 8 64 1024] [--procs 4] [--rounds 30] [--json benchmarks/results/commit_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.collectives.groups import GroupInfo
from ncclguard.recovery import commit as commit_mod
from ncclguard.recovery._commit.statements import MAX_STATEMENT_BYTES, CommitStatement, commit_keys, decide
from ncclguard.store.codec import decode, encode

GROUP = "bench"
TIMEOUT_S = 300.0


def group_name(size: int) -> str:
    # One group per size: the last round of each size stays in the store (nobody deletes it).
    return f"{GROUP}{size}"


def statement(rank: int, size: int, n: int) -> CommitStatement:
    return CommitStatement(rank=rank, step=n, generation=0, group=group_name(size), group_size=size, seq=4 * n + 2)


def worker(args: argparse.Namespace) -> None:
    """Runs ranks ``first .. first+count-1`` of ``size``, one thread each; prints their timings."""
    times: dict[int, list[tuple[float, float, bool]]] = {}
    ready = threading.Barrier(args.count)

    def rank(r: int) -> None:
        store = dist.TCPStore(args.host, args.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        info = GroupInfo(group=None, name=group_name(args.size), rank=r, size=args.size, backend="gloo", store=store)  # type: ignore[arg-type]
        ready.wait()
        mine = times[r] = []
        for n in range(args.rounds):
            t0 = time.time()
            verdict, late = commit_mod._settle(
                info, 0, n, statement(r, args.size, n), time.monotonic() + TIMEOUT_S, TIMEOUT_S
            )
            mine.append((t0, time.time(), verdict.ok and not late))
            if not verdict.ok or late:
                print(r, n, late, verdict, file=sys.stderr)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(args.first, args.first + args.count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({str(r): v for r, v in times.items()}), flush=True)


def settler_cpu_ms(server: dist.TCPStore, size: int) -> float:
    """One multi_get of ``size`` statements, their decoding and the verdict, alone (median of 20)."""
    keys = commit_keys(group_name(size), 0, 10_000)
    wanted = [keys.arrival(r) for r in range(size)]
    for r in range(size):
        server.set(wanted[r], encode(statement(r, size, 10_000)))
    samples = []
    for _ in range(20):
        t0 = time.perf_counter()
        raw = server.multi_get(wanted)
        found = {r: decode(CommitStatement, b, "s", MAX_STATEMENT_BYTES) for r, b in enumerate(raw)}
        verdict = decide(found, size, 10_000, TIMEOUT_S)
        encode(verdict)
        samples.append((time.perf_counter() - t0) * 1e3)
    assert verdict.ok
    for key in wanted:
        server.delete_key(key)
    return statistics.median(samples)


def serial_round_ms(server: dist.TCPStore, size: int, rounds: int) -> float:
    """Every request of one round, issued by one client in sequence (median over ``rounds``): per
    rank ``set``, ``add``, ``wait``, ``get`` and the delete of its statement of the round before;
    the settler's ``multi_get``, verdict and ``compare_set``. The server's work of a round, without
    1,024 threads contending for 2 cores: what bounds a round where every rank has a core."""
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    name = f"serial{size}"
    info = GroupInfo(group=None, name=name, rank=0, size=size, backend="gloo", store=client)  # type: ignore[arg-type]
    samples = []
    for n in range(rounds):
        keys = commit_keys(name, 0, n)
        blobs = [
            encode(CommitStatement(rank=r, step=n, generation=0, group=name, group_size=size, seq=n))
            for r in range(size)
        ]
        rule = commit_mod._rule(client, info, 0, n, TIMEOUT_S)
        t0 = time.perf_counter()
        for r in range(size):
            client.set(keys.arrival(r), blobs[r])
            client.add(keys.count, 1)
        client.compare_set(keys.outcome, "", rule.everyone())
        for r in range(size):
            client.wait([keys.outcome], timedelta(seconds=TIMEOUT_S))
            verdict = rule.read(bytes(client.get(keys.outcome)))
            if n > 0:  # each rank's clean-up of the round before (commit._forget)
                prev = commit_keys(name, 0, n - 1)
                for key in [prev.arrival(r), *((prev.count, prev.gone, prev.outcome) if r == 0 else ())]:
                    client.delete_key(key)
        samples.append((time.perf_counter() - t0) * 1e3)
        assert verdict.ok
    return statistics.median(samples)


def run_size(server: dist.TCPStore, size: int, procs: int, rounds: int, warmup: int) -> dict[str, Any]:
    procs = min(procs, size)
    per = [size // procs + (1 if i < size % procs else 0) for i in range(procs)]
    firsts = [sum(per[:i]) for i in range(procs)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")])),
    }
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--port", str(server.port), "--size", str(size),
             "--first", str(first), "--count", str(count), "--rounds", str(rounds)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for first, count in zip(firsts, per, strict=True)
    ]  # fmt: skip
    times: dict[int, list[list[Any]]] = {}
    for child in children:
        out, _ = child.communicate(timeout=1800)
        if child.returncode != 0:
            raise RuntimeError(f"a worker exited {child.returncode}")
        times.update({int(r): v for r, v in json.loads(out.strip().splitlines()[-1]).items()})
    assert sorted(times) == list(range(size))
    walls, rank_ms, clean = [], [], True
    for n in range(warmup, rounds):
        entries = [times[r][n][0] for r in range(size)]
        exits = [times[r][n][1] for r in range(size)]
        walls.append((max(exits) - min(entries)) * 1e3)
        rank_ms.extend((times[r][n][1] - times[r][n][0]) * 1e3 for r in range(size))
        clean = clean and all(times[r][n][2] for r in range(size))
    walls.sort()
    return {
        "ranks": size,
        "procs": procs,
        "rounds_measured": rounds - warmup,
        "every_round_ok_on_every_rank": clean,
        "round_wall_ms_p50": round(statistics.median(walls), 3),
        "round_wall_ms_p90": round(walls[int(0.9 * (len(walls) - 1))], 3),
        "rank_ms_p50": round(statistics.median(rank_ms), 3),
        "settler_cpu_ms_p50": round(settler_cpu_ms(server, size), 3),
        "serial_round_ms_p50": round(serial_round_ms(server, size, max(rounds // 3, 3)), 3),
        "requests_per_rank": "5 (set, add, wait, get, delete); the settler: multi_get, compare_set for wait, get; rank 0: 3 deletes more",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if not 0 <= args.warmup < args.rounds:
        p.error("--warmup must be below --rounds")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    results = []
    for size in args.ranks:
        res = run_size(server, size, args.procs, args.rounds, args.warmup)
        print(json.dumps(res), flush=True)
        results.append(res)
    report = {
        "command": "python benchmarks/commit_cost.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "load_avg_after": os.getloadavg(),
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
