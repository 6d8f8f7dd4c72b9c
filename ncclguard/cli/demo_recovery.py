"""Demo act: a rank dies mid-training; the others rebuild the world in process and go on.

Three ranks train a small model with DDP (gloo). At step 4 rank 2 is killed (SIGKILL: a lost
node). Ranks 0 and 1 see the step fail, call ``rebuild_world(allow_shrink=True)``, wait for rank
2 until the timeout, build a world of 2, re-wrap the model in DDP (which broadcasts the new rank
0's parameters) and train the remaining steps. No process restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

TITLE = "Act: recovery in process (3 ranks, gloo): rank 2 is killed, ranks 0-1 rebuild the world and train on"
STEPS = 8
KILL_AT = 4
REBUILD_TIMEOUT_S = 3.0


def _rank_main() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ncclguard import rebuild_world, safe_all_reduce

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    launch_rank = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DDP(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    out: dict = {"launch_rank": launch_rank, "losses": {}}
    step = 1
    while step <= STEPS:
        if step == KILL_AT and launch_rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(100 * step + launch_rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        try:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP's gradient all_reduce: fails when a peer is gone
            mean_loss = loss.detach().clone()
            safe_all_reduce(mean_loss, op=dist.ReduceOp.AVG, timeout=2).raise_for_error()
        except Exception as exc:  # noqa: BLE001 - whatever the failure, the answer is a rebuild
            out["failed_at"] = time.time()
            first = str(exc).splitlines()[0]
            out["failure"] = f"{type(exc).__name__}: {first.split('] ', 1)[-1][:100]}"
            rebuilt = rebuild_world(timeout=REBUILD_TIMEOUT_S, allow_shrink=True)
            out["rebuild"] = {
                "ok": rebuilt.ok,
                "generation": rebuilt.generation,
                "rank": rebuilt.rank,
                "world_size": rebuilt.world_size,
                "rank_map": {str(k): v for k, v in rebuilt.rank_map.items()},
                "missing": rebuilt.missing_ranks,
                "elapsed_s": rebuilt.elapsed_s,
                "error": str(rebuilt.error) if rebuilt.error is not None else None,
            }
            if not rebuilt:
                break
            model = DDP(module)  # the old wrapper is bound to the dead world; this one broadcasts rank 0's
            continue  # the failed step again, on the new world
        opt.step()
        if "failed_at" in out and "first_good_at" not in out:
            out["first_good_at"] = time.time()
        out["losses"][step] = mean_loss.item()
        step += 1
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    out["params_equal"] = all(torch.equal(everyone[0], t) for t in everyone)
    out["steps_done"] = step - 1
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def run(args: argparse.Namespace) -> int:
    from ncclguard.testing.launch import spawn

    print(f"3 ranks train a small model with DDP for {STEPS} steps; at step {KILL_AT} rank 2 is killed (SIGKILL).")
    print(
        f"Ranks 0-1 catch the failed step and call rebuild_world(timeout={REBUILD_TIMEOUT_S:g}, allow_shrink=True), "
        "re-wrap the model in DDP and redo the step."
    )
    res = spawn([sys.executable, "-m", "ncclguard.cli.demo_recovery"], 3, timeout_s=90)
    results = res.json_lines()
    if res.timed_out or sorted(results) != [0, 1] or res.ranks[2].returncode != -signal.SIGKILL:
        print("the demo ranks did not report as expected:\n" + res.output()[-4000:])
        return 1
    for rank in (0, 1):
        r = results[rank]
        rb = r.get("rebuild", {})
        print(f"rank {rank}: step {KILL_AT} failed: {r.get('failure')}")
        if not rb.get("ok"):
            print(f"rank {rank}: rebuild failed: {rb.get('error')}")
            return 1
        print(
            f"rank {rank}: rebuild_world -> generation {rb['generation']}, rank {rb['rank']} of {rb['world_size']}, "
            f"rank map {rb['rank_map']}, left out {rb['missing']}, in {rb['elapsed_s']:.3f} s"
        )
    failed_at = min(results[r]["failed_at"] for r in (0, 1))
    good_at = max(results[r]["first_good_at"] for r in (0, 1))
    losses = results[0]["losses"]
    print(
        f"From the failure to the first good step on the world of 2: {good_at - failed_at:.2f} s "
        f"({REBUILD_TIMEOUT_S:g} s of it waiting for rank 2, which never came)."
    )
    print("Mean loss per step: " + ", ".join(f"{k}: {v:.3f}" for k, v in losses.items()))
    equal = all(results[r]["params_equal"] for r in (0, 1))
    done = all(results[r]["steps_done"] == STEPS for r in (0, 1))
    print(f"Both survivors finished all {STEPS} steps: {done}; their parameters are identical: {equal}.")
    return 0 if equal and done and len(losses) == STEPS else 1


def act_recovery(args: argparse.Namespace | None = None) -> int:
    """The act, for ``python -m ncclguard demo``: fail, rebuild, go on. Returns 0 when it showed that."""
    return run(args or argparse.Namespace())


if __name__ == "__main__":
    _rank_main()
