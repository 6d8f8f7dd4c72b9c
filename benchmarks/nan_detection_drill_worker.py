"""Rank side of ``benchmarks/nan_detection_drill.py`` (one torchrun launch of 3 gloo ranks per part).

Usage (under ``torchrun --standalone --nproc-per-node 3``):
    nan_detection_drill_worker.py --part nan|clean|flip --out DIR [--steps N] [--seed S] ...

Every run starts the same way on every rank (``torch.manual_seed``): an MLP classifier with a
LayerNorm and dropout (``--widths``), AdamW, a warm-up LR schedule stepped every iteration, each rank
its own fresh seeded batch each step (labels from a fixed linear teacher), under
``RecoveringStep(..., on_nonfinite="redo", replica_check_every=--every)`` (on_nonfinite set: its
default, ``"auto"``, checks nothing on the CPU). The plan of faults is drawn from ``--seed`` the same
way on every rank; each rank writes ``DIR/rank<r>.json``.

- ``nan``: at ``--injections`` distinct random steps, one random element of one random parameter's
  gradient on one random rank is turned NaN (a tensor hook, as autograd makes it, before DDP's comm
  hook sees its bucket), in the step's first attempt only. Then the same run without a fault from the
  same start (the reference of the final parameters).
- ``clean``: no fault; every finding is a false alarm.
- ``flip``: ``--flips`` trials one after the other, trial k in steps ``[2kP, 2(k+1)P)`` with
  ``P = --every``: after a random step ``s`` of its first period, one random bit (of ``--bits``) of
  one random element of one random parameter of one random rank is flipped; the check of step ``c``
  (the first multiple of ``P`` after ``s``) should name it. After step ``c`` every rank's parameters
  and AdamW state are compared by a SHA-256 of their bytes (independent of the library's digest).
  Then (``--exponent-trials``, the default) one run per rank, each from the same start, of one flip:
  bit 30 of the LayerNorm weight's element 0 (near 1.0, where a norm's weight starts), which makes
  it about 3.4e38 or a NaN: that rank's gradients are then NaN at every step until the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard import RecoveringStep
from ncclguard.recovery.records import StepResult

CLASSES, BATCH = 10, 32  # classes, samples per batch
Hook = Callable[[torch.Tensor], torch.Tensor]


class Net(torch.nn.Module):
    """An MLP classifier: a LayerNorm after the first layer, dropout after each hidden layer;
    ``widths``: input, then hidden sizes."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        sizes = [*widths, CLASSES]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
        self.norm = torch.nn.LayerNorm(widths[1])
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.norm(self.layers[0](x))))
        for layer in self.layers[1:-1]:
            x = self.drop(torch.relu(layer(x)))
        return self.layers[-1](x)


def start(widths: list[int], seed: int) -> tuple[Net, torch.optim.Optimizer, Any, Batches]:
    """Every run's same start: the model (the same on every rank), AdamW, a warm-up schedule, this
    rank's batches."""
    torch.manual_seed(seed)
    model = Net(widths)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    return model, opt, sched, Batches(widths[0], seed)


class Batches:
    """This rank's batch of each step, fresh and seeded (the same on a redo): inputs from a normal
    law, labels from a fixed random linear teacher (the same on every rank), so the loss falls."""

    def __init__(self, features: int, seed: int) -> None:
        self.teacher = torch.randn(features, CLASSES, generator=torch.Generator().manual_seed(seed))
        self.seed, self.rank, self.world = seed, dist.get_rank(), dist.get_world_size()

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * self.world + self.rank)
        x = torch.randn(BATCH, self.teacher.shape[0], generator=g)
        return x, (x @ self.teacher).argmax(dim=1)


