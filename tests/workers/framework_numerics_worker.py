"""Rank side of tests/integrations/test_framework_numerics_multirank.py. Usage: framework_numerics_worker.py accelerate|hf|lightning.

``accelerate`` (torchrun, 3 ranks): ``Accelerator(cpu=True)`` makes the group; three runs in a row from
the same start (numerics_worker's 956,042-parameter classifier with dropout, AdamW, its shuffled shard;
the loader is not prepared, so every run sees the same batches), each a model and optimizer
``accelerator.prepare`` wrapped, stepped by ``recovering_step`` for STEPS steps:

1. ``off``: ``on_nonfinite="off"``: no hook, DDP's own path (the reference);
2. ``clean``: ``on_nonfinite="redo"``, no fault: the check on Accelerate's wrapper;
3. ``redo``: the same, rank 1's loss times NaN at step K in the first attempt only.

Then two wrappers the check must leave alone (constructed, not stepped): one that carries a comm hook
of its own, and one prepared with ``gradient_as_bucket_view=True``.

``hf``, ``lightning`` (torchrun, 3 ranks): the same three runs under the HF Trainer
(framework_numerics_hf.py) and Lightning (framework_numerics_lightning.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

STEPS, K = 6, 3  # K >= 2: DDP has rebuilt its buckets (in step 1's forward) by then


class Said(logging.Handler):
    """What the ncclguard logger said at info level and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def accelerate_run(accelerator: Any, base: int, policy: str, fault: bool, every: int | None = None) -> dict[str, Any]:
    """One run from the same start; the loop's step numbers start at ``base`` (they grow across runs);
    with ``every``, replicas checked that often and rank 2's bit flipped once step FLIP_AFTER is applied."""
    from framework_numerics_hf import FLIP_AFTER, replicas_seen
    from numerics_worker import flat, start, summary
    from replicas_worker import BIT, flip

    from ncclguard.integrations.accelerate import recovering_step

    module, opt, _sched, loader = start()
    model, opt = accelerator.prepare(module, opt)
    checks = {} if every is None else {"replica_check_every": every}
    stepper = recovering_step(accelerator, model, opt, on_nonfinite=policy, collective_timeout=30, **checks)
    check = stepper.engine.numerics.check
    carries = check is not None and check.carries(stepper.model)
    results = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        tries: list[int] = []

        def step_fn(
            m: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y, tries: list[int] = tries
        ) -> None:
            tries.append(1)
            loss = torch.nn.functional.cross_entropy(m(x), y)
            if fault and dist.get_rank() == 1 and step == K and len(tries) == 1:
                rankkit.fault_fired(f"a NaN loss at step {K}")
                loss = loss * float("nan")
            accelerator.backward(loss)

        results.append(summary(stepper(step_fn, step=base + step)))
        if every is not None and step == FLIP_AFTER and dist.get_rank() == 2:
            flip(module, BIT)
    seen = [[s.step - base, s.ranks, s.finite_ranks, s.action] for s in stepper.engine.numerics.seen]
    out = {"carries": carries, "results": results, "seen": seen, "params": flat(module)}
    return {**out, "replicas_seen": replicas_seen(stepper.engine, base)}


def left_alone(accelerator: Any, said: Said) -> dict[str, Any]:
    """Two wrappers the check leaves alone, and what the log said of each."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from numerics_worker import start
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ncclguard.integrations.accelerate import recovering_step

    out: dict[str, Any] = {}
    for name in ("own_hook", "bucket_view"):
        said.lines.clear()
        module, opt, _sched, _loader = start()
        if name == "bucket_view":
            kwargs = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
            accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
        model, opt = accelerator.prepare(module, opt)
        if name == "own_hook":
            model.register_comm_hook(dist.group.WORLD, allreduce_hook)
        stepper = recovering_step(accelerator, model, opt, on_nonfinite="redo", collective_timeout=30)
        check = stepper.engine.numerics.check
        out[name] = {
            "carries": check is not None and check.carries(stepper.model),
            "said": [line for line in said.lines if "not checked for NaN" in line],
        }
    return out


def hf() -> None:
    from framework_numerics_hf import hf as run

    run()
    dist.destroy_process_group()
    rankkit.save()


def lightning() -> None:
    from framework_numerics_lightning import lightning as run

    run()
    dist.destroy_process_group()
    rankkit.save()


def accelerate() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # makes the process group (gloo)
    said = Said()
    logging.getLogger("ncclguard").addHandler(said)
    from numerics_worker import same_everywhere

    off = accelerate_run(accelerator, 0, "off", fault=False)
    put("off", {k: v for k, v in off.items() if k != "params"})
    said.lines.clear()
    clean = accelerate_run(accelerator, 100, "redo", fault=False)
    put("clean", {k: v for k, v in clean.items() if k != "params"})
    put("clean_said", [line for line in said.lines if "non-finite" in line or "not checked for NaN" in line])
    redo = accelerate_run(accelerator, 200, "redo", fault=True)
    put("redo", {k: v for k, v in redo.items() if k != "params"})
    put("clean_equal_to_off", torch.equal(clean["params"], off["params"]))
    put("redo_equal_to_off", torch.equal(redo["params"], off["params"]))
    put("redo_same_everywhere", same_everywhere(redo["params"]))
    from framework_numerics_hf import EVERY

    flipped = accelerate_run(accelerator, 300, "redo", fault=False, every=EVERY)
    put("flipped", {k: v for k, v in flipped.items() if k != "params"})
    put("flipped_equal_to_off", torch.equal(flipped["params"], off["params"]))
    put("flipped_same_everywhere", same_everywhere(flipped["params"]))
    put("left_alone", left_alone(accelerator, said))
    dist.barrier()
    dist.destroy_process_group()
    rankkit.save()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    {"accelerate": accelerate, "hf": hf, "lightning": lightning}[sys.argv[1]]()
    sys.exit(0)
