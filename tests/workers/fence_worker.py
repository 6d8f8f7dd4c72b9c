"""Rank side of tests/recovery/test_fence_multirank.py. Usage: fence_worker.py stuck|left_behind.

``stuck`` (torchrun, 3 ranks): RecoveringStep(allow_shrink=True) under a watchdog whose top rung is
``fence``. At step K rank 2 is stuck for good in Python (a sleep loop it never leaves). Its own
watchdog names it the culprit, writes its dump, marks it fenced in the store and exits it with
status 0; ranks 0-1, blocked in DDP's all_reduce, wake with a backend error (the group's own
timeout, 60 s, is far off), their commit fails, and they go on as a world of 2.

``left_behind``: the same, but the step bound (``collective_timeout=1.5``) ends the survivors' op long before any
hang or desync verdict (``hang_timeout_s`` 20 s): nobody names rank 2 the culprit. Ranks 0-1 go on as a world of 2
and finish; rank 2's watchdog sees their generation 1 in the job's world record and ends it with
status 0 (the left-behind fence), so torchrun's job ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from recovering_worker import batch, flat, make_module, summary

import ncclguard
from ncclguard import RecoveringStep
from ncclguard.incidents.model import FenceNote
from ncclguard.store.keys import Keys

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

GROUP_TIMEOUT_S = 60.0  # far past the fence: what wakes the survivors is rank 2's exit
STEPS, K = 5, 2


def stuck(mode: str = "stuck") -> None:
    left = mode == "left_behind"
    rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    me = int(os.environ["RANK"])
    incidents = Path(os.environ["NCCLGUARD_TEST_OUT"]) / "incidents"
    wd = ncclguard.start_watchdog(
        heartbeat_s=0.5,
        hang_timeout_s=20 if left else 2,  # left: no hang or desync verdict before the survivors rebuild
        escalate_after_s=1,
        fence_after_s=2,
        action="fence",
        incident_dir=incidents,
        straggler=False,
        incident_plot=False,
    )
    module = make_module()
    stepper = RecoveringStep(
        module,
        torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
        collective_timeout=1.5 if left else None,  # stuck: the group's own 60 s, far past the fence
        commit_timeout=3,
        rebuild_timeout=3,
        allow_shrink=True,
    )
    t0 = time.monotonic()
    results, errors = [], []
    for step in range(STEPS):
        x, y = batch(step, me)
        tries: list[int] = []

        def step_fn(model: torch.nn.Module, step: int = step, x=x, y=y, tries: list[int] = tries) -> float:
            tries.append(dist.get_world_size())
            if me == 2 and step == K:
                rankkit.fault_fired("stuck for good in a step")
                put("pid", os.getpid())
                rankkit.save()
                while True:  # stuck for good: nothing in this rank will ever leave this loop
                    time.sleep(0.1)
            try:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            except Exception as exc:
                errors.append({"step": step, "after_s": round(time.monotonic() - t0, 3), "error": str(exc)[:400]})
                raise
            return float(loss.detach())

        res = stepper(step_fn, step=step)
        results.append({**summary(res), "world_sizes": tries})
        if not res:
            break
    put("results", results)
    put("errors", errors)
    put("wall_s", round(time.monotonic() - t0, 3))
    mine = flat(module)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
    put("final", [dist.get_rank(), dist.get_world_size()])
    from recovering_worker import reference_shrunk

    put("max_diff_to_reference", float((mine - reference_shrunk()).abs().max()))
    # Rank 2's fence mark, in generation 0's watchdog namespace of the job's store (left behind:
    # it comes after the survivors are done, so wait for it; bounded, a hang guard).
    store = rankkit._job_store()
    key = Keys.from_env("main", generation=0).fenced(2)
    if left:
        store.wait([key], timedelta(seconds=60))
        pid2 = int(json.loads((Path(os.environ["NCCLGUARD_TEST_OUT"]) / "rank2.json").read_text())["pid"])
        until = time.monotonic() + 30
        while not rankkit.dead(pid2) and time.monotonic() < until:
            time.sleep(0.05)
        put("rank2_gone", rankkit.dead(pid2))
    put("fence_note", FenceNote.model_validate_json(bytes(store.get(key))).to_json() if store.check([key]) else None)
    put("incidents", [{"kind": i["kind"], "actions": i["actions"], "doc": i["doc"]} for i in wd.incidents])
    wd.stop()
    rankkit.done()


if __name__ == "__main__":
    stuck(sys.argv[1]) if sys.argv[1] in ("stuck", "left_behind") else sys.exit(f"unknown scenario {sys.argv[1]}")
