"""should_commit's round (with ``--what meeting``, the rebuild's meeting; with ``--what take``, a snapshot
take's agreement) in the job's store at 64
to 16,384 simulated ranks, through the node tier (``tier``: one carrier a node of 8) beside the flat
round (``flat``: every rank), against one real TCPStore (issue 63: "a commit round under 1 s of store
work", "a rebuild meeting's store work under 1 s").

    python benchmarks/commit_tier_scale.py [--ranks 64 1024 4096 16384] [--modes tier flat] \
        [--procs 4] [--rounds 5] [--what commit|meeting|take] [--json benchmarks/results/commit_tier_scale.json]

``--what take``: each rank's ``TakeStatement`` (a swap that went well, as the snapshot keeper states
it), decided by the take's own rule (``recovery/snapshots/agreement.py``); its round and clean-up are
the commit's (a take's keys go with the next take, as a commit's with the next commit).

``--what meeting``: each rank's ``Arrival`` (a survivor's, as ``rebuild_world`` writes it) instead of
a statement. The settling rank (carrier) reads every arrival once and puts the members' roster in the
outcome (``meeting.with_roster``); nobody else reads them. Through the tier the meeting's keys are
left in the store, as ncclguard leaves them; flat, each member counts itself out (``add``), and the
clean-up is the commit's. ``--modes flat-read``: the flat meeting as it was before the roster, every
member reading every arrival (one ``multi_get`` each) before it counts itself out.

The job's store is torch's ``TCPStore`` server in a process of its own pinned to CPU 0
(``node_tier_scale._server``), a fresh one per size and mode. ``--procs`` client processes pinned to
CPU 1 each play their share of the carriers (``tier``) or ranks (``flat``), one client each, making
the job-store requests of a round in the protocol's order, as ncclguard/store/tier_round.py and
ncclguard/store/rounds.py make them:

- ``tier``: each carrier ``set``s its node's :class:`~ncclguard.store.tier_round.Carried` (8 real
  ``CommitStatement`` JSONs, as ``should_commit`` states them in a clean step) and ``add``s 8. The
  one whose add completes the count settles: the real :class:`~ncclguard.store.tier_round.TierPeek`
  reads every node's arrivals (a ``check`` and a ``multi_get``) and the solos' list (a ``check``),
  the real ``decide`` of ``recovery/_commit/statements.py`` decides over 16,384 statements, and a
  ``compare_set`` settles. Every other carrier ``wait``s for the outcome and ``get``s it. Then the
  clean-up of a round: each node's first rank deletes its node's arrivals, rank 0 five keys more.
- ``flat``: each rank ``set``s its statement and ``add``s 1; the one completing the count reads
  every statement (one ``multi_get``), decides and settles; the others ``wait`` and ``get``; each
  deletes its own statement, rank 0 three keys more.

Not simulated: the node's part of the tier (each node's own store, in its agent's process: 8 ranks'
set, add and a look for the outcome, off the job's store), the statements' making, the network
between hosts, and a rank's helper-thread hand-off. Measured per round: the job store's requests,
the server's CPU seconds (its process's user+system time: the store's work), the round's wall time
from the first request to the last rank's outcome with ``--procs`` clients on one CPU, and the
settling client's seconds to read and decide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from node_tier_scale import _client, _pin, _server  # the same server, pinned the same way

PER_NODE = 8
SETUP_BOUND_S = 120.0  # a spawned process imports torch in seconds; minutes means it is broken
ROUND_BOUND_S = 600.0  # one round's hang guard (the flat round at 16,384 takes tens of seconds here)


def statement_text(rank: int, size: int) -> str:
    """A clean step's commit statement of ``rank``, as ``should_commit`` encodes it."""
    from ncclguard.recovery._commit.statements import CommitStatement
    from ncclguard.store.codec import encode

    return encode(
        CommitStatement(
            rank=rank,
            step=7,
            user_step=7,
            generation=0,
            group="default_pg",
            group_size=size,
            seq=1234,
            other_seqs={},
            p2p_groups=[],
            problems=[],
            stop=False,
            generators={"cpu": "5f1e9b2c", "cuda:0": "77a0c3d1"},
            numerics=None,
            replicas={},
        )
    )


def take_text(rank: int, size: int) -> str:
    """A rank's account of a snapshot take whose swap went well, as the keeper states it."""
    from ncclguard.recovery.snapshots.agreement import TAKE_OK, TakeStatement
    from ncclguard.store.codec import encode

    return encode(TakeStatement(rank=rank, kind=TAKE_OK, want=4))


