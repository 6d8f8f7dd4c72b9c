"""Where the fixed cost of a guarded call goes at 1 element (gloo, 2 ranks on this host).

    .venv/bin/python benchmarks/small_call_cost.py [--iters 3000]

Times, interleaved per iteration after a barrier, an ablation from a plain synchronous
``dist.all_reduce`` up to ``safe_all_reduce``, each case adding one piece of the guarded call's
hot path (``ncclguard.collectives.all_reduce``; the pieces are re-typed here, a diagnosis, not
an API):

1. ``dist.all_reduce(t)``, the plain call;
2. the same issued with ``async_op=True`` and waited on with a timeout (what the guard does);
3. + the group's plan and the call's shape looked up (the input checked once per shape);
4. + what runs after the issue: the call's number, the default deadline, the result object;
5. ``safe_all_reduce(t)`` with the flight recorder replaced by a no-op (diagnosis only: it
   shows what ``recorder.start``/``finish`` of ncclguard.diagnosis cost inside the call);
6. ``safe_all_reduce(t)``, the real call.

Every case reports min, p5 and p50 of the slowest rank's time. Results:
``benchmarks/results/small-call-cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "small-call-cost.json"


def _rank(iters: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from ncclguard.bench.formulas import slowest_per_iteration
    from ncclguard.collectives import all_reduce as ar
    from ncclguard.collectives.plan import CallShape, GroupPlan, plan_for
    from ncclguard.config import get_config

    dist.init_process_group("gloo")
    t = torch.ones(1)
    token = torch.zeros(1)
    wait = timedelta(seconds=60)
    op = dist.ReduceOp.SUM
    ar.safe_all_reduce(t)  # builds the group's plan and the call's shape

    def checked() -> tuple[GroupPlan, CallShape]:
        plan = plan_for(None)
        assert plan is not None and plan.multi and get_config() is plan.config
        shape = plan.shape(t, op, None)
        assert shape.direct and t.is_contiguous()
        return plan, shape

    def with_checks() -> None:
        plan, shape = checked()
        dist.all_reduce(t, op=shape.wire_op, group=plan.group, async_op=True).wait(timeout=wait)

    def with_bookkeeping() -> None:
        start = time.monotonic()
        plan, shape = checked()
        work = dist.all_reduce(t, op=shape.wire_op, group=plan.group, async_op=True)
        base, counter = plan.count.current
        _number = (base, next(counter))
        timeout_s = plan.default_timeout(shape, start)
        work.wait(timeout=plan.whole_wait(timeout_s))
        ar.CollectiveResult(True, shape.opname, shape.numel, shape.nbytes, 1, shape.numel, time.monotonic() - start)

    class _NoRecorder:
        def open_fast(self, *args: object, **kwargs: object) -> None:
            return None

        def close_ok(self, *args: object, **kwargs: object) -> None:
            return None

        def finish(self, *args: object, **kwargs: object) -> None:
            return None

    def _no_open(*args: object) -> None:
        return None

    def _no_close(rec: object) -> None:
        return None

    def without_recorder() -> None:
        # The recorder's doors as safe_all_reduce binds them (flight.doors(); before issue 29 it
        # called recorder.open_fast/close_ok, so a tree without the doors gets a no-op recorder).
        doors = getattr(ar, "_open_record", None) is not None
        saved = (ar._open_record, ar._close_record) if doors else ar.recorder
        if doors:
            ar._open_record, ar._close_record = _no_open, _no_close
        else:
            ar.recorder = _NoRecorder()  # type: ignore[assignment]
        try:
            ar.safe_all_reduce(t)
        finally:
            if doors:
                ar._open_record, ar._close_record = saved  # type: ignore[misc]
            else:
                ar.recorder = saved  # type: ignore[assignment]

    def bookkeeping_first() -> None:
        # The same work as with_bookkeeping, all of it before the issue: the thread then goes
        # straight from the issue into the wait, as a plain blocking call does.
        start = time.monotonic()
        plan, shape = checked()
        base, counter = plan.count.current
        _number = (base, next(counter))
        timeout_s = plan.default_timeout(shape, start)
        wait_for = plan.whole_wait(timeout_s)
        dist.all_reduce(t, op=shape.wire_op, group=plan.group, async_op=True).wait(timeout=wait_for)
        ar.CollectiveResult(True, shape.opname, shape.numel, shape.nbytes, 1, shape.numel, time.monotonic() - start)

    cases = {
        "dist.all_reduce(t)": lambda: dist.all_reduce(t),
        "async_op=True + wait(timeout)": lambda: dist.all_reduce(t, async_op=True).wait(timeout=wait),
        "+ plan and shape lookup": with_checks,
        "+ number, default deadline, result": with_bookkeeping,
        "the same, all before the issue": bookkeeping_first,
        "safe_all_reduce(t), recorder a no-op": without_recorder,
        "safe_all_reduce(t)": lambda: ar.safe_all_reduce(t),
    }
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(iters + 200):
        for k in range(len(names)):
            name = names[(it + k) % len(names)]
            dist.all_reduce(token)
            a = time.perf_counter()
            cases[name]()
            if it >= 200:
                times[name].append(time.perf_counter() - a)
    mine = torch.tensor([times[n] for n in names], dtype=torch.float64)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    if dist.get_rank() == 0:
        rows = []
        base = None
        for i, n in enumerate(names):
            us = np.asarray(slowest_per_iteration([p[i].tolist() for p in parts])) * 1e6
            row = {
                "case": n,
                "min_us": round(float(us.min()), 1),
                "p5_us": round(float(np.percentile(us, 5)), 1),
                "p50_us": round(float(np.median(us)), 1),
            }
            base = base or row
            row["x_plain_min"] = round(row["min_us"] / base["min_us"], 3)
            row["x_plain_p5"] = round(row["p5_us"] / base["p5_us"], 3)
            row["x_plain_p50"] = round(row["p50_us"] / base["p50_us"], 3)
            rows.append(row)
            print(
                f"{n:40s} min {row['min_us']:6.1f}  p5 {row['p5_us']:6.1f}  p50 {row['p50_us']:6.1f} us  "
                f"x{row['x_plain_p5']:.2f} (p5)",
                flush=True,
            )
        OUT.parent.mkdir(parents=True, exist_ok=True)
        doc = {"numel": 1, "iters": iters, "loadavg_1min_after": round(os.getloadavg()[0], 2), "rows": rows}
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    from ncclguard.testing.launch import spawn, under_launcher

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    ns = ap.parse_args()
    if under_launcher():
        _rank(ns.iters)
    res = spawn([sys.executable, __file__, "--iters", str(ns.iters)], 2, timeout_s=600, capture=False)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
