"""The node tier (issue 63) at 64 to 16,384 simulated ranks against one real TCPStore, beside the same
sizes without it.

    python benchmarks/node_tier_scale.py [--ranks 64 1024 4096 16384] [--modes tier direct] [--threads 8] \
        [--heartbeat 5] [--warm 2] [--window 4] [--counter relay] [--json benchmarks/results/node_tier_scale.json]

The job's store is torch's ``TCPStore`` server in a process of its own pinned to CPU 0 (as
``store_ceiling.py`` runs it), a fresh one per run. Everything else runs in one driver process pinned
to CPU 1, ``--threads`` threads, each with one TCPStore client of the job's store, wrapped in counting
proxies (``watchdog_scale.CountingStore``: one count for the agents' requests, one for the ranks').

- ``tier``: nodes of 8 ranks. Each node has its real
  :class:`~ncclguard.watching.base.node_agent.NodeAgent` (its ``beat()`` as the watchdog calls it) over
  a ``HashStore`` as the node's store; the agents of one thread share one ``WatchdogStore`` (the
  agent uses only its ``keys``, ``calls``, ``store``, ``put_value``, ``has_mark`` and ``warn_once``).
  Each simulated rank, once a beat, puts its ``member`` key and a ~1.5 KB heartbeat (a real
  :class:`~ncclguard.incidents.model.Heartbeat`'s JSON, with a straggler window) into its node's store
  and reads the incident counter at its beat and half a beat later, through its node
  (``--counter relay``, the default: the product's ``near_filing.RelayedCount``, one rank a node a
  window reading the job's store with ``add(count, 0)`` and copying it into the node's store), or
  twice at its beat from the job's store (``--counter job``, the tier before the relay).
- ``direct``: each simulated rank makes the watchdog's 6 requests itself on the job's store, as
  ``store_ceiling.py``'s loop does (``set`` its heartbeat, ``check`` + ``multi_get`` of its 16 next
  ranks, ``check`` of ``closing``, two counter reads), but once per heartbeat.

Every rank and every agent beats once per ``--heartbeat`` at its own offset, spread evenly over the
beat (real nodes are not in phase); a thread runs its share in due order and never skips: one that
falls behind runs late, and a beat started more than a heartbeat after it was due, or not started by
the window's end plus one heartbeat, counts its rank (or agent) as behind. Measured over ``--window``
beats after ``--warm``: job-store requests/s (agents and counter reads apart), requests per rank per
beat, the server's and the driver's CPU share of their core (and what other processes took of each
core: a shared machine's other jobs slow both), the p50/p99 of one agent beat, bytes per digest, the
fraction of the ceiling in ``results/store_ceiling.json``, and how late the beats ran.

Not simulated: a node's store as a TCPStore served by a rank's process (a ``HashStore`` here, so the
ranks' requests to it cost no socket), the ranks' reads of their peers there, their watchdogs'
threads and parsing, the agents as processes of their own (here 2,048 agents share one process and
its GIL, each with its helper thread), a network between hosts.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from a test: after all else, shadowing nothing
    sys.path.append(str(Path(__file__).resolve().parent))
from watchdog_scale import CountingStore  # the benchmarks' counting proxy, beside this file

LOCAL = 8  # ranks a node (a GPU node's 8)
WATCH_PEERS = 16  # WatchdogConfig.watch_peers's default
STORE_TIMEOUT_S = 5.0  # the watchdog's default store_timeout_s: min(heartbeat_s, 5)
GONE_AFTER_S = 30.0  # its default peer_timeout: 6 beats
CONNECT_S = 60.0  # a TCPStore client's connect and request timeout
SETUP_BOUND_S = 600.0  # the driver's imports, clients and nodes (seconds at 16,384 ranks)
T0_AHEAD_S = 2.0
# A thread sleeps only when its next unit is due this much later: what is due sooner runs now. A
# sleep per unit (thousands a second, 8 threads) throttled the driver to half the 16,384 direct ranks'
# pace with its core a third busy (GIL hand-offs at each wake-up); 20 ms is nothing in a 5 s beat.
QUANTUM_S = 0.02  # the schedule starts this long after the setup ends
CEILING = Path(__file__).resolve().parent / "results" / "store_ceiling.json"
BEAT_MARK, TIME_MARK = 987_654_321, 1_111_111_111.25  # stand-ins in a heartbeat's template


def _pin(cpus: set[int]) -> None:
    if hasattr(os, "sched_setaffinity") and cpus:
        os.sched_setaffinity(0, cpus)


def _client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=CONNECT_S))


def heartbeat_template(rank: int) -> tuple[str, str]:
    """A realistic heartbeat of ``rank`` as published (~1.5 KB of JSON), split where its beat goes;
    :func:`heartbeat_text` puts a beat and a time in (a model's encode per beat costs ~15 us)."""
    from ncclguard.incidents.model import Heartbeat
    from ncclguard.store.codec import encode

    now, groups = TIME_MARK, {"0": 184_213, "1": 9_211, "2": 9_207}
    site = "/workspace/model/trainer.py:412"
    # fmt: off
    op = {"seq": 184_214, "op": "all_reduce", "group": "0", "numel": 26_214_400, "dtype": "torch.bfloat16",
          "start": now - 0.5, "phase": "train", "site": site, "thread": 140_235_114_518_336, "async_op": True}
    window = {"n": 4_821, "end": now - 1, "length_s": 10.0, "compute_s": 7.31, "wait_s": 2.62, "ops": 1_312,
              "op_wait_s": 0.0043, "transfer_ops": 640, "steps": 12, "run_delay_s": 0.012, "phase": "train",
              "op": "all_reduce", "backend_op": "nccl:all_reduce", "input_s": 0.02, "clock_offset_s": 0.0003,
              "arrivals": [(412_700 + i, now - 11 + 1.21 * i) for i in range(8)]}
    fields = {"rank": rank, "host": f"gpu-node-{rank // LOCAL:05d}", "pid": 200_000 + rank, "beat": BEAT_MARK,
              "time": now, "address": f"10.12.{rank // 2048}.{rank // LOCAL % 256}", "phase": "train", "site": site,
              "last_seq": groups, "last_completed": groups, "inflight": [op], "backend_seq": {"0": 412_733, "1": 20_117},
              "backend_still": {"0": 0.004, "1": 0.41}, "step": 48_213, "straggler_score": 0.97, "window": window,
              "main_cpu_s": 81_233.42, "io_bytes": 38_112_443_392, "net_bytes": 1_223_456_789_012, "hang_bound_s": 42.5,
              "children_cpu": [(200_100 + i, 812.5 + i) for i in range(4)]}
    # fmt: on
    hb = Heartbeat.model_validate(fields)
    text = encode(hb).replace(f'"time":{now}', f'"time":{TIME_MARK!r}')
    head, tail = text.split(f'"beat":{BEAT_MARK}', 1)
    if tail.count(repr(TIME_MARK)) != 1:
        raise RuntimeError("the heartbeat's encoding changed: its time is not where the template looks")
    return head + '"beat":', tail


def heartbeat_text(template: tuple[str, str], beat: int, now: float) -> str:
    """The heartbeat of ``template`` at ``beat`` and ``now`` (valid JSON of the model)."""
    return f"{template[0]}{beat}{template[1].replace(repr(TIME_MARK), repr(round(now, 3)), 1)}"


class SimNode:
    """One node of the tier: its store (a ``HashStore``), its real agent, its 8 simulated ranks.

    Args:
        node: the node's number.
        nodes: the job's nodes.
        job: the watchdog store of the job through which the agent talks (shared by a thread's agents).
    """

    def __init__(self, node: int, nodes: int, job: Any) -> None:
        import torch.distributed as dist

        from ncclguard.watching.base.node_agent import NodeAgent
        from ncclguard.watching.base.node_layout import NodeLayout

        self.node, self.keys = node, job.keys
        self.near: Any = dist.HashStore()  # Any: torch's stubs lack its multi_set
        self.agent = NodeAgent(NodeLayout(node, nodes, 0, LOCAL), WATCH_PEERS, job, self.near)
        self.ranks = list(range(node * LOCAL, (node + 1) * LOCAL))
        self.templates = [heartbeat_template(r) for r in self.ranks]

    def publish(self, local_rank: int, beat: int) -> None:
        """What a rank's ``TieredWatchdogStore.publish_heartbeat`` puts into its node's store."""
        rank = self.ranks[local_rank]
        text = heartbeat_text(self.templates[local_rank], beat, time.time())
        self.near.multi_set([self.keys.member(local_rank), self.keys.heartbeat(rank)], [str(rank), text])


def counter_reads(client: Any, keys: Any) -> None:
    """A rank's two reads of the incident counter in a beat (the watchdog reads it every half beat)."""
    client.add(keys.count, 0)
    client.add(keys.count, 0)


class NodeCounter:
    """What :class:`~ncclguard.watching.base.near_filing.RelayedCount` uses of a rank's
    ``TieredWatchdogStore``, for a simulated node: the keys, the node's store (its ``HashStore``,
    which answers at once), the job's counter read through the thread's counting client.

    Args:
        near: the node's store.
        client: the thread's counting client of the job's store.
        keys: the key schema.
    """

    def __init__(self, near: Any, client: Any, keys: Any) -> None:
        self.near, self.client, self.keys = near, client, keys

    def on_near(self, fn: Callable[[Any], Any], what: str) -> tuple[bool, Any]:
        return True, fn(self.near)

    def job_incident_count(self) -> int:
        return int(self.client.add(self.keys.count, 0))

    def warn_once(self, key: str, text: str) -> None:
        raise RuntimeError(f"{key}: {text}")


def direct_beat(client: Any, keys: Any, rank: int, world: int, text: str) -> None:
    """A rank's 6 requests a beat without the tier (``store_ceiling.py``'s loop; ``read_present``)."""
    peers = [keys.heartbeat((rank + k) % world) for k in range(1, WATCH_PEERS + 1)]
    client.set(keys.heartbeat(rank), text)
    if client.check(peers):
        client.multi_get(peers)
    else:  # a missing peer: one check each, as read_present does (not in the window: all are set first)
        present = [k for k in peers if client.check([k])]
        if present:
            client.multi_get(present)
    client.check([keys.closing])
    counter_reads(client, keys)


Unit = tuple[float, str, int, Callable[[int], None]]  # (offset in the beat, "rank"/"agent", id, beat(n))


def _tier_units(
    nodes: int, clients: list[Any], keys: Any, hb: float, relay: bool
) -> tuple[list[list[Unit]], list[Any], list[SimNode]]:
    """Each thread's units of the tier, their counters ([agents, counter reads] per thread), the
    nodes. With ``relay``, each rank reads the counter through its node (the product's
    ``RelayedCount``, windows of half a beat, at most 1 s) at its beat and half a beat later (a
    ``read`` unit); without, twice from the job's store at its beat."""
    from ncclguard.watching.base.near_filing import RelayedCount
    from ncclguard.watching.base.watchdog_store import WatchdogStore

    threads, world = len(clients), nodes * LOCAL
    counts = [([0], [0]) for _ in clients]
    jobs = [
        WatchdogStore(CountingStore(c, a), keys, STORE_TIMEOUT_S, GONE_AFTER_S)
        for c, (a, _) in zip(clients, counts, strict=True)
    ]
    reads = [CountingStore(c, r) for c, (_, r) in zip(clients, counts, strict=True)]
    sim = [SimNode(n, nodes, jobs[n % threads]) for n in range(nodes)]
    plans: list[list[Unit]] = [[] for _ in clients]
    for n, node in enumerate(sim):
        t = n % threads  # a node's agent and ranks on one thread: its agent's shared WatchdogStore is that thread's

        def agent_beat(_b: int, agent: Any = node.agent) -> None:
            if not agent.beat():  # it logged why; counted as an error of the run
                raise RuntimeError(f"node {agent.layout.node}'s agent missed its beat")

        plans[t].append(((n + 0.5) * hb / nodes, "agent", n, agent_beat))
        counter = RelayedCount(NodeCounter(node.near, reads[t], keys), min(hb / 2, 1.0))  # type: ignore[arg-type]
        for lr, rank in enumerate(node.ranks):
            client = reads[t]

            def rank_beat(
                b: int, node: SimNode = node, lr: int = lr, client: Any = client, counter: RelayedCount = counter
            ) -> None:
                node.publish(lr, b + 1)
                if relay:
                    counter.read()
                else:
                    counter_reads(client, keys)

            def half_beat(_b: int, counter: RelayedCount = counter) -> None:
                counter.read()

            plans[t].append((rank * hb / world, "rank", rank, rank_beat))
            if relay:
                plans[t].append((rank * hb / world + hb / 2, "read", rank, half_beat))
    return plans, counts, sim


def _direct_units(world: int, clients: list[Any], keys: Any, hb: float) -> tuple[list[list[Unit]], list[Any]]:
    """Each thread's ranks without the tier, and their counters; every heartbeat set first."""
    threads = len(clients)
    counts = [([0], [0]) for _ in clients]
    stores = [CountingStore(c, r) for c, (_, r) in zip(clients, counts, strict=True)]
    templates = {r: heartbeat_template(r) for r in range(world)}
    for lo in range(0, world, 512):
        ranks = range(lo, min(world, lo + 512))
        clients[0].multi_set(
            [keys.heartbeat(r) for r in ranks], [heartbeat_text(templates[r], 0, time.time()) for r in ranks]
        )
    plans: list[list[Unit]] = [[] for _ in clients]
    for rank in range(world):
        t = rank % threads

        def rank_beat(b: int, rank: int = rank, client: Any = stores[t]) -> None:
            direct_beat(client, keys, rank, world, heartbeat_text(templates[rank], b + 1, time.time()))

        plans[t].append((rank * hb / world, "rank", rank, rank_beat))
    return plans, counts


def _run_plan(plan: list[Unit], t0: float, hb: float, w0: float, w1: float, out: dict[str, Any]) -> None:
    """Runs one thread's units in due order until the window's end; records lateness and agent beats."""
    plan = sorted(plan, key=lambda u: u[0])
    lags: dict[str, list[float]] = {"rank": [], "agent": [], "read": []}
    worst: dict[tuple[str, int], float] = {}
    done: dict[tuple[str, int], int] = {}
    agent_s: list[float] = []
    errors: list[str] = []
    out.update(lags=lags, worst=worst, done=done, agent_s=agent_s, errors=errors)  # filled in place
    stop_at = w1 + hb  # a late thread gets one more beat to start what was due in the window
    beat = 0
    while plan:  # none: more threads than nodes
        for offset, kind, ident, fn in plan:
            due = t0 + beat * hb + offset
            if due >= w1 or time.time() >= stop_at:
                return
            start = time.time()
            if due > start + QUANTUM_S:
                time.sleep(due - start)
                start = time.time()
            try:
                fn(beat)
            except Exception as exc:  # noqa: BLE001 - counted and reported; the run goes on
                if len(errors) < 20:
                    errors.append(f"{kind} {ident}: {type(exc).__name__}: {str(exc)[:200]}")
            if due >= w0:
                lag = max(0.0, start - due)  # a unit run early (within QUANTUM_S) is on time
                lags[kind].append(lag)
                key = (kind, ident)
                worst[key] = max(worst.get(key, 0.0), lag)
                done[key] = done.get(key, 0) + 1
                if kind == "agent":
                    agent_s.append(time.time() - start)
        beat += 1


def _digest_bytes(client: Any, keys: Any, nodes: int) -> dict[str, Any]:
    """Bytes of the digests of the first 64 nodes, as the job's store holds them."""
    wanted = [keys.digest(n) for n in range(min(nodes, 64))]
    if not client.check(wanted):
        return {"mean": None, "max": None, "nodes": 0}
    sizes = [len(bytes(v)) for v in client.multi_get(wanted)]
    return {"mean": round(statistics.mean(sizes)), "max": max(sizes), "nodes": len(sizes)}


def _merge(results: list[dict[str, Any]], units: dict[str, int], hb: float, window: int) -> dict[str, Any]:
    """The threads' records together, and the ranks and agents behind: a beat started over a
    heartbeat late, or fewer than ``window`` beats started in the window."""
    merged: dict[str, Any] = {"lags": {"rank": [], "agent": [], "read": []}, "worst": {}, "done": {}, "agent_s": []}
    merged["errors"] = []
    for r in results:
        for kind in ("rank", "agent", "read"):
            merged["lags"][kind] += r["lags"][kind]
        for name in ("worst", "done"):
            merged[name].update(r[name])
        merged["agent_s"] += r["agent_s"]
        merged["errors"] += r["errors"]
    merged["behind"] = {
        k: len(
            {i for (kind, i), w in merged["worst"].items() if kind == k and w > hb}
            | {i for i in range(n) if merged["done"].get((k, i), 0) < window}
        )
        for k, n in units.items()
    }
    return merged


def _driver(
    mode: str, world: int, port: int, threads: int, hb: float, warm: int, window: int, relay: bool, out: Any
) -> None:
    """The driver process: builds the units, announces the window, runs it, sends what it measured."""
    _pin({1} if (os.cpu_count() or 1) > 1 else {0})
    from ncclguard.store.keys import Keys

    setup0 = time.time()
    keys = Keys(f"tier-scale-{mode}-{world}")
    clients = [_client(port) for _ in range(threads)]
    nodes, sim = world // LOCAL, list[SimNode]()
    if mode == "tier":
        plans, counts, sim = _tier_units(nodes, clients, keys, hb, relay)
    else:
        plans, counts = _direct_units(world, clients, keys, hb)
    t0 = time.time() + T0_AHEAD_S
    w0, w1 = t0 + warm * hb, t0 + (warm + window) * hb
    out.put({"window": (w0, w1), "setup_s": round(time.time() - setup0, 2)})
    snaps: list[tuple[int, int]] = []

    def snapshot() -> None:  # the counters at the window's start and end
        for at in (w0, w1):
            time.sleep(max(0.0, at - time.time()))
            snaps.append((sum(a[0] for a, _ in counts), sum(r[0] for _, r in counts)))

    results: list[dict[str, Any]] = [{} for _ in plans]
    pool = [
        threading.Thread(target=_run_plan, args=(p, t0, hb, w0, w1, r)) for p, r in zip(plans, results, strict=True)
    ]
    pool.append(threading.Thread(target=snapshot))
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    agents, ranks = snaps[1][0] - snaps[0][0], snaps[1][1] - snaps[0][1]
    units = {"rank": world, "agent": nodes if mode == "tier" else 0}
    if mode == "tier" and relay:
        units["read"] = world
    merged = _merge(results, units, hb, window)
    out.put(
        {
            "agent_requests": agents,
            "rank_requests": ranks,
            "beats_done": {k: len(v) for k, v in merged["lags"].items()},
            "beats_due": {k: n * window for k, n in units.items()},
            "lag_ms": {k: _pcts(v) for k, v in merged["lags"].items() if v},
            "behind": merged["behind"],
            "agent_beat_ms": _pcts(merged["agent_s"]),
            "digest_bytes": _digest_bytes(clients[0], keys, nodes) if mode == "tier" else None,
            "heartbeat_bytes": len(heartbeat_text(heartbeat_template(world - 1), 1, time.time())),
            "errors": merged["errors"][:20],
            "driver_rss_mib": round(psutil.Process().memory_info().rss / 2**20),
        }
    )
    for node in sim:
        node.agent.close()


def _pcts(values: list[float]) -> dict[str, float] | None:
    """p50, p99 and max of seconds, in ms."""
    if not values:
        return None
    s = sorted(values)
    at = {"p50": len(s) // 2, "p99": int(0.99 * (len(s) - 1)), "max": -1}
    return {name: round(1e3 * s[k], 3) for name, k in at.items()}


def _server(port_out: Any, stop: Any) -> None:
    import torch.distributed as dist

    _pin({0})
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=CONNECT_S)
    )
    port_out.put(store.port)
    stop.wait()


