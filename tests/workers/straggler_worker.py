"""Rank side of tests/watching/test_straggler_multirank.py and test_straggler_netns.py.

Usage: straggler_worker.py HEALTHY_S SLOW_RANK SLOW_FACTOR [ELEMENTS [COMPUTE [WINDOW_S]]].

A training loop on gloo with the watchdog at its straggler defaults but a short window: each step marks
itself (``mark_step``), computes a fixed amount of work in ``phase("train")`` (matmuls; the amount is
calibrated on rank 0 and broadcast) and meets the others in one ``dist.all_reduce``, which also carries
the stop flag. For ``HEALTHY_S`` seconds every rank does the same work; then rank ``SLOW_RANK`` does
``SLOW_FACTOR`` times as much, until a straggler incident is merged on every rank (or a bound).
SLOW_RANK -1: no slowdown at all: the run ends after HEALTHY_S seconds or at a straggler incident
(the slow link test slows the link from outside meanwhile). ELEMENTS: the all_reduce's size in float32
(default 1). COMPUTE: ``matmul`` (default), ``sleep`` or ``mixed``. ``sleep``: the slow link test's
step "computes" by sleeping STEP_COMPUTE_S, so that the suite's other tests, beside it on 2 cores, do
not move its compute per op (the link rule rightly refuses a window whose compute moved; the unit
tests cover a load burst). ``mixed``: a sleep of 4/5 of STEP_COMPUTE_S and matmuls for the rest (the
3-rank test: a step that needs the CPU, as a host-side step does, and whose slowdown factor is the
rank's own, not the host's). WINDOW_S: the straggler window (default 2 s). Each rank writes
``started.rank<r>`` when its loop begins and returns every window it closed (``windows``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import init_process_group, mark_step, phase, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
HEARTBEAT_S = 0.5
WINDOW_S = 2.0
STEP_COMPUTE_S = 0.05  # the healthy step's compute, calibrated
SLOW_BOUND_S = 90.0  # the slow part ends here if no incident came (the test then fails)


def work(reps: int, a: torch.Tensor) -> None:
    for _ in range(reps):
        a = torch.tanh(a @ a)


def calibrate(a: torch.Tensor, seconds: float) -> int:
    """Matmul repetitions that take ``seconds`` here (rank 0's measure, broadcast)."""
    reps = torch.tensor([0], dtype=torch.int64)
    if dist.get_rank() == 0:
        work(20, a)
        t0 = time.perf_counter()
        work(200, a)
        per = (time.perf_counter() - t0) / 200
        reps[0] = max(1, int(seconds / per))
    dist.broadcast(reps, 0)
    return int(reps[0])


def main() -> None:
    healthy_s, slow_rank, factor = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    elements = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    compute = sys.argv[5] if len(sys.argv) > 5 else "matmul"
    window_s = float(sys.argv[6]) if len(sys.argv) > 6 else WINDOW_S
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    init_process_group("gloo", timeout=120)  # ncclguard's: picks the interface that reaches the store (netns)
    rank = dist.get_rank()
    a = torch.randn(96, 96) / 10
    sleep_s = {"matmul": 0.0, "sleep": STEP_COMPUTE_S, "mixed": 0.8 * STEP_COMPUTE_S}[compute]
    reps = calibrate(a, STEP_COMPUTE_S - sleep_s) if sleep_s < STEP_COMPUTE_S else 0
    wd = start_watchdog(  # action raise: a straggler incident must stop at report all the same
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=60,
        action="raise",
        straggler_window_s=window_s,
        incident_dir=OUT / "incidents",
    )
    window_log = rankkit.WindowLog(wd)  # every window this rank closed, for the test's evidence
    start = time.time()
    (OUT / f"started.rank{rank}").write_text(str(start))
    slow_from = start + healthy_s
    step = 0
    while True:
        mark_step(step)
        now = time.time()
        slow = slow_rank == rank and now >= slow_from
        if now >= slow_from and "healthy_assessed" not in rankkit._results:
            tracker = wd.sensor("straggler").tracker  # what the healthy part looked like, for the test
            put("healthy_assessed", tracker.assessed)
            put("healthy_score", tracker.score)
        done = [c for c in wd.incidents if c["kind"] == "straggler" and (Path(c["dir"]) / INCIDENT_FILE).is_file()]
        stop = now >= slow_from + (SLOW_BOUND_S if slow_rank >= 0 else 0) or bool(done)
        flag = torch.zeros(elements)
        flag[0] = 1.0 if stop else 0.0
        with phase("train", step=step):
            scale = factor if slow else 1.0
            if sleep_s:
                time.sleep(sleep_s * scale)
            work(round(reps * scale), a)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        step += 1
        if flag[0].item() > 0:
            break
    put("start", start)
    put("slow_from", slow_from if slow_rank >= 0 else None)
    put("end", time.time())
    put("steps", step)
    put("reps", reps)
    put("incidents", wd.incidents)
    put("windows", window_log.stop())
    wd.stop()
    # Every watchdog stops before any rank leaves: the store lives in rank 0's process under the
    # netns test's launcher, and a watchdog still running when it went wrote a `store` incident
    # ("the rendezvous store is gone") beside the straggler's (one run of the link test in six).
    dist.barrier()
    rankkit.done()


if __name__ == "__main__":
    main()
