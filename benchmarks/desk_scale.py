"""A desync's incident in the job's store at 64 to 16,384 simulated ranks (issue 63: "a desync named
within ``hang_timeout_s`` + 2 beats"): every rank's statement in, the merging rank's read and
analysis, and its report on disk.

    python benchmarks/desk_scale.py [--ranks 64 1024 4096 16384] [--procs 4] [--modes flat tier] \
        [--together] [--json benchmarks/results/desk_scale.json]

The job's store is torch's ``TCPStore`` server in a process of its own pinned to CPU 0
(``node_tier_scale._server``), a fresh one per size. The ranks are simulated; the incident's part
in the store is ncclguard's own code:

1. **Set-up (not timed).** Each rank's heartbeat (``node_tier_scale.heartbeat_template``, ~1.5 KB)
   is in the store, as the watchdogs leave them.
2. **Statements.** ``--procs`` client processes pinned to CPU 1 each play their share of the ranks
   (whole nodes of 8), in one of two modes (``--modes``): ``flat``, each rank's
   :meth:`WatchdogStore.file_statement` (its statement, its count, its claim to merge), as each
   rank's desk does without the node tier; ``tier``, each node's carrier's part in the job's store
   (``near_filing.carry_to_job``: its 8 ranks' statements in one request, their count, its claim),
   as with the node tier (the node's own store is not simulated). The statement is what a rank of
   a job with data and tensor parallelism says: waiting in an all_reduce of the world group (rank
   ``n // 3`` one op behind, in ``eval``), a 30-frame stack, its 20 recent ops, its 16 watched
   peers, and its groups' ranks: the world's ``n``, its data-parallel group's ``n / 8``, its
   tensor-parallel group's 8 (what ``RankState.groups`` reads from torch). The statements are
   encoded before the clock starts.
3. **The merge.** One client process does what ``Merger.merge`` does, with the product's own
   functions and store-call bound (``store_timeout_s``: 5 s at the default heartbeat):
   ``merging.gather`` (each rank's statement, or above 1,024 ranks each rank's head, and the
   heartbeats of the ranks that said nothing), :func:`ncclguard.incidents.assemble.assemble`, which
   names the culprit, ``merging.whole_of`` (above 1,024 ranks: the whole statements of the culprits
   and of a few victims), and ``cases.write_report`` (``incident.json`` and ``summary.txt`` into a
   temporary directory). A read past its bound is reported as such (the desk would try again at
   its next tick). With ``--together`` (end to end), the merger is there from the start: it looks
   at the count at the watchdog's tick (0.5 s) until every rank is counted, as the desk does, and
   ``end_to_end_s`` is from the start signal to its report on disk.

Measured per size: the bytes of a statement as stored (above 1,024 ranks ``put_statement`` keeps
its newest 4 ops and innermost 12 frames, and puts its head beside it), the statements' wall time
(from the start signal to the last client's last count; ``statements_client_s``: the slowest
client's own loop) and the store's CPU seconds for them, the merge's read, analysis, whole
statements, report writing and wall time, the culprit it named, and the report's size.

The harness's first runs (``desk_scale_before.json``, ``desk_scale_full_statements.json``, and
``desk_scale_20261129.json``) also timed one follower (a node's first rank on another host
reading every statement again to copy the report); a follower copies only in a world of at most
``merging.COPY_MAX_RANKS`` (1,024) ranks since, and this harness no longer plays it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from node_tier_scale import _client, _pin, _server, heartbeat_template  # the same server, pinned the same way

PER_NODE = 8
INCIDENT = 3  # the incident's number in the store
STORE_TIMEOUT_S = 5.0  # the product's store_timeout_s at the default 5 s heartbeat
SETUP_BOUND_S = 600.0  # hang guard of a phase (16,384 ranks' set-up takes tens of seconds here)
TICK_S = 0.5  # the watchdog's tick at the default 5 s heartbeat (min(heartbeat_s / 5, 0.5)): the merger's looks
GROUP_SEQ = 184_213  # the world group's op every rank but the culprit waits in


def statement(rank: int, size: int, now: float) -> Any:
    """What ``rank`` of a ``size``-rank job says on a desync (the module doc, step 2)."""
    from ncclguard.incidents.model import BackendOp, OpRecord, PeerView, Statement

    behind = rank == size // 3
    seq = GROUP_SEQ - 1 if behind else GROUP_SEQ
    site = "/workspace/model/eval.py:88" if behind else "/workspace/model/trainer.py:412"
    phase = "eval" if behind else "train"

    def op(s: int, state: str = "completed") -> OpRecord:
        return OpRecord(
            seq=s,
            op="all_reduce",
            group="0",
            numel=26_214_400,
            dtype="torch.bfloat16",
            start=now - (GROUP_SEQ - s) * 0.4,
            state=state,
            end=None if state == "started" else now - (GROUP_SEQ - s) * 0.4 + 0.05,
            phase=phase,
            site=site,
            thread=140_235_114_518_336,
            async_op=True,
        )

    dp = rank % PER_NODE  # the data-parallel group: the ranks of one local rank across the nodes
    groups = {"0": list(range(size)), "1": list(range(dp, size, PER_NODE))}
    groups["2"] = list(range(rank - rank % PER_NODE, rank - rank % PER_NODE + PER_NODE))
    peers = {str((rank + i) % size): PeerView(age_s=0.8, stale=False, seen=True) for i in range(1, 17)}
    stack = [
        f"/workspace/lib/python3.12/site-packages/torch/nn/modules/module.py:{1700 + i} in _call_impl"
        for i in range(29)
    ]
    return Statement(
        rank=rank,
        host=f"gpu-node-{rank // PER_NODE:05d}",
        pid=200_000 + rank,
        beat=912,
        address=f"10.12.{rank // 2048}.{rank // PER_NODE % 256}",
        time=now,
        phase=phase,
        site=site,
        last_seq={"0": seq, "1": 9_211, "2": 9_207},
        last_completed={"0": GROUP_SEQ - 1, "1": 9_211, "2": 9_207},
        inflight=[] if behind else [op(GROUP_SEQ, "started")],
        backend_seq={"0": seq, "1": 9_211, "2": 9_207},
        step=4_821,
        world_size=size,
        stack=[*stack, f"{site} in {'evaluate' if behind else 'train_step'}"],
        recent=[op(GROUP_SEQ - 20 + i) for i in range(20)],
        groups=groups,
        peers=peers,
        backend_ops={
            "0": BackendOp(seq=seq, name="nccl:all_reduce", sizes=[[26_214_400]], dtypes=["BFloat16"], created=now - 1)
        },
    )


def _store(port: int) -> Any:
    from ncclguard.store.keys import Keys
    from ncclguard.watching.base.watchdog_store import WatchdogStore

    return WatchdogStore(_client(port), Keys("main"), STORE_TIMEOUT_S, 600.0)


def _setup(port: int, share: list[int]) -> None:
    """The ranks' heartbeats in the store, as the watchdogs leave them."""
    _pin({1})
    client = _client(port)
    from ncclguard.store.keys import Keys

    keys = Keys("main")
    for lo in range(0, len(share), 512):
        part = share[lo : lo + 512]
        texts = []
        for r in part:
            head, tail = heartbeat_template(r)
            texts.append(f"{head}912{tail}")
        client.multi_set([keys.heartbeat(r) for r in part], texts)