def _busy() -> list[float]:
    """CPU 0's and CPU 1's busy seconds so far (``/proc/stat``; empty elsewhere)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return []
    tick, out = os.sysconf("SC_CLK_TCK"), []
    for cpu in ("cpu0", "cpu1"):
        f = next(([int(x) for x in line.split()[1:]] for line in lines if line.startswith(cpu + " ")), None)
        if f is not None:
            out.append((sum(f[:8]) - f[3] - f[4]) / tick)  # all but idle and iowait (guest time is in user)
    return out


def run_one(mode: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run (a fresh server): the driver's figures, the CPU shares over the window, the row."""
    ctx = mp.get_context("spawn")
    port_q, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_server, args=(port_q, stop), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=SETUP_BOUND_S)
        drv = ctx.Process(
            target=_driver,
            args=(
                mode,
                world,
                port,
                args.threads,
                args.heartbeat,
                args.warm,
                args.window,
                args.counter == "relay",
                out,
            ),
        )
        drv.start()
        hello = out.get(timeout=SETUP_BOUND_S)
        w0, w1 = hello["window"]
        procs = [psutil.Process(p) for p in (server.pid, drv.pid) if p is not None]
        time.sleep(max(0.0, w0 - time.time()))
        cpu0, t0, busy0 = [p.cpu_times() for p in procs], time.perf_counter(), _busy()
        time.sleep(max(0.0, w1 - time.time()))
        cpu1, t1, busy1 = [p.cpu_times() for p in procs], time.perf_counter(), _busy()
        load = os.getloadavg()[0]  # the machine's 1-minute load at the window's end: other jobs share it
        got = out.get(timeout=2 * args.heartbeat + SETUP_BOUND_S)
        drv.join(timeout=60)
    finally:
        stop.set()
        server.join(timeout=30)
    shares = [round((b.user + b.system - a.user - a.system) / (t1 - t0), 3) for a, b in zip(cpu0, cpu1, strict=True)]
    row = _row(mode, world, args, got, shares) | {"setup_s": hello["setup_s"]}
    # What other processes took of the server's core and of the driver's: this machine is shared.
    cores = [round((b - a) / (t1 - t0) - own, 3) for a, b, own in zip(busy0, busy1, shares, strict=False)]
    row["others_cpu_share"] = {"server_core": cores[0], "driver_core": cores[1] if len(cores) > 1 else None}
    row["load_1min"] = round(load, 2)
    return row


