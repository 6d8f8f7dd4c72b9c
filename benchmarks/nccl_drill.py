"""Recovery drills on two ranks, as a user's script is written, on real NCCL when a GPU is lent.

    python benchmarks/nccl_drill.py --backend nccl [--drills ddp-kill ddp-stuck fsdp2-kill] [--json out.json]
    python benchmarks/nccl_drill.py --backend gloo      # the same drills on CPU (a rehearsal)

Each drill is two launches of ``ncclguard run --ncclguard-restarts 1 --standalone --nproc-per-node 2``
of this file's rank side: a fault-free run and the run with the fault, from the same start; the
parameters and Adam's state must end bit-equal (a SHA-256 of them, gathered in full under FSDP2).

The rank side is a user's script: ``dist.init_process_group(backend)`` first, ncclguard imported
after; a 3.2M-parameter MLP with dropout on the GPU, Adam, a warm-up schedule passed as
``scheduler=``, data drawn from the step and the rank, ``stepper.steps()``:

- ``ddp-kill``: ``RecoveringStep(model, opt, scheduler=)`` (DDP, every default); rank 1 SIGKILLs
  itself inside step K's forward; restarted, it rejoins and is healed from rank 0;
- ``ddp-stuck``: the same, rank 1 asleep for good in Python at step K: the peers' agreement, its
  supervisor's kill, the restart and the heal;
- ``fsdp2-kill``: ``wrap=FSDP2(each Linear, then the root)``, ``heal=True``, ``snapshot_every=1``;
  rank 1 SIGKILLs itself at step K, restored from rank 0's snapshot of its shards;
- ``ddp-slow``: ``collective_timeout=5``; rank 1 sleeps 12 s once in step K's forward, so rank 0 waits
  in NCCL past the step's bound: its timer aborts the groups, both ranks fail the step, the world is
  rebuilt without a restart and the step redone.

On NCCL, two ranks share the one GPU: NCCL refuses two ranks of a communicator on one GPU
("Duplicate GPU detected") unless their host hashes differ, which ``NCCL_HOSTID`` sets, so each
rank sets its own and NCCL talks over its socket transport on loopback (docs/nccl.md). That is the
test rig's only line a user would not write.

Reported per drill: bit-equal or not, each rank's steps (attempts, generation, rebuilds, healed),
the seconds from the fault to the step applied again on the full world, the heal's lane, and every
rank's exit. Each launch has a hard bound; a launch past it is killed and reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS, K = 8, 4  # steps per run; the step of the fault
WIDTH, CLASSES, BATCH = 1024, 16, 32
LAUNCH_BOUND_S = {"ddp-kill": 120.0, "ddp-stuck": 150.0, "fsdp2-kill": 120.0, "ddp-slow": 120.0, "ref": 90.0}
DRILLS = ("ddp-kill", "ddp-stuck", "fsdp2-kill", "ddp-slow")
SLOW_BOUND_S, SLOW_SLEEP_S = 5.0, 12.0  # ddp-slow: the step bound, and rank 1's one sleep past it


# ---------------------------------------------------------------- rank side


def _rig(backend: str, rank: int) -> None:
    """Two NCCL ranks on one GPU: two "hosts" of one GPU each, over NCCL's sockets on loopback."""
    if backend == "nccl":
        os.environ["NCCL_HOSTID"] = f"ncclguard-drill-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_NET", "Socket")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")


def _model(device: Any) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Linear(WIDTH, CLASSES),
    ).to(device)


def _batch(step: int, rank: int, device: Any) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x.to(device), y.to(device)


