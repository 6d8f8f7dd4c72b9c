"""Rank side of tests/recovery/test_numerics_multirank.py. Usage: numerics_worker.py drill.

``drill`` (torchrun, 3 ranks): one launch, five runs in a row on the same world, each from the same
start (seed, model, data), a model of 956,042 parameters with dropout, AdamW, a warm-up LR schedule
stepped every iteration, shuffled data (DistributedSampler), STEPS steps, every default of
RecoveringStep unless said (``on_nonfinite="redo"`` where nothing else is said: the default,
``"auto"``, checks a model on a GPU only), each step in phase ``train``:

1. ``clean``: no fault (the reference of ``redo``).
2. ``redo``: rank 1's gradient of ``fc1.weight`` turned NaN at step K, first attempt only.
3. ``skip``: ``on_nonfinite="skip"``, rank 1's ``fc1.weight`` gradient turned Inf at steps K and K2.
4. ``plain``: the reference of ``skip``: a plain DDP loop, no ncclguard, that skips batches K and K2
   (the scheduler stepped every iteration, as in ``skip``).
5. ``raise``: ``on_nonfinite="raise"``, NaN on rank 1 at step K of a 4-step run.

Then ``safe_all_reduce``'s input check: rank 1's input NaN with ``check_finite=True``, a finite call
after it, rank 2's input Inf with ``verify=True`` under ``Config.check_finite="verified"``, and rank 1's
NaN with ``verify=True`` under the default (``"never"``: not checked).

A watchdog runs on every rank throughout (numerics_views.py): each finding is raised as a
``numerics`` incident; once the four findings' incidents are merged, rank 0 reads ``ncclguard
status`` from the job's store.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from numerics_views import merged, status, watch
from rankkit import put
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ncclguard import RecoveringStep, configure, phase, safe_all_reduce
from ncclguard.errors import NonFiniteGradient
from ncclguard.recovery.records import StepResult

STEPS, K, K2 = 8, 3, 6  # K >= 2: DDP has rebuilt its buckets (in step 1's forward) by then
BATCH, FEATURES, CLASSES = 8, 64, 10


class Net(torch.nn.Module):
    """A 956,042-parameter classifier with dropout after each hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 512)
        self.fc2 = torch.nn.Linear(512, 1024)
        self.fc3 = torch.nn.Linear(1024, 384)
        self.head = torch.nn.Linear(384, CLASSES)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.fc1, self.fc2, self.fc3):
            x = self.drop(torch.relu(layer(x)))
        return self.head(x)


def start() -> tuple[Net, torch.optim.Optimizer, Any, DataLoader]:
    """Every run's same start: the model, AdamW, a warm-up schedule, the shuffled shard of this rank."""
    torch.manual_seed(1234)  # the same on every rank: DDP's first broadcast changes nothing
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    g = torch.Generator().manual_seed(99)
    n = BATCH * STEPS * dist.get_world_size()
    data = TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    return model, opt, sched, DataLoader(data, batch_size=BATCH, sampler=sampler)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def poisoned(model: Net, value: float) -> Callable[[], None]:
    """Adds ``value`` (NaN or Inf) to ``fc1.weight``'s gradient as autograd makes it, before DDP's
    hook sees its bucket; returns the undo."""
    handle = model.fc1.weight.register_hook(lambda g: g + value)
    return handle.remove


def summary(res: StepResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "attempts": res.attempts,
        "rebuilds": res.rebuilds,
        "skipped": res.skipped,
        "commits": [[c.ok, c.failed_ranks] for c in res.commits],
        "nonfinite": [{str(r): [b.model_dump() for b in bs] for r, bs in c.nonfinite.items()} for c in res.commits],
        "finite": [c.finite_ranks for c in res.commits],
        "error": type(res.error).__name__ if res.error is not None else None,
    }