def _row(mode: str, world: int, args: argparse.Namespace, got: dict[str, Any], shares: list[float]) -> dict[str, Any]:
    seconds = args.window * args.heartbeat
    total = got["agent_requests"] + got["rank_requests"]
    done = got["beats_done"]
    row = {
        "mode": mode,
        "counter": args.counter if mode == "tier" else "job",
        "ranks": world,
        "nodes": world // LOCAL if mode == "tier" else None,
        "requests_per_s": round(total / seconds, 1),
        "agent_requests_per_s": round(got["agent_requests"] / seconds, 1),
        "rank_requests_per_s": round(got["rank_requests"] / seconds, 1),
        "requests_per_rank_per_beat": round(total / (world * args.window), 3),
        "per_agent_beat": round(got["agent_requests"] / done["agent"], 3) if done["agent"] else None,
        "per_rank_beat": round(got["rank_requests"] / done["rank"], 3) if done["rank"] else None,
        "fraction_of_ceiling": round(total / seconds / args.ceiling, 4) if args.ceiling else None,
        "server_cpu_share": shares[0],
        "driver_cpu_share": shares[1] if len(shares) > 1 else None,
        "agent_beat_ms": got["agent_beat_ms"],
        "digest_bytes": got["digest_bytes"],
        "heartbeat_bytes": got["heartbeat_bytes"],
        "beats_due": got["beats_due"],
        "beats_done": done,
        "lag_ms": got["lag_ms"],
        "behind": got["behind"],
        "kept_pace": all(v == 0 for v in got["behind"].values()) and not got["errors"],
        "errors": got["errors"],
        "driver_rss_mib": got["driver_rss_mib"],
    }
    return row