def _stater(port: int, size: int, share: list[int], mode: str, ready: Any, go: Any, out: Any, end: Any) -> None:
    """One client process's share of the ranks filing their statements: ``flat``, each rank's
    ``file_statement`` (its statement, its count, its claim to merge); ``tier``, each node's carrier
    taking its 8 ranks' statements to the job's store (``near_filing.carry_to_job``: one request of
    them all, the count, the claim; the node's own store is not simulated)."""
    _pin({1})
    from ncclguard.watching.base.near_filing import carry_to_job

    store = _store(port)
    now = time.time()
    said = [statement(r, size, now) for r in share]
    nodes: list[list[Any]] = [said[i : i + PER_NODE] for i in range(0, len(said), PER_NODE)]
    carried = [[it for s in node for it in store.statement_items(INCIDENT, s)] for node in nodes]
    ready.put(len(said))
    go.wait()
    t0 = time.perf_counter()
    if mode == "flat":
        for s in said:
            store.file_statement(INCIDENT, s)
    else:
        for node, items in zip(nodes, carried, strict=True):
            carry_to_job(store, INCIDENT, items, len(node), node[0].rank, size)
    seconds = time.perf_counter() - t0
    nbytes = len(store.store.get(store.keys.statement(INCIDENT, share[0])))  # as stored (statement_items' cuts)
    head = store.keys.head(INCIDENT, share[0])
    head_bytes = len(store.store.get(head)) if store.store.check([head]) else 0  # above 1,024 ranks
    out.put({"seconds": seconds, "bytes": nbytes, "head_bytes": head_bytes})
    end.wait(SETUP_BOUND_S)  # its exit (an interpreter with torch) off the merger's core while it merges
    store.close()