def arrival_text(rank: int, size: int) -> str:
    """A surviving rank's arrival at a rebuild meeting, as ``rebuild_world`` encodes it."""
    from ncclguard.recovery._rebuild.meeting import Arrival
    from ncclguard.store.codec import encode

    host = f"gpu-node-{rank // PER_NODE:05d}.cluster.example"
    return encode(
        Arrival(
            rank=rank,
            world_size=size,
            generation=0,
            backend="nccl",
            allow_shrink=True,
            host=host,
            pid=4242,
            origin=rank,
        )
    )


def _settle_meeting(client: Any, mode: str, size: int, keys: Any) -> tuple[str, float]:
    """The meeting's settling rank: everyone arrived. Through the tier it reads every arrival and
    puts the roster in the outcome, flat too; ``flat-read`` (the meeting before the roster) reads none,
    and each member then reads them all."""
    from ncclguard.recovery._rebuild.meeting import decide, with_roster
    from ncclguard.store.codec import encode
    from ncclguard.store.rounds import Peek
    from ncclguard.store.tier_round import TierKeys, TierPeek, TierPlace

    t0 = time.perf_counter()
    outcome = decide(list(range(size)), size, False)
    if mode == "tier":
        place = TierPlace(0, [r // PER_NODE for r in range(size)], None)
        outcome = with_roster(outcome, TierPeek(client, TierKeys(keys), place, 4096).arrivals(complete=True), size)
    elif mode == "flat":  # the roster from one read of every arrival (a check and a multi_get)
        outcome = with_roster(outcome, Peek(client, keys, size).arrivals(list(range(size))), size)
    text = encode(outcome)
    client.compare_set(keys.outcome, "", text)
    return json.dumps({"ok": outcome.ok}), time.perf_counter() - t0


def _settle(client: Any, mode: str, size: int, keys: Any, what: str = "commit") -> tuple[str, float]:
    """The settling rank's read, decision and compare-and-set; the seconds it took."""
    from ncclguard.recovery._commit.statements import CommitStatement, decide
    from ncclguard.recovery.snapshots import agreement
    from ncclguard.store.codec import decode_each, encode
    from ncclguard.store.rounds import Peek
    from ncclguard.store.tier_round import TierKeys, TierPeek, TierPlace

    if what == "meeting":
        return _settle_meeting(client, mode, size, keys)
    t0 = time.perf_counter()
    if mode == "tier":
        peek: Peek = TierPeek(client, TierKeys(keys), TierPlace(0, [r // PER_NODE for r in range(size)], None), 4096)
    else:
        peek = Peek(client, keys, size)
    raw = peek.arrivals(complete=True)
    if what == "take":  # the keeper's rule (recovery/snapshots/agreement.py): the worst kind, the largest K
        taken = decode_each(agreement.TakeStatement, raw, "take statement", 4096, "bench")
        decided = agreement.decide(taken, size)
        client.compare_set(keys.outcome, "", encode(decided))
        return json.dumps({"ok": decided.kind == agreement.TAKE_OK}), time.perf_counter() - t0
    else:
        said = decode_each(CommitStatement, raw, "commit statement", 1 << 16, "bench")
        outcome = encode(decide(said, size, 7, 60.0))
    client.compare_set(keys.outcome, "", outcome)
    return outcome, time.perf_counter() - t0


def _player(mode: str, what: str, size: int, port: int, share: list[int], go: Any, left: Any, out: Any) -> None:
    """One client process: its carriers (tier) or ranks (flat), through a round and its clean-up."""
    from ncclguard.store.codec import encode
    from ncclguard.store.keys import RoundKeys
    from ncclguard.store.tier_round import Carried, TierKeys

    _pin({1})
    client = _client(port)
    keys = RoundKeys("ncclguard/commit/0/default_pg/g0/s7")
    tier = TierKeys(keys)
    text_of = {"meeting": arrival_text, "take": take_text}.get(what, statement_text)
    if mode == "tier":
        texts = {
            n: encode(Carried(node=n, arrivals={r: text_of(r, size) for r in range(n * PER_NODE, (n + 1) * PER_NODE)}))
            for n in share
        }
    else:
        texts = {r: text_of(r, size) for r in share}
    requests, settle_s, ok = 0, None, None
    go.wait()
    t0 = time.time()
    waiting = []
    for unit, text in texts.items():
        client.set(tier.nodes.arrival(unit) if mode == "tier" else keys.arrival(unit), text)
        number = int(client.add(keys.count, PER_NODE if mode == "tier" else 1))
        requests += 2
        if number >= size:
            outcome, settle_s = _settle(client, mode, size, keys, what)
            ok = json.loads(outcome)["ok"]
            # check + multi_get (+ the solos' check) + compare_set; the flat meeting's reading members
            # (flat-read): the compare_set alone
            requests += 4 if mode == "tier" else 1 if mode == "flat-read" else 3 if what == "meeting" else 2
        else:
            waiting.append(unit)
    for _ in waiting:
        client.wait([keys.outcome], datetime.timedelta(seconds=ROUND_BOUND_S))
        client.get(keys.outcome)
        requests += 2
    if what == "meeting" and mode.startswith("flat"):  # each member counts itself out
        everyone = [keys.arrival(r) for r in range(size)]
        for _ in texts:
            if mode == "flat-read":  # the meeting before the roster: each member read every arrival
                client.multi_get(everyone)
                requests += 1
            client.add(keys.gone, 1)  # the last member out deletes the keys
            requests += 1
    t_outcome = time.time()
    left.wait(ROUND_BOUND_S)  # every rank has read the outcome (ncclguard deletes after the next round)
    if what == "meeting" and mode == "tier":  # the tiered meeting's keys stay (docs/scale.md)
        out.put(
            {
                "t0": t0,
                "t_outcome": t_outcome,
                "t_end": time.time(),
                "requests": requests,
                "settle_s": settle_s,
                "ok": ok,
            }
        )
        return
    for unit in texts:  # the clean-up: each its own key
        client.delete_key(tier.nodes.arrival(unit) if mode == "tier" else keys.arrival(unit))
        requests += 1
    if 0 in share:
        extra = tier.job_keys() if mode == "tier" else [keys.count, keys.gone, keys.outcome]
        for key in extra:
            client.delete_key(key)
            requests += 1
    out.put(
        {"t0": t0, "t_outcome": t_outcome, "t_end": time.time(), "requests": requests, "settle_s": settle_s, "ok": ok}
    )


def run_round(mode: str, size: int, procs: int, what: str = "commit") -> dict[str, Any]:
    """One round on a fresh server: requests, the server's CPU seconds, the wall times."""
    ctx = mp.get_context("spawn")
    port_q, stop, out, go, left = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event(), ctx.Barrier(procs)
    server = ctx.Process(target=_server, args=(port_q, stop), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=SETUP_BOUND_S)
        units = list(range(size // PER_NODE if mode == "tier" else size))
        shares = [units[i::procs] for i in range(procs)]
        players = [ctx.Process(target=_player, args=(mode, what, size, port, s, go, left, out)) for s in shares]
        for p in players:
            p.start()
        time.sleep(2.0)  # the players import, connect and build their statements before the round
        srv = psutil.Process(server.pid)
        cpu0 = sum(srv.cpu_times()[:2])
        go.set()
        got = [out.get(timeout=ROUND_BOUND_S) for _ in players]
        cpu1 = sum(srv.cpu_times()[:2])
        for p in players:
            p.join(SETUP_BOUND_S)
    finally:
        stop.set()
        server.join(SETUP_BOUND_S)
    t0 = min(g["t0"] for g in got)
    settler = next(g for g in got if g["settle_s"] is not None)
    return {
        "requests": sum(g["requests"] for g in got),
        "server_cpu_s": round(cpu1 - cpu0, 4),
        "outcome_wall_s": round(max(g["t_outcome"] for g in got) - t0, 4),
        "wall_s": round(max(g["t_end"] for g in got) - t0, 4),
        "settle_s": round(settler["settle_s"], 4),
        "ok": settler["ok"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--modes", nargs="+", choices=["tier", "flat", "flat-read"], default=["tier", "flat"])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--what", choices=["commit", "meeting", "take"], default="commit")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for size in args.ranks:
        if size % PER_NODE:
            ap.error(f"--ranks {size}: a multiple of {PER_NODE} (ranks a node)")
        for mode in args.modes:
            runs = [run_round(mode, size, args.procs, args.what) for _ in range(args.rounds)]
            med = {
                k: statistics.median(r[k] for r in runs)
                for k in ("server_cpu_s", "outcome_wall_s", "wall_s", "settle_s")
            }
            row = {
                "what": args.what,
                "mode": mode,
                "ranks": size,
                "rounds": args.rounds,
                "requests": runs[0]["requests"],
            }
            row |= {f"{k}_p50": round(v, 4) for k, v in med.items()}
            row |= {
                "server_cpu_s_max": max(r["server_cpu_s"] for r in runs),
                "every_round_ok": all(r["ok"] for r in runs),
            }
            rows.append(row)
            print(
                f"{args.what} {mode:5} {size:6} ranks: {row['requests']:6} requests, server {row['server_cpu_s_p50']:.3f} s CPU "
                f"(max {row['server_cpu_s_max']:.3f}), outcome on every rank in {row['outcome_wall_s_p50']:.3f} s, "
                f"settler {row['settle_s_p50']:.3f} s, ok={row['every_round_ok']}",
                flush=True,
            )
    if args.json:
        doc = {
            "command": "python benchmarks/commit_tier_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": {"cpus": psutil.cpu_count(), "platform": platform.platform()},
            "load_avg_after": list(psutil.getloadavg()),
            "results": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