def state_sha(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of every parameter's and every AdamW state tensor's bytes (the drill's own check)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for key in sorted(opt.state[p]):
            h.update(opt.state[p][key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def everyone(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def nan_plan(model: Net, steps: int, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` injections at distinct random steps (never step 0): rank, parameter, element."""
    rng = random.Random(seed)
    names = [name for name, _ in model.named_parameters()]
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    plan = []
    for step in sorted(rng.sample(range(1, steps), n)):
        name = rng.choice(names)
        plan.append(
            {
                "step": step,
                "rank": rng.randrange(dist.get_world_size()),
                "param": name,
                "index": rng.randrange(sizes[name]),
            }
        )
    return plan


def flip_plan(model: Net, flips: int, every: int, seed: int, bits: list[int]) -> list[dict[str, Any]]:
    """One flip per trial: after a random step of the trial's first period (see the module doc)."""
    rng = random.Random(seed + 1)
    names = [name for name, _ in model.named_parameters()]
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    plan = []
    for k in range(flips):
        after = 2 * k * every + rng.randrange(every)
        name = rng.choice(names)
        plan.append(
            {
                "kind": "random",
                "after": after,
                "check": (after // every + 1) * every,
                "rank": rng.randrange(dist.get_world_size()),
                "param": name,
                "index": rng.randrange(sizes[name]),
                "bit": rng.choice(bits),
            }
        )
    return plan


def exponent_plan(rank: int, every: int, seed: int) -> list[dict[str, Any]]:
    """The one trial of an exponent run: bit 30 of the LayerNorm weight's element 0 on ``rank`` (near
    1.0: its exponent 126 or 127 becomes 254 or 255, about 3.4e38 or a NaN), after a random step."""
    after = random.Random(seed + 2 + rank).randrange(every)
    return [
        {
            "kind": "norm-exponent",
            "after": after,
            "check": every,
            "rank": rank,
            "param": "norm.weight",
            "index": 0,
            "bit": 30,
        }
    ]


def summary(step: int, res: StepResult[Any]) -> dict[str, Any]:
    return {
        "step": step,
        "ok": bool(res.ok),
        "attempts": res.attempts,
        "rebuilds": res.rebuilds,
        "skipped": res.skipped,
        "commits": [
            {
                "ok": c.ok,
                "failed": c.failed_ranks,
                "nonfinite": {str(r): [b.model_dump() for b in bs] for r, bs in c.nonfinite.items()},
                "finite": c.finite_ranks,
                "drift": c.drift.model_dump() if c.drift is not None else None,
            }
            for c in res.commits
        ],
        "healed": bool(res.healed) if res.healed is not None else None,
        "error": type(res.error).__name__ if res.error is not None else None,
    }


class Warnings(logging.Handler):
    """The ncclguard warnings of a run, each with the loop's step it came in."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.step = -1
        self.seen: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((self.step, record.getMessage()[:400]))


def step_fn(
    x: torch.Tensor, y: torch.Tensor, tries: list[int], fault: tuple[torch.Tensor, Hook] | None
) -> Callable[[torch.nn.Module], float]:
    """The step's forward and backward; ``fault``'s hook on its parameter in the first attempt only."""

    def run(m: torch.nn.Module) -> float:
        tries.append(1)
        handle = fault[0].register_hook(fault[1]) if fault is not None and len(tries) == 1 else None
        try:
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
        finally:
            if handle is not None:
                handle.remove()
        return float(loss.detach())

    return run


def train(
    ns: argparse.Namespace,
    steps: int,
    base: int,
    every: int | None,
    hook_for: Callable[[int, Net], tuple[torch.Tensor, Hook] | None] | None = None,
    after: Callable[[int, Net, torch.optim.Optimizer], None] | None = None,
) -> dict[str, Any]:
    """One run of ``steps`` steps (numbered ``base + step`` for the engine). ``hook_for(step, model)``:
    the parameter and gradient hook of this rank's fault in the step's first attempt, or None;
    ``after(step, model, opt)``: called once the step's result is in (the flips)."""
    model, opt, sched, batches = start(ns.widths, ns.seed)
    stepper = RecoveringStep(
        model,
        opt,
        scheduler=sched,
        collective_timeout=ns.collective_timeout,
        on_nonfinite="redo",
        replica_check_every=every,
    )
    assert stepper.engine.numerics.check is not None and stepper.engine.numerics.check.installed
    warn = Warnings()
    logging.getLogger("ncclguard").addHandler(warn)
    unusual: list[dict[str, Any]] = []
    step_s: list[float] = []
    all_finite = 0  # commits whose outcome names every rank checked and finite
    t0 = time.monotonic()
    for step in range(steps):
        x, y = batches[step]
        tries: list[int] = []
        fault = hook_for(step, model) if hook_for is not None else None

        warn.step = step
        s0 = time.monotonic()
        res = stepper(step_fn(x, y, tries, fault), step=base + step)
        step_s.append(time.monotonic() - s0)
        sched.step()
        all_finite += sum(len(c.finite_ranks) == dist.get_world_size() for c in res.commits)
        if fault is not None or not res.ok or res.attempts != 1 or any(not c.ok for c in res.commits):
            unusual.append({**summary(step, res), "tries": len(tries), "faulted_here": fault is not None})
        if after is not None:
            after(step, model, opt)
    logging.getLogger("ncclguard").removeHandler(warn)
    wall = time.monotonic() - t0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    step_s.sort()
    return {
        "steps": steps,
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": round(wall, 2),
        "step_ms": {
            "p50": round(1000 * step_s[len(step_s) // 2], 2),
            "p99": round(1000 * step_s[int(0.99 * len(step_s))], 2),
        },
        "commits_all_checked_finite": all_finite,
        "unusual": unusual,
        "seen_nonfinite": [
            {"step": s.step - base, "ranks": s.ranks, "finite": s.finite_ranks, "action": s.action}
            for s in stepper.engine.numerics.seen
        ],
        "seen_drift": [
            {"step": s.step - base, "ranks": s.ranks, "parts": s.parts, "source": s.source, "healed": s.healed}
            for s in stepper.engine.replicas.seen
        ],
        "suspects": list(stepper.engine.numerics.suspects.named),
        "recoveries": len(stepper.recoveries),
        "warnings": warn.seen,
        "finite": bool(torch.isfinite(flat).all()),
        "sha": state_sha(model, opt),
        "_flat": flat,
    }


def nan_hook(index: int) -> Hook:
    def poison(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[index] = math.nan
        return g

    return poison


def part_nan(ns: argparse.Namespace) -> dict[str, Any]:
    me = dist.get_rank()
    plan = nan_plan(Net(ns.widths), ns.steps, ns.injections, ns.seed)
    by_step = {p["step"]: p for p in plan}

    def hook_for(step: int, model: Net) -> tuple[torch.Tensor, Hook] | None:
        p = by_step.get(step)
        if p is None or p["rank"] != me:
            return None
        return dict(model.named_parameters())[p["param"]], nan_hook(p["index"])

    injected = train(ns, ns.steps, 0, ns.every, hook_for)
    reference = train(ns, ns.steps, 10**7, ns.every)
    flat, ref = injected.pop("_flat"), reference.pop("_flat")
    return {
        "plan": plan,
        "injected": injected,
        "reference": reference,
        "equal_to_reference": bool(torch.equal(flat, ref)),
        "shas": everyone(injected["sha"]),
    }


def part_clean(ns: argparse.Namespace) -> dict[str, Any]:
    run = train(ns, ns.steps, 0, ns.every)
    run.pop("_flat")
    return {"clean": run, "shas": everyone(run["sha"])}


def flip_run(ns: argparse.Namespace, plan: list[dict[str, Any]], base: int) -> dict[str, Any]:
    """A run of ``2 * len(plan) * every + 1`` steps with the flips of ``plan`` (filled in: each flip's
    value before and after it, and ``erased_at``: the first step after it whose update left every
    rank's state bit-equal again, if one did before the check); after each check's step, whether
    every rank holds the same state (SHA-256) and finite parameters."""
    me = dist.get_rank()
    by_after = {p["after"]: p for p in plan}
    by_check = {p["check"]: p for p in plan}
    checks: list[dict[str, Any]] = []
    watched: list[dict[str, Any]] = []  # the trial between its flip and its check

    def after(step: int, model: Net, opt: torch.optim.Optimizer) -> None:
        w = watched[-1] if watched else None
        if w is not None and w["after"] < step < w["check"] and w["erased_at"] is None:
            # Did the update round the flipped bit away? Its word first, then the whole state.
            word = int(dict(model.named_parameters())[w["param"]].data.view(-1).view(torch.int32)[w["index"]])
            if len(set(everyone(word))) == 1 and len(set(everyone(state_sha(model, opt)))) == 1:
                w["erased_at"] = step
        p = by_after.get(step)
        if p is not None:
            p["erased_at"] = None
            watched.append(p)
            values = None
            if me == p["rank"]:
                with torch.no_grad():
                    words = dict(model.named_parameters())[p["param"]].data.view(-1).view(torch.int32)
                    before = float(words[p["index"]].view(torch.float32))
                    words[p["index"]] ^= 1 << p["bit"] if p["bit"] < 31 else -(1 << 31)
                    values = [before, float(words[p["index"]].view(torch.float32))]
            p["values"] = next(v for v in everyone(values) if v is not None)
            p["differs_after_flip"] = len(set(everyone(state_sha(model, opt)))) > 1
        if step in by_check:
            finite = all(everyone(all(bool(torch.isfinite(q).all()) for q in model.parameters())))
            equal = len(set(everyone(state_sha(model, opt)))) == 1
            checks.append({"check": step, "equal_after_check": equal, "finite_after_check": finite})

    run = train(ns, 2 * len(plan) * ns.every + 1, base, ns.every, after=after)
    run.pop("_flat")
    return {"plan": plan, "checks": checks, "run": run, "shas": everyone(run["sha"])}


def part_flip(ns: argparse.Namespace) -> dict[str, Any]:
    """The random flips in one run; then, with ``--exponent-trials``, one exponent run per rank
    (each from the same start: such a flip on rank 0 may leave no replica to heal from)."""
    doc: dict[str, Any] = {"flip": flip_run(ns, flip_plan(Net(ns.widths), ns.flips, ns.every, ns.seed, ns.bits), 0)}
    if ns.exponent_trials:
        doc["exponent"] = [
            flip_run(ns, exponent_plan(r, ns.every, ns.seed), (r + 1) * 10**7) for r in range(dist.get_world_size())
        ]
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("nan", "clean", "flip"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--injections", type=int, default=50)
    ap.add_argument("--flips", type=int, default=10)
    ap.add_argument("--every", type=int, default=100, help="replica_check_every")
    ap.add_argument("--bits", type=int, nargs="+", default=list(range(32)))
    ap.add_argument("--exponent-trials", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048, 512])
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    ns = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)  # three ranks on the host's cores: one thread each
    t0 = time.monotonic()
    doc = {"nan": part_nan, "clean": part_clean, "flip": part_flip}[ns.part](ns)
    doc["launch_rank_s"] = round(time.monotonic() - t0, 2)
    (ns.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(doc, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter finalization: 1 launch in 6 here, a gloo work thread freed a finished barrier
    # (holding all_gather_object's Python tensors) while the interpreter was finalizing; its GIL take
    # ended the thread inside a C++ destructor: "terminate called without an active exception" (gdb).
    os._exit(0)


if __name__ == "__main__":
    main()
