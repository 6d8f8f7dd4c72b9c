"""Can a DeepSpeed ZeRO engine be built again in process after ``rebuild_world``, and continue from a
``DeepSpeedState`` capture bit for bit? And what does each way back cost: a new engine in the old
process, against a new process (start, ``import deepspeed``, the group, the engine)?

Usage (from the repository's root; 2 gloo ranks under torchrun per case, CPU)::

    .venv/bin/python benchmarks/investigations/deepspeed_rebuild_in_process.py \
        --json benchmarks/results/deepspeed_rebuild_in_process.json

Per ZeRO stage (1, 2, 3) and way (``fresh``: ``deepspeed.initialize`` on a new module of the same
architecture; ``same``: on the module the old engine had converted; ``fresh-no-release``: a new
module without dropping DeepSpeed's cached clone of the old world group), one launch: K steps,
capture, M steps recorded (losses and the gathered parameters), ``rebuild_world()`` with every rank
alive, the new engine, ``apply``, the M steps again: equal or not, or the error. Then, in the parent,
``python -c "import torch"`` and ``python -c "import deepspeed"`` timed ``--repeats`` times each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K, M = 2, 3
WAYS = ("fresh", "same", "fresh-no-release")


def rank_main(stage: int, way: str, out: str) -> None:
    import psutil  # light: the process's start time, before the heavy imports

    born = psutil.Process().create_time()
    t_torch0 = time.time()
    import torch

    t_torch = time.time()
    import deepspeed
    import torch.distributed as dist

    t_ds = time.time()
    from datetime import timedelta

    import ncclguard
    from ncclguard.integrations.deepspeed.state import DeepSpeedState, OwnState

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    deepspeed.init_distributed(dist_backend="gloo")
    t_pg = time.time()
    rank = dist.get_rank()

    def build(seed: int, module: torch.nn.Module | None = None) -> tuple[deepspeed.DeepSpeedEngine, float]:
        torch.manual_seed(seed)
        model = module or torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
            "steps_per_print": 10**9,
        }
        t = time.perf_counter()
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return eng, time.perf_counter() - t

    def train(eng: deepspeed.DeepSpeedEngine, steps: range) -> list:
        record = []
        for s in steps:
            g = torch.Generator().manual_seed(100 * s + rank)
            x = torch.randn(4, 6, generator=g)
            loss = torch.nn.functional.mse_loss(eng(x), x.sum(1, keepdim=True).tanh())
            eng.backward(loss)
            eng.step()
            gather = [p for p in eng.module.parameters() if getattr(p, "ds_status", None) is not None]
            with deepspeed.zero.GatheredParameters([p for p in gather if p.ds_status.name != "AVAILABLE"]):
                params = [p.detach().clone() for p in eng.module.parameters()]
            record.append([float(loss), [p.flatten().tolist() for p in params]])
        return record

    result: dict = {"stage": stage, "way": way, "rank": rank}
    eng, result["initialize_first_s"] = build(0)
    result["cold_start"] = {
        "import_torch_s": t_torch - t_torch0,
        "import_deepspeed_s": t_ds - t_torch,
        "process_start_to_group_s": t_pg - born,
        "process_start_to_engine_s": time.time() - born,
    }
    train(eng, range(K))
    live = DeepSpeedState(eng).capture()
    cap = OwnState({k: v.detach().clone() for k, v in live.tensors.items()}, json.loads(json.dumps(live.meta)))
    first = train(eng, range(K, K + M))
    t = time.perf_counter()
    rebuilt = ncclguard.rebuild_world(timeout=30)
    result["rebuild_world_s"] = time.perf_counter() - t
    result["rebuilt"] = bool(rebuilt)
    try:
        t = time.perf_counter()
        if way != "fresh-no-release":
            # rebuild_world destroys torch's groups with torch's call; DeepSpeed's own
            # (deepspeed.comm.destroy_process_group) would also drop its cached clone of the world group.
            from deepspeed.utils import groups

            groups._release_process_group_references(None)
        new, result["initialize_again_s"] = build(123, eng.module if way == "same" else None)
        t_apply = time.perf_counter()
        DeepSpeedState(new).apply(cap)
        result["apply_s"] = time.perf_counter() - t_apply
        result["rebuilt_to_ready_s"] = time.perf_counter() - t
        again = train(new, range(K, K + M))
        result["bit_equal"] = again == first
    except Exception as exc:  # noqa: BLE001 - the error is the finding
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"[:600]
        frames = traceback.extract_tb(exc.__traceback__)
        result["error_where"] = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames if "deepspeed" in f.filename
        ][-7:-3]
    Path(out, f"{stage}-{way}-rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the old world's groups are still held by the reaper: no interpreter shutdown


def timed(cmd: list[str], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times), "n": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-mode", nargs=3, metavar=("STAGE", "WAY", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(int(args.rank_mode[0]), args.rank_mode[1], args.rank_mode[2])
        return
    out = tempfile.mkdtemp(prefix="ds-rebuild-")
    cases = []
    for stage in map(int, args.stages.split(",")):
        for way in args.ways.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            t = time.perf_counter()
            proc = subprocess.run(
                [*cmd, __file__, "--rank-mode", str(stage), way, out], capture_output=True, text=True, timeout=300
            )
            wall = time.perf_counter() - t
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob(f"{stage}-{way}-rank*.json"))]
            case = {"stage": stage, "way": way, "rc": proc.returncode, "launch_wall_s": wall, "ranks": ranks}
            if len(ranks) < 2:
                case["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
            cases.append(case)
            summary = {
                k: [r.get(k) for r in ranks]
                for k in ("bit_equal", "error", "initialize_first_s", "initialize_again_s", "apply_s")
            }
            print(f"stage {stage} {way}: rc {proc.returncode}, {wall:.1f} s, {summary}", flush=True)
    starts = {
        "python_import_torch": timed([sys.executable, "-c", "import torch"], args.repeats),
        "python_import_deepspeed": timed([sys.executable, "-c", "import deepspeed"], args.repeats),
    }
    print(json.dumps(starts, indent=1))
    load = os.getloadavg()
    report = {"cases": cases, "process_starts": starts, "loadavg": load, "python": sys.version.split()[0]}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