def stepper_run(base: int, faults: dict[int, float], once: bool, steps: int = STEPS, **options: Any) -> dict[str, Any]:
    """A run through RecoveringStep; ``faults``: by step, what rank 1's gradient gets (``once``: in
    the first attempt only). The loop's step numbers start at ``base`` (they grow across runs)."""
    model, opt, sched, loader = start()
    options.setdefault("on_nonfinite", "redo")
    stepper = RecoveringStep(model, opt, scheduler=sched, collective_timeout=30, **options)
    me, results, error = dist.get_rank(), [], None
    assert stepper.engine.numerics.check is not None and stepper.engine.numerics.check.installed
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        tries: list[int] = []

        def step_fn(
            m: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y, tries: list[int] = tries
        ) -> float:
            tries.append(1)
            bad = me == 1 and step in faults and (len(tries) == 1 or not once)
            if bad:
                rankkit.fault_fired(f"a gradient of {faults[step]} at step {step}")
            undo = poisoned(model, faults[step]) if bad else None
            try:
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
            finally:
                if undo is not None:
                    undo()
            return float(loss.detach())

        before = flat(model).clone()
        try:
            with phase("train"):  # the finding's incident names its phase
                res = stepper(step_fn, step=base + step)
        except NonFiniteGradient as exc:
            error = {"step": exc.step, "ranks": exc.ranks, "finite": exc.finite_ranks, "action": exc.action}
            error["buckets"] = {str(r): b for r, b in exc.buckets.items()}
            error["untouched"] = torch.equal(flat(model), before)
            break
        sched.step()
        results.append(summary(res))
    seen = [[s.step - base, s.ranks, s.finite_ranks, s.action] for s in stepper.engine.numerics.seen]
    return {
        "results": results,
        "seen": seen,
        "suspects": list(stepper.engine.numerics.suspects.named),
        "recoveries": len(stepper.recoveries),
        "raised": error,
        "params": flat(model),
    }


def plain_run(skip: set[int]) -> torch.Tensor:
    """A plain DDP loop from the same start that leaves the batches ``skip`` out."""
    model, opt, sched, loader = start()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step, (x, y) in enumerate(loader):
        if step not in skip:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        sched.step()
    return flat(model)


def same_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], u) for u in everyone)


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()  # NaN compared bit for bit


def all_reduce_checks(me: int) -> dict[str, Any]:
    nan, inf = float("nan"), float("inf")
    said: dict[str, Any] = {}
    for name, value, who, kwargs, setting in (
        ("checked", nan, 1, {"check_finite": True}, "never"),
        ("finite_after", None, None, {"check_finite": True}, "never"),
        ("verified", inf, 2, {"verify": True}, "verified"),
        ("default", nan, 1, {"verify": True}, "never"),
    ):
        configure(check_finite=setting)
        t = torch.arange(4, dtype=torch.float32) + me
        if me == who:
            t[2] = value
        before = bits(t)
        res = safe_all_reduce(t, timeout=20, **kwargs)
        err = res.error
        said[name] = {
            "ok": res.ok,
            "error": type(err).__name__ if err is not None else None,
            "ranks": getattr(err, "ranks", None),
            "kinds": {str(r): k for r, k in getattr(err, "kinds", {}).items()},
            "nothing_reduced": "nothing was reduced" in str(err),
            "untouched": bits(t) == before,
            "values": [v if v == v else "nan" for v in t.tolist()],
        }
    return said


def drill() -> None:
    rankkit.init(timeout_s=60)
    me = dist.get_rank()
    wd = watch()
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("ncclguard").addHandler(Keep())
    t0 = time.monotonic()
    clean = stepper_run(0, {}, once=True)
    put("clean", {k: v for k, v in clean.items() if k != "params"})
    put("clean_warnings", list(warnings))
    redo = stepper_run(100, {K: float("nan")}, once=True)
    put("redo", {k: v for k, v in redo.items() if k != "params"})
    put("redo_equal_to_clean", torch.equal(redo["params"], clean["params"]))
    put("redo_same_everywhere", same_everywhere(redo["params"]))
    warnings.clear()
    skip = stepper_run(200, {K: float("inf"), K2: float("inf")}, once=False, on_nonfinite="skip")
    put("skip", {k: v for k, v in skip.items() if k != "params"})
    put("skip_suspect_warnings", [w for w in warnings if "device is suspect" in w])
    reference = plain_run({K, K2})
    put("skip_equal_to_plain", torch.equal(skip["params"], reference))
    put("skip_same_everywhere", same_everywhere(skip["params"]))
    put("skip_differs_from_clean", not torch.equal(skip["params"], clean["params"]))
    put("finite", all(bool(torch.isfinite(r["params"]).all()) for r in (clean, redo, skip)))
    raised = stepper_run(300, {K: float("nan")}, once=False, steps=4, on_nonfinite="raise")
    put("raise", {k: v for k, v in raised.items() if k != "params"})
    put("runs_s", time.monotonic() - t0)
    put("all_reduce", all_reduce_checks(me))
    put("incidents", merged(wd, 4))  # redo's NaN, skip's two Infs, raise's NaN
    if me == 0:
        put("status", status())
    dist.barrier()
    dist.destroy_process_group()
    rankkit.save()


if __name__ == "__main__":
    {"drill": drill}[sys.argv[1]]()
    sys.exit(0)
