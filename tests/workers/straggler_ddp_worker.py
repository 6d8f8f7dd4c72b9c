"""Rank side of tests/test_straggler_ddp_multirank.py: a loop that only calls DDP.

Usage: straggler_ddp_worker.py HEALTHY_S SLOW_RANK SLOW_FACTOR WINDOW_S

Each step marks itself (``mark_step``), computes in ``phase("train")`` a sleep of 40 ms and about
10 ms of matmuls (calibrated on rank 0 before the watchdog starts), then runs forward and backward
of a small model under DDP: one bucket, whose all_reduce DDP's reducer issues from C++. No
collective is called from Python in the loop, so ncclguard's records hold none; the straggler
windows take their figures from torch's flight recorder. For ``HEALTHY_S`` seconds every rank does
the same work; then ``SLOW_RANK`` does ``SLOW_FACTOR`` times as much of the sleep and the matmuls.

The ranks stop together without a collective: the first rank to see a merged straggler incident
(or rank 0 at the bound) writes ``stop_at`` (its step plus 20) in the job's store; every rank reads
it at each step and stops there (DDP keeps the ranks within a step of each other).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from straggler_worker import HEARTBEAT_S, OUT, SLOW_BOUND_S, STEP_COMPUTE_S, calibrate, work
from torch.nn.parallel import DistributedDataParallel as DDP

from ncclguard import init_process_group, mark_step, phase, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE

STOP_KEY = "straggler_ddp/stop_at"


def main() -> None:
    healthy_s, slow_rank, factor, window_s = (
        float(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        float(sys.argv[4]),
    )
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    init_process_group("gloo", timeout=120)
    rank = dist.get_rank()
    torch.manual_seed(0)
    a = torch.randn(96, 96) / 10
    sleep_s = 0.8 * STEP_COMPUTE_S
    reps = calibrate(a, STEP_COMPUTE_S - sleep_s)  # a Python collective, before the watchdog
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    store = rankkit._job_store()
    wd = start_watchdog(  # action raise: a straggler incident must stop at report all the same
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=60,
        action="raise",
        straggler_window_s=window_s,
        incident_dir=OUT / "incidents",
    )
    window_log = rankkit.WindowLog(wd)  # every window this rank closed, for the test's evidence
    start = time.time()
    slow_from = start + healthy_s
    step, stop_at = 0, None
    while stop_at is None or step < stop_at:
        mark_step(step)
        now = time.time()
        if now >= slow_from and "healthy_assessed" not in rankkit._results:
            tracker = wd._straggle.tracker  # what the healthy part looked like, for the test
            put("healthy_assessed", tracker.assessed)
            put("healthy_score", tracker.score)
        if stop_at is None:
            merged = [
                c for c in wd.incidents if c["kind"] == "straggler" and (Path(c["dir"]) / INCIDENT_FILE).is_file()
            ]
            if merged or (rank == 0 and now >= slow_from + SLOW_BOUND_S):
                store.compare_set(STOP_KEY, "", str(step + 20))  # the first writer wins
            if store.check([STOP_KEY]):
                stop_at = int(store.get(STOP_KEY))
        with phase("train", step=step):
            scale = factor if rank == slow_rank and now >= slow_from else 1.0
            time.sleep(sleep_s * scale)
            work(round(reps * scale), a)
            opt.zero_grad()
            model(x).square().mean().backward()  # DDP's bucket all_reduce, issued from C++
            opt.step()
        step += 1
    put("start", start)
    put("slow_from", slow_from)
    put("end", time.time())
    put("steps", step)
    put("reps", reps)
    put("incidents", wd.incidents)
    put("python_ops", len([r for r in wd._state.records() if r.start >= start]))
    put("windows", window_log.stop())
    wd.stop()
    dist.barrier()  # every watchdog stops before any rank leaves (see straggler_worker.py)
    rankkit.done()


if __name__ == "__main__":
    main()