def _shard(module: Any, mesh: Any) -> None:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def _digest(model: Any, opt: Any) -> str:
    """SHA-256 of the full parameters and Adam's state (an FSDP2 shard gathered over the world)."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(full(p).numpy().tobytes())
        held = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            h.update(full(held[key]).to(torch.float64).numpy().tobytes())
    return h.hexdigest()


def rank_side(drill: str, backend: str, out: Path, fault: bool) -> None:
    """One rank of a launch: the user's script."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    _rig(backend, rank)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(backend)  # as a user writes it, first
    import ncclguard  # after, as users do

    life = ncclguard.restart_count()
    module = _model(device)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    fsdp2 = drill.startswith("fsdp2")
    extra: dict[str, Any] = {"wrap": ncclguard.FSDP2(_shard), "heal": True, "snapshot_every": 1} if fsdp2 else {}
    if drill == "ddp-slow":
        extra["collective_timeout"] = SLOW_BOUND_S
    stepper = ncclguard.RecoveringStep(module, opt, scheduler=sched, **extra)
    said: dict[str, Any] = {"rank": rank, "life": life, "backend": dist.get_backend(), "steps": []}
    said["restored"] = getattr(stepper.healed, "lane", None) if stepper.healed is not None else None
    if backend == "nccl":
        said["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        said["card"] = torch.cuda.get_device_name(0)
    mine = out / f"rank{rank}-life{life}.json"
    for step in stepper.steps(STEPS):
        x, y = _batch(step, rank, device)

        def step_fn(model: Any, step: int = step, x: Any = x, y: Any = y) -> None:
            if fault and drill == "ddp-slow" and rank == 1 and step == K and "fault_at" not in said:
                said["fault_at"] = time.time()
                time.sleep(SLOW_SLEEP_S)  # once: the redo runs at full speed
            elif fault and drill != "ddp-slow" and rank == 1 and life == 0 and step == K:
                said["fault_at"] = time.time()
                mine.write_text(json.dumps(said))
                if drill.endswith("kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                while True:  # asleep for good, in Python
                    time.sleep(1.0)
            torch.nn.functional.cross_entropy(model(x), y).backward()

        t0 = time.time()
        res = stepper(step_fn, step=step)
        if res:
            sched.step()
        healed = res.healed
        said["steps"].append(
            {
                "step": step,
                "ok": res.ok,
                "attempts": res.attempts,
                "generation": res.generation,
                "rebuilds": res.rebuilds,
                "healed": getattr(healed, "role", None) if healed is not None else None,
                "lane": getattr(healed, "lane", None) if healed is not None else None,
                "rewound_to": res.rewound_to,
                "error": str(res.error)[:300] if res.error is not None else None,
                "size": dist.get_world_size(),
                "started": t0,
                "ended": time.time(),
            }
        )
        if not res and res.rewound_to is None:
            break
    said["digest"] = _digest(stepper.model, opt)
    mine.write_text(json.dumps(said))
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher side


def _ncclguard() -> str:
    found = shutil.which("ncclguard") or str(Path(sys.executable).with_name("ncclguard"))
    if not Path(found).exists():
        raise SystemExit("nccl_drill: the ncclguard command is not installed beside this python (pip install .)")
    return found


def _launch(drill: str, backend: str, fault: bool, log_dir: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"ncclguard-drill-{drill}-"))
    name = f"{drill}-{'fault' if fault else 'ref'}"
    cmd = [
        _ncclguard(),
        "run",
        "--ncclguard-restarts",
        "1",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(Path(__file__).resolve()),
        "--rank-side",
        drill,
        "--backend",
        backend,
        "--out",
        str(out),
        *(["--fault"] if fault else []),
    ]
    bound = LAUNCH_BOUND_S[drill if fault else "ref"]
    log = log_dir / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"killed at the bound ({bound:g} s)"
    ranks = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    return {"launch": name, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "ranks": ranks, "log": str(log)}


def _summary(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    final = {k: v for k, v in run["ranks"].items() if "digest" in v}
    want = {v.get("digest") for v in ref["ranks"].values()}
    got = {v["digest"] for v in final.values()}
    fault_at = next((v["fault_at"] for v in run["ranks"].values() if "fault_at" in v), None)
    back = None
    r0 = run["ranks"].get("rank0-life0", {})
    for s in r0.get("steps", []):
        if s["step"] == K and s["ok"] and fault_at is not None:
            back = round(s["ended"] - fault_at, 2)
    rebuilds_ref = sum(s["rebuilds"] for v in ref["ranks"].values() for s in v.get("steps", []))
    return {
        "bit_equal": len(want) == 1 and got == want and len(final) == 2,
        "ranks_finished": sorted(final),
        "rc": [ref["rc"], run["rc"]],
        "wall_s": [ref["wall_s"], run["wall_s"]],
        "fault_to_step_applied_s": back,
        "rebuilds_in_fault_free_run": rebuilds_ref,
        "restored_lane": next((v.get("restored") for k, v in final.items() if v.get("life")), None),
        "steps_around_fault": {
            k: [s for s in v.get("steps", []) if s["step"] in (K - 1, K, K + 1) or not s["ok"]]
            for k, v in run["ranks"].items()
        },
        "versions": {k: [v.get("backend"), v.get("nccl"), v.get("card")] for k, v in final.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--drills", nargs="+", choices=DRILLS, default=list(DRILLS))
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--logs", type=Path, default=None, help="keep each launch's output here")
    ap.add_argument("--rank-side", choices=DRILLS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fault", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_side is not None:
        rank_side(args.rank_side, args.backend, args.out, args.fault)
        return 0
    if args.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            print("nccl_drill: no CUDA GPU here; nothing run (--backend gloo rehearses on CPU)")
            return 2
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ncclguard-drill-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    refs: dict[str, dict[str, Any]] = {}
    for drill in args.drills:
        kind = drill.split("-")[0]
        if kind not in refs:
            refs[kind] = _launch(drill, args.backend, False, logs)
        run = _launch(drill, args.backend, True, logs)
        results[drill] = _summary(refs[kind], run)
        print(f"nccl_drill {args.backend} {drill}:", json.dumps(results[drill]), flush=True)
        if args.json is not None:  # after each drill: a session cut short keeps what finished
            doc = {"backend": args.backend, "steps": STEPS, "fault_step": K, **results}
            args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["bit_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
