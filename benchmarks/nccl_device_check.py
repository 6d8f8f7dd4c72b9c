"""The NCCL path on a lent GPU, as one bounded script (docs/nccl.md).

    python benchmarks/nccl_device_check.py [--bytes 268435456] [--json out.json]

1. **Two ranks on one GPU.** NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
   detected"); its check compares host hashes, which ``NCCL_HOSTID`` sets. Two processes with
   different ``NCCL_HOSTID`` on GPU 0, NCCL's socket transport on loopback, one all_reduce: whether
   it holds, or what NCCL said.
2. If it holds, on that world of two NCCL ranks:
   - **release by abort**: rank 1 stays out of an all_reduce; after 2 s rank 0's step bound path
     (``abort_world`` under NCCL's rules) aborts its groups; the seconds from the abort to the op's
     failure;
   - **a new communicator**: every rank destroys the aborted world and makes a new one on a new store
     prefix (as the rebuild does), one all_reduce on it; its seconds;
   - **the heal's transport**: the same bytes broadcast over the NCCL group (CUDA tensors) and over
     the side gloo group (CPU tensors), GB/s each, side by side;
   - **the heal itself**: ``heal_from_peer`` of a CUDA module from rank 0 to rank 1 (as a restarted
     rank), its lane ("side gloo") and whether rank 1 ends bit-equal.
3. Prints one line per result and, with ``--json``, writes them.

Every child runs under a hard bound; the script ends in under 5 minutes or says which part did not.
Nothing here runs without a CUDA GPU: it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BOUND_S = 120.0  # each part's hard bound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int) -> None:
    os.environ.update(
        {
            "NCCL_HOSTID": f"ncclguard-check-{rank}",  # two "hosts" of one GPU each
            "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_NET": "Socket",
            "NCCL_IB_DISABLE": "1",
            "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        }
    )


def _world(rank: int, port: int, prefix: str) -> Any:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "nccl",
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )
    return store


def _child(rank: int, port: int, nbytes: int, out: Any) -> None:
    _env(rank)
    torch.cuda.set_device(0)
    res: dict[str, Any] = {"rank": rank}
    try:
        store = _world(rank, port, "g0/")
        t = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        res["trial"] = {"ok": True, "sum": t.tolist()}
    except Exception as exc:  # noqa: BLE001 - what NCCL said is the result
        res["trial"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        out.put(res)
        return
    try:
        res.update(_release_and_rebuild(rank, store))
        res.update(_transports(rank, nbytes))
        res.update(_heal(rank))
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent prints it
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out.put(res)


def _release_and_rebuild(rank: int, store: Any) -> dict[str, Any]:
    from ncclguard.backend_rules import rules_for
    from ncclguard.recovery._verdict.levers import abort_world

    rules = rules_for()
    found: dict[str, Any] = {"rules": [rules.backend, rules.carries_cpu, rules.release.value, rules.step_bound.value]}
    if rank == 0:
        work = dist.all_reduce(torch.ones(4, device="cuda"), async_op=True)  # rank 1 never joins it
        time.sleep(2.0)
        t0 = time.monotonic()
        aborted, failed, _ = abort_world(rules)
        try:  # an NCCL work's wait() blocks the stream, not this thread: the sync is what returns
            work.wait()
            torch.cuda.synchronize()
            ended = "the stream synchronized, no error raised"
        except Exception as exc:  # noqa: BLE001 - the release is this failure
            ended = f"{type(exc).__name__}: {str(exc)[:200]}"
        found["release"] = {"s": round(time.monotonic() - t0, 3), "aborted": aborted, "failed": failed, "op": ended}
        store.set("released", "1")
    else:
        store.wait(["released"], timedelta(seconds=60))
        aborted, failed, _ = abort_world(rules)
        found["release"] = {"aborted": aborted, "failed": failed}
    t0 = time.monotonic()
    dist.destroy_process_group()
    port = int(os.environ["CHECK_PORT2"])
    _world(rank, port, "g1/")
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    found["rebuild"] = {"s": round(time.monotonic() - t0, 3), "sum": t.tolist()}
    return found


def _transports(rank: int, nbytes: int) -> dict[str, Any]:
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    found = {}
    for name, group, device in (("nccl", None, "cuda"), ("side gloo", side, "cpu")):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf[:1024], src=0, group=group)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.monotonic()
        dist.broadcast(buf, src=0, group=group)
        if device == "cuda":
            torch.cuda.synchronize()
        s = time.monotonic() - t0
        found[name] = {"bytes": nbytes, "s": round(s, 4), "GB_s": round(nbytes / s / 1e9, 3)}
    return {"transports": found}


def _heal(rank: int) -> dict[str, Any]:
    import ncclguard

    torch.manual_seed(rank)  # different weights on each rank until healed
    module = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
    healed = ncclguard.heal_from_peer(module, receivers=[1], timeout=60)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(everyone, flat)
    return {
        "heal": {
            "ok": bool(healed),
            "lane": healed.lane,
            "bytes": healed.bytes,
            "s": round(healed.elapsed_s, 3),
            "bit_equal": bool(torch.equal(everyone[0], everyone[1])),
        }
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=256 << 20, help="bytes per transport measurement")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("nccl_device_check: no CUDA GPU here; nothing run")
        return 2
    head = {
        "card": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    print("nccl_device_check:", json.dumps(head))
    os.environ["CHECK_PORT2"] = str(_free_port())
    port = _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, port, args.bytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    end = time.monotonic() + 3 * BOUND_S
    while len(results) < 2 and time.monotonic() < end:
        try:
            res = out.get(timeout=max(0.1, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - queue.Empty at the bound
            break
        results[res["rank"]] = res
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    for r in range(2):
        print(f"rank {r}:", json.dumps(results.get(r, {"missing": "no result within the bound"})))
    if args.json is not None:
        args.json.write_text(json.dumps({"head": head, "ranks": results}, indent=2))
    ok = all(results.get(r, {}).get("trial", {}).get("ok") for r in range(2))
    return 0 if ok and all("error" not in results[r] for r in range(2)) else 1


if __name__ == "__main__":
    sys.exit(main())
