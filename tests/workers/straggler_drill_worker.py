"""Rank side of the straggler drill (benchmarks/straggler_drill.py) and of the real-rank straggler tests.

Usage: straggler_drill_worker.py PLAN.json

A training loop on gloo with the watchdog's straggler detection at its defaults but for the plan's
window: each step takes its batch from a torch DataLoader (``num_workers=0``; each batch costs
``input_s``: a sleep and, for a fifth of it, matmuls), marks itself (``mark_step``), runs its model in
``phase("train")`` (``model_s``: a sleep and, for a fifth, matmuls: the CPU-bound part a host-side step
has; a fixed amount of work, which load stretches) and meets the other ranks in one all_reduce of ``elements`` float32: a Python ``dist.all_reduce``
(``mode: "records"``: ncclguard's records time it) or DDP's bucket all_reduce, issued from C++
(``mode: "ddp"``: torch's flight recorder's arrivals time it).

The plan (JSON):

- ``window_s``, ``duration_s``: the straggler window; the loop's length from the common start;
- ``mode``, ``model_s``, ``input_s``, ``elements``: the step (above);
- ``episodes``: ``[{"start", "end", "rank", "cause", "factor"}]`` (seconds from the start): from
  ``start`` to ``end`` rank ``rank`` is slower, by ``cause``: ``compute`` (its model) or ``input`` (its
  data loader) takes ``(factor - 1) * step`` longer, ``step`` being the job's median step time over
  its first ``calibrate_steps`` steps (rank 0's, given to all); ``link`` episodes are the drill's (``tc`` from outside) and
  change nothing here;
- ``clock_offsets``: ``{rank: seconds}``: that rank's wall clock runs ahead by so much: its
  ``time.time()`` and the arrivals torch's recorder gives it are shifted (a host whose clock is off);
- ``stop_after_incidents``: stop once so many straggler incidents are merged (0: run to the end);
- ``records_from_s``: from then on (at a step every rank takes from the store) a ``ddp`` loop calls a
  Python all_reduce instead of DDP (ncclguard's records time it): one launch checks both paths.

Each rank writes (``rankkit``): the common start ``t0`` (true clock), ``step_s``, every step's start
(true clock, seconds from ``t0``), every window it closed, its incidents and its clock offset estimate.
Rank 0 also writes ``t0`` and ``step_s`` to files in the output folder for the drill (``tc`` timing).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from torch.utils.data import DataLoader, Dataset

from ncclguard import init_process_group, mark_step, phase, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.watching.sensors import rank_state

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
TRUE_TIME = time.time  # the host's own clock, whatever offset the plan gives this rank
CPU_SHARE = 0.2  # of each cost, the part spent in matmuls (the rest sleeps, as a device's time would)


def work(reps: int, a: torch.Tensor) -> None:
    for _ in range(reps):
        a = torch.tanh(a @ a)


def per_rep(a: torch.Tensor) -> float:
    work(10, a)
    t0 = time.perf_counter()
    work(100, a)
    return (time.perf_counter() - t0) / 100


def spend(seconds: float, a: torch.Tensor, rep_s: float) -> None:
    """``seconds`` of a step: a sleep, and matmuls for CPU_SHARE of it."""
    if seconds <= 0:
        return
    time.sleep(seconds * (1 - CPU_SHARE))
    work(round(seconds * CPU_SHARE / rep_s), a)


def extra(seconds: float, a: torch.Tensor) -> None:
    """``seconds`` more of a step, by the wall clock: a sleep, then matmuls up to the deadline for
    CPU_SHARE of it (the injected slowdown is what the plan says, whatever the host's load)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    time.sleep(seconds * (1 - CPU_SHARE))
    while time.perf_counter() < end:
        work(1, a)


class Batches(Dataset):
    """An endless data set whose every item costs ``cost`` seconds of work to make, and ``more()`` seconds
    more (the injected slowdown)."""

    def __init__(self, cost: float, more, a: torch.Tensor, rep_s: float) -> None:
        self.cost, self.more, self.a, self.rep_s = cost, more, a, rep_s

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        spend(self.cost, self.a, self.rep_s)
        extra(self.more(), self.a)
        return torch.ones(4)


def skew_clock(offset: float) -> None:
    """This process's wall clock runs ``offset`` ahead: Python's and the arrivals torch records."""
    time.time = lambda: TRUE_TIME() + offset  # type: ignore[assignment]
    original = rank_state.WorldArrivals.arrivals

    def arrivals(self, start: float, end: float, last: int):
        op, got = original(self, start - offset, end - offset, last)
        return op, [(seq, at + offset) for seq, at in got]

    rank_state.WorldArrivals.arrivals = arrivals  # type: ignore[method-assign]


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    if plan.get("episodes") or plan.get("clock_offsets"):  # on every rank: a link's episode comes from outside
        rankkit.fault_fired("the plan's slow episodes and skewed clocks")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    init_process_group("gloo", timeout=120)
    rank = dist.get_rank()
    store = rankkit._job_store()
    a = torch.randn(64, 64) / 10
    rep_s = torch.tensor([per_rep(a)])
    dist.all_reduce(rep_s, op=dist.ReduceOp.MAX)  # one cost of a matmul for all: the same work everywhere
    rep = float(rep_s[0])
    offset = float(plan.get("clock_offsets", {}).get(str(rank), 0.0))
    if offset:
        skew_clock(offset)
    elements, mode = int(plan["elements"]), plan["mode"]
    if mode == "ddp":
        side = max(1, int(elements**0.5))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(side, side, bias=False))
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(2, side)
    state = {"extra_model": 0.0, "extra_input": 0.0}
    loader = iter(DataLoader(Batches(plan["input_s"], lambda: state["extra_input"], a, rep), batch_size=None))
    settings = {
        "heartbeat_s": plan.get("heartbeat_s", 0.5),
        "hang_timeout_s": 120,
        # Not a test of peer liveness: a loaded host (and a slowed link) can hold a heartbeat back
        # for seconds, which at 6 beats of 0.5 s made a drill launch raise a `lost` incident.
        "peer_timeout_s": 30,
        "action": "raise",  # a straggler incident must stop at report all the same
        "straggler_window_s": plan["window_s"],
        "incident_dir": OUT / "incidents",
    }
    wd = start_watchdog(**{**settings, **plan.get("watchdog", {})})
    window_log = rankkit.WindowLog(wd)
    t0 = torch.tensor([TRUE_TIME() + 1.0], dtype=torch.float64)
    dist.broadcast(t0, 0)  # the common start, on rank 0's (true) clock: one host here
    start = float(t0[0])
    while TRUE_TIME() < start:
        time.sleep(0.01)
    calibrate = int(plan.get("calibrate_steps", 60))  # a step number: every rank decides at the same step
    episodes = [e for e in plan.get("episodes", []) if e["rank"] == rank and e["cause"] in ("compute", "input")]
    stop_after = int(plan.get("stop_after_incidents", 0))
    starts: list[float] = []
    step_s: float | None = None
    stop_at: int | None = None
    step = 0
    switch_at: int | None = None  # the step from which a ddp loop is a records loop
    switch_s = plan.get("records_from_s")
    ddp_records: int | None = None  # ncclguard's records of the ddp part (none: DDP issues from C++)
    while stop_at is None or step < stop_at:
        now = TRUE_TIME() - start
        starts.append(round(now, 5))
        if step == calibrate:
            gaps = [b - a for a, b in zip(starts[5:], starts[6:], strict=False)]  # past the first steps' warm-up
            step_t = torch.tensor([statistics.median(gaps)], dtype=torch.float64)
            if mode == "records":
                dist.broadcast(step_t, 0)
            else:  # no Python collective in a DDP-only loop: rank 0's figure through the store
                if rank == 0:
                    store.set("drill/step_s", repr(float(step_t[0])))
                store.wait(["drill/step_s"], timedelta(seconds=60))
                step_t[0] = float(store.get("drill/step_s"))
            step_s = float(step_t[0])
            if rank == 0:
                (OUT / "step_s").write_text(repr(step_s))
                (OUT / "t0").write_text(repr(start))
        live = [e for e in episodes if e["start"] <= now < e["end"]] if step_s is not None else []
        state["extra_model"] = sum((e["factor"] - 1) * step_s for e in live if e["cause"] == "compute")  # type: ignore[operator]
        state["extra_input"] = sum((e["factor"] - 1) * step_s for e in live if e["cause"] == "input")  # type: ignore[operator]
        if stop_at is None:
            merged = [
                c for c in wd.incidents if c["kind"] == "straggler" and (Path(c["dir"]) / INCIDENT_FILE).is_file()
            ]
            if now >= plan["duration_s"] or (stop_after and len(merged) >= stop_after):
                store.compare_set("drill/stop_at", "", str(step + 20))  # the first writer wins
            if store.check(["drill/stop_at"]):
                stop_at = int(store.get("drill/stop_at"))
        if mode == "ddp" and switch_s is not None and switch_at is None:
            if rank == 0 and now >= switch_s:
                store.compare_set("drill/records_at", "", str(step + 10))
            if store.check(["drill/records_at"]):
                switch_at = int(store.get("drill/records_at"))
        ddp_now = mode == "ddp" and (switch_at is None or step < switch_at)
        if mode == "ddp" and not ddp_now and ddp_records is None:
            ddp_records = len([r for r in wd.watch.state.records() if r.start >= start])
            put("records_from_s", now)
        next(loader)
        mark_step(step)
        with phase("train", step=step):
            spend(plan["model_s"], a, rep)
            extra(state["extra_model"], a)
            if ddp_now:
                opt.zero_grad()
                model(x).square().mean().backward()  # DDP's bucket all_reduce, issued from C++
                opt.step()
            else:
                dist.all_reduce(torch.ones(elements))
        step += 1
    if mode == "ddp" and ddp_records is None:
        ddp_records = len([r for r in wd.watch.state.records() if r.start >= start])
    put("ddp_python_ops", ddp_records)
    put("t0", start)
    put("step_s", step_s)
    put("starts", starts)
    put("rep_s", rep)
    put("incidents", wd.incidents)
    clock = wd.sensor("straggler").clock
    put("clock_offset", None if clock is None else clock.estimate)
    put("windows", window_log.stop())
    wd.stop()
    dist.barrier()  # every watchdog stops before any rank leaves (the store may live in rank 0's process)
    rankkit.done()


if __name__ == "__main__":
    main()