def _gather(store: Any, size: int) -> dict[str, Any]:
    """What the ranks said, read as the merger reads it (``merging.gather``: above 1,024 ranks each
    rank's head, and the heartbeats of the ranks that said nothing)."""
    from ncclguard.errors import StoreTimeout, StoreUnreachable
    from ncclguard.watching.desk.merging import gather

    t0 = time.perf_counter()
    try:
        said, heartbeats, heads = gather(store, INCIDENT, size)
    except (StoreTimeout, StoreUnreachable) as exc:
        return {"error": f"gather: {type(exc).__name__}: {str(exc)[:200]}", "read_s": time.perf_counter() - t0}
    return {"said": said, "heartbeats": heartbeats, "heads": heads, "read_s": time.perf_counter() - t0}


def _merger(port: int, size: int, where: str, out: Any, go: Any = None, ready: Any = None) -> None:
    """The merging rank, as ``Merger.merge`` does it: what the ranks said, the analysis, the whole
    statements of the culprits and a few victims (above 1,024 ranks), the report on disk. With
    ``go`` (end to end), it first waits for it, then looks at the count at the watchdog's tick until
    every rank is counted, as the desk does; ``done_at`` is when its report is on disk."""
    _pin({1})
    from ncclguard.incidents.assemble import assemble
    from ncclguard.incidents.model import IncidentDoc, IncidentKind
    from ncclguard.watching.desk.cases import Case, write_report
    from ncclguard.watching.desk.merging import whole_of

    store = _store(port)
    res: dict[str, Any] = {}
    if go is not None:
        store.add_dumped(INCIDENT, 0)  # its connection made
        ready.put("merger")
        go.wait()
        end, looks = time.monotonic() + SETUP_BOUND_S, 0
        while store.add_dumped(INCIDENT, 0) < size and time.monotonic() < end:
            looks += 1
            time.sleep(TICK_S)
        res["looks"] = looks
    res["dumped"] = store.add_dumped(INCIDENT, 0)
    t0 = time.perf_counter()
    got = _gather(store, size)
    res["read_s"] = round(got["read_s"], 3)
    if "error" in got:
        res["error"] = got["error"]
    else:
        doc = IncidentDoc(
            kind=IncidentKind.HANG, reason="all_reduce(SUM) in flight 15 s", id="20261129-000000-003", n=INCIDENT
        )
        doc = doc.model_copy(update={"group": "0", "seq": GROUP_SEQ, "op": "all_reduce", "by": 0})
        t1 = time.perf_counter()
        incident = assemble(
            doc, got["said"], got["heartbeats"], {}, size, merged_by=0, waiting_after_s=5.0, heads=got["heads"]
        )
        t2 = time.perf_counter()
        if got["heads"]:
            incident = whole_of(store, INCIDENT, incident, {})
        t3 = time.perf_counter()
        case = Case(doc, Path(where), False, got["said"][0], {}, {}, [])
        write_report(case, incident, announce=False)
        t4 = time.perf_counter()
        res.update(assemble_s=round(t2 - t1, 3), whole_s=round(t3 - t2, 3), write_s=round(t4 - t3, 3))
        res["heads"] = got["heads"]
        res["said"] = len(got["said"])
        res["culprits"] = [(c.rank, str(c.why.value if hasattr(c.why, "value") else c.why)) for c in incident.culprits]
        res["whole"] = sum(v.source == "statement" for v in incident.ranks.values())
        res["summary"] = incident.summary[:200]
        res["report_bytes"] = (Path(where) / "incident.json").stat().st_size
    res["merge_s"] = round(time.perf_counter() - t0, 3)
    res["done_at"] = time.monotonic()
    out.put(res)
    store.close()


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_size(size: int, procs: int, mode: str = "flat", together: bool = False) -> dict[str, Any]:
    """One incident at ``size`` ranks against a fresh server, its statements filed flat or through
    the node tier (``mode``); ``together``: the merger waits for them at the same time (end to end)."""
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_server, args=(port_q, stop), daemon=True)
    server.start()
    port = port_q.get(timeout=SETUP_BOUND_S)
    # Whole nodes to each client process (torchrun's numbering: node n holds ranks 8n to 8n + 7).
    nodes = [list(range(lo, min(lo + PER_NODE, size))) for lo in range(0, size, PER_NODE)]
    shares = [[r for node in nodes[i::procs] for r in node] for i in range(procs)]
    try:
        setups = [ctx.Process(target=_setup, args=(port, s)) for s in shares]
        for p in setups:
            p.start()
        for p in setups:
            p.join(SETUP_BOUND_S)
        ready, go, out, end = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
        staters = [ctx.Process(target=_stater, args=(port, size, s, mode, ready, go, out, end)) for s in shares]
        for p in staters:
            p.start()
        for _ in staters:  # each makes its statements before the clock starts
            ready.get(timeout=SETUP_BOUND_S)
        with tempfile.TemporaryDirectory() as where:
            merged_q = ctx.Queue()
            merger = ctx.Process(target=_merger, args=(port, size, where, merged_q, go if together else None, ready))
            if together:
                merger.start()
                ready.get(timeout=SETUP_BOUND_S)  # its imports and its client made before the clock starts
            cpu0, t0, start = _cpu(server.pid), time.perf_counter(), time.monotonic()
            go.set()
            said = [out.get(timeout=SETUP_BOUND_S) for _ in staters]
            stated_wall, stated_cpu = time.perf_counter() - t0, _cpu(server.pid) - cpu0
            if not together:
                end.set()
                for p in staters:
                    p.join(SETUP_BOUND_S)
            cpu1 = _cpu(server.pid)
            if not together:
                merger.start()
            merged = merged_q.get(timeout=SETUP_BOUND_S)
            merge_cpu = _cpu(server.pid) - cpu1
            merger.join(SETUP_BOUND_S)
            end.set()
            for p in staters:
                p.join(SETUP_BOUND_S)
            if together:
                merged["end_to_end_s"] = round(merged["done_at"] - start, 3)
            merged.pop("done_at")
    finally:
        stop.set()
        server.join(10)
    return {
        "ranks": size,
        "mode": mode + (" together" if together else ""),
        "statement_bytes": said[0]["bytes"],
        "head_bytes": said[0]["head_bytes"],
        "statements_wall_s": round(stated_wall, 3),
        "statements_client_s": round(max(s["seconds"] for s in said), 3),
        "statements_server_cpu_s": round(stated_cpu, 3),
        "merge": merged,
        "merge_server_cpu_s": round(merge_cpu, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--modes", nargs="+", choices=["flat", "tier"], default=["flat", "tier"])
    ap.add_argument("--together", action="store_true", help="end to end: the merger waits for the statements")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for size in args.ranks:
        for mode in args.modes:
            row = run_size(size, args.procs, mode, args.together)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.json is not None:
            doc = {
                "command": "python benchmarks/desk_scale.py " + " ".join(sys.argv[1:]),
                "machine": {"cpus": psutil.cpu_count(), "python": platform.python_version()},
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "rows": rows,
            }
            args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