def _ceiling() -> float | None:
    try:
        return float(json.loads(CEILING.read_text())["ceiling_requests_per_s"])
    except (OSError, ValueError, KeyError):
        return None


def _line(r: dict[str, Any]) -> str:
    agent = r["agent_beat_ms"] or {}
    digest = (r["digest_bytes"] or {}).get("mean")
    return (
        f"{r['mode']:>6} {r['ranks']:>6} ranks: {r['requests_per_s']:>9.1f} req/s (agents {r['agent_requests_per_s']:.1f}, "
        f"ranks {r['rank_requests_per_s']:.1f}), {r['requests_per_rank_per_beat']:.3f}/rank/beat, "
        f"{r['fraction_of_ceiling']} of ceiling, server cpu {r['server_cpu_share']}, driver cpu {r['driver_cpu_share']} "
        f"(others {r['others_cpu_share']}), "
        f"agent beat p50/p99 {agent.get('p50')}/{agent.get('p99')} ms, digest {digest} B, behind {r['behind']}, "
        f"kept pace {r['kept_pace']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--modes", nargs="+", choices=["tier", "direct"], default=["tier", "direct"])
    ap.add_argument("--threads", type=int, default=8, help="driver threads (one job-store client each)")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="heartbeat_s (the watchdog's default 5)")
    ap.add_argument("--warm", type=int, default=2, help="beats before the window")
    ap.add_argument("--window", type=int, default=4, help="beats measured")
    ap.add_argument(
        "--counter",
        choices=["relay", "job"],
        default="relay",
        help="tier: the incident counter read through each node (the product's RelayedCount), or from the job's store",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if any(n < 2 * LOCAL or n % LOCAL for n in args.ranks) or args.threads < 1 or args.warm < 1 or args.window < 1:
        ap.error(f"--ranks must be multiples of {LOCAL} from {2 * LOCAL}; --threads, --warm and --window >= 1")
    args.ceiling = _ceiling()
    rows = []
    for world in args.ranks:
        for mode in args.modes:
            row = run_one(mode, world, args)
            print("node_tier_scale:", _line(row), flush=True)
            rows.append(row)
    doc = {
        "rows": rows,
        "ceiling_requests_per_s": args.ceiling,
        "settings": {k: getattr(args, k) for k in ("heartbeat", "warm", "window", "threads")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_after": os.getloadavg()},
        "command": " ".join(["python", "benchmarks/node_tier_scale.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
