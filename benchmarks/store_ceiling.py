"""The ceiling of one TCPStore server on a core of its own, under the watchdog's mix of requests (issue 63).

    python benchmarks/store_ceiling.py [--seconds 6] [--clients 1 2 4 8 16 32] [--procs 4] [--hb-bytes 2048] \
        [--json benchmarks/results/store_ceiling.json]

docs/scale.md sizes a job against "what one store carries"; this measures it. The server (torch's
``TCPStore``, ``is_master=True``, torch's default backend) runs in a process of its own pinned to CPU
0; the clients run in ``--procs`` processes pinned to the other CPUs, each with its share of
``--clients`` threads and one TCPStore client per thread (torch releases the GIL inside a store
call). Each thread repeats one simulated rank's heartbeat as the watchdog makes it
(``ncclguard/watching/world_watch.py``; 6 requests, ``benchmarks/results/watchdog_scale_counter_halfbeat.json``):

- ``set`` its heartbeat (``--hb-bytes`` of JSON-like bytes),
- ``check`` then ``multi_get`` of 16 watched peers' heartbeats,
- ``check`` of the store's ``closing`` mark,
- two reads of the incident counter (``add`` of 0: what the watchdog's counter read is),

with no pause, so the server is offered more than it serves. Reported per client count: requests
served per second (all clients together), the server's CPU use over the window (a share of its one
core: near 1.0 means the server, not the clients, is the limit), and the p50 and p99 of a
heartbeat's six requests as one client saw them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

WATCHED = 16  # the watchdog's default watch_peers
START_S = 20.0  # the clients' processes import torch and connect before the common window opens


def _pin(cpus: set[int]) -> None:
    if hasattr(os, "sched_setaffinity") and cpus:
        os.sched_setaffinity(0, cpus)


def _server(port_out: Any, stop: Any) -> None:
    import torch.distributed as dist

    _pin({0})
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    port_out.put(store.port)
    stop.wait()


def _client_proc(
    port: int, threads: int, first: int, total: int, start_at: float, seconds: float, hb_bytes: int, out: Any
) -> None:
    import torch.distributed as dist

    cpus = set(range(1, os.cpu_count() or 2)) or {0}
    _pin(cpus)
    blob = b'{"rank":0,"beat":1,"pad":"' + b"x" * max(0, hb_bytes - 30) + b'"}'
    results: list[tuple[int, list[float]]] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        peers = [f"hb/{(rank + k) % total}" for k in range(1, WATCHED + 1)]
        store.set(f"hb/{rank}", blob)
        time.sleep(max(0.0, start_at - time.time()))  # every client's window is the same wall-clock one
        end = start_at + seconds
        n, beats = 0, []
        while time.time() < end:
            t0 = time.perf_counter()
            store.set(f"hb/{rank}", blob)
            if store.check(peers):  # the watchdog reads what is present: every peer beats here
                store.multi_get(peers)
            store.check(["closing"])
            store.add("incidents", 0)
            store.add("incidents", 0)
            n += 6
            beats.append(time.perf_counter() - t0)
        with lock:
            results.append((n, beats))

    pool = [threading.Thread(target=run, args=(first + i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put(results)


def measure(port: int, server_pid: int, clients: int, procs: int, seconds: float, hb_bytes: int) -> dict[str, Any]:
    """One window of ``clients`` threads over ``procs`` processes against the server."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + START_S
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    shares = [s for s in shares if s]
    firsts = [sum(shares[:i]) for i in range(len(shares))]
    workers = [
        ctx.Process(target=_client_proc, args=(port, s, f, clients, start_at, seconds, hb_bytes, out))
        for s, f in zip(shares, firsts, strict=True)
    ]
    server = psutil.Process(server_pid)
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, t0 = server.cpu_times(), time.perf_counter()
    time.sleep(seconds)
    cpu1, t1 = server.cpu_times(), time.perf_counter()
    got = [out.get(timeout=seconds + START_S + 120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    requests = sum(n for part in got for n, _ in part)
    beats = sorted(b for part in got for _, bs in part for b in bs)
    busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {
        "clients": clients,
        "requests_per_s": round(requests / seconds, 1),
        "server_cpu_share": round(busy / (t1 - t0), 3),
        "beat_p50_ms": round(1e3 * statistics.median(beats), 3) if beats else None,
        "beat_p99_ms": round(1e3 * beats[int(0.99 * (len(beats) - 1))], 3) if beats else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="each window's length")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--procs", type=int, default=4, help="client processes (threads are spread over them)")
    ap.add_argument("--hb-bytes", type=int, default=2048, help="a heartbeat's size")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if any(c < 1 for c in args.clients) or args.procs < 1 or args.seconds <= 0 or args.hb_bytes < 32:
        ap.error("--clients and --procs must be >= 1, --seconds > 0, --hb-bytes >= 32")
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_server, args=(port_q, stop), daemon=True)
    server.start()
    port = port_q.get(timeout=120)
    assert server.pid is not None
    rows = []
    try:
        for c in args.clients:
            row = measure(port, server.pid, c, min(args.procs, c), args.seconds, args.hb_bytes)
            print("store_ceiling:", json.dumps(row), flush=True)
            rows.append(row)
    finally:
        stop.set()
        server.join(timeout=30)
    best = max(rows, key=lambda r: r["requests_per_s"])
    doc = {
        "rows": rows,
        "ceiling_requests_per_s": best["requests_per_s"],
        "at_clients": best["clients"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_after": os.getloadavg()},
        "command": " ".join(["python", "benchmarks/store_ceiling.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    print("store_ceiling: ceiling", best["requests_per_s"], "requests/s at", best["clients"], "clients")
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
