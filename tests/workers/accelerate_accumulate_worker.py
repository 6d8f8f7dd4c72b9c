"""Rank side of tests/integrations/test_accelerate_accumulate_multirank.py: ``recovering_step`` in an Accelerate loop
with ``Accelerator(gradient_accumulation_steps=3)``, 3 gloo ranks under torchrun, CPU, DDP (the group
keeps Accelerate's timeout; ncclguard's ``collective_timeout`` bounds a window's collectives at 3 s).

First what Accelerate does with its FSDP plugin on the CPU (the model it prepares, its distributed
type) and what ``recovering_step`` says to it. Then a model with BatchNorm (buffers DDP broadcasts in
every forward) and Dropout (the generators), Adam and a StepLR scheduler prepared by Accelerate, a
data loader prepared by Accelerate (3 windows of 3 micro-batches per rank and epoch, 2 epochs):

- the reference: Accelerate's own loop, ``with accelerator.accumulate(model):`` around each
  micro-batch, ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()`` (Accelerate
  skips them on all but a window's last micro-batch);
- the same from the same start through ``stepper(micro_step, batch, step=i)``, with two faults: in
  window 2 rank 2 stalls 9 s in the first micro-batch (under ``no_sync``), in window 4 rank 1 raises
  in the second. Both windows are redone whole on a rebuilt world; the run ends bit-equal.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard.recovery.rebuild import generation

rankkit.rank = lambda: int(os.environ["RANK"])
ME = int(os.environ["RANK"])
ACC, WINDOWS = 3, 6  # micro-batches per window, windows in all (2 epochs of 3)
BOUND_S, STALL_S = 3.0, 9.0
FAULTS = {2: {(2, 0): "stall"}, 1: {(4, 1): "raise"}}.get(ME, {})  # (window, micro-batch)


def fsdp_plugin_on_cpu() -> dict[str, Any]:
    """What Accelerate makes of its FSDP plugin here, and what recovering_step says to it."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState

    from ncclguard.integrations.accelerate import recovering_step

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    module = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    seen = {
        "distributed_type": str(accelerator.distributed_type.value),
        "model": type(model).__name__,
        "use_fsdp_variable": os.environ.get("ACCELERATE_USE_FSDP"),
    }
    try:
        recovering_step(accelerator, model, opt)
        seen["refused"] = None
    except ValueError as exc:
        seen["refused"] = str(exc)
    # Accelerate's state is per process: start the real run from a fresh one, without the plugin.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    return seen


def make(accelerator: Any) -> tuple[Any, Any, Any, Any, torch.nn.Module]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
    ).double()
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3 * 3 * ACC * 4, 4, generator=gen, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh())
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, sched, loader = accelerator.prepare(module, opt, sched, loader)
    return model, opt, sched, loader, module


def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    noise = torch.rand(x.shape, dtype=x.dtype) * 1e-3  # differs if the generators were not restored
    return torch.nn.functional.mse_loss(model(x + noise), y)


def reference(accelerator: Any) -> tuple[torch.nn.Module, Any, Any]:
    model, opt, sched, loader, module = make(accelerator)
    for _ in range(WINDOWS // 3):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, batch))
                opt.step()
                sched.step()
                opt.zero_grad()
    return module, opt, sched


def faulty(accelerator: Any) -> tuple[torch.nn.Module, Any, Any, Any, list[Any], list[Any]]:
    from ncclguard.integrations.accelerate import recovering_step

    model, opt, sched, loader, module = make(accelerator)
    stepper = recovering_step(
        accelerator, model, opt, collective_timeout=BOUND_S, commit_timeout=30, rebuild_timeout=30
    )
    tries: dict[tuple[int, int], int] = {}
    seen: list[list[int]] = []  # [window, micro-batch, generation] of each micro_step run

    def micro_step(model: torch.nn.Module, batch: Any, where: tuple[int, int]) -> None:
        tries[where] = tries.get(where, 0) + 1
        seen.append([*where, generation()])
        if tries[where] == 1 and FAULTS.get(where) == "stall":
            rankkit.fault_fired(f"stall in micro-batch {where}")
            time.sleep(STALL_S)
        if tries[where] == 1 and FAULTS.get(where) == "raise":
            rankkit.fault_fired(f"raise in micro-batch {where}")
            raise RuntimeError(f"rank {ME}: a bad micro-batch {where}")
        accelerator.backward(loss_of(model, batch))

    results: list[list[Any]] = []
    i = 0
    for _ in range(WINDOWS // 3):
        for batch in loader:
            res = stepper(micro_step, batch, divmod(i, ACC), step=i)
            if res:
                sched.step()  # prepared: Accelerate steps it on a window's last micro-batch only
            results.append([i, res.ok, res.pending, res.attempts, res.generation])
            i += 1
    return module, opt, sched, stepper, results, seen


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def adam_state(opt: Any) -> torch.Tensor:
    return flat(v for s in opt.state_dict()["state"].values() for _, v in sorted(s.items()) if torch.is_tensor(v))


def equal_across_ranks(mine: torch.Tensor) -> bool:
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    from accelerate import Accelerator

    put("fsdp_plugin", fsdp_plugin_on_cpu())
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACC)
    ref, ref_opt, ref_sched = reference(accelerator)
    module, opt, sched, stepper, results, seen = faulty(accelerator)
    put("results", results)
    put("seen", seen)
    put("recoveries", [[r.step, r.attempts, r.generation, r.world_size] for r in stepper.recoveries])
    put("lr", [sched.get_last_lr()[0], ref_sched.get_last_lr()[0]])
    put("params_equal_to_reference", torch.equal(flat(module.parameters()), flat(ref.parameters())))
    put("buffers_equal_to_reference", torch.equal(flat(module.buffers()), flat(ref.buffers())))
    put("adam_equal_to_reference", torch.equal(adam_state(opt), adam_state(ref_opt)))
    put("equal_across_ranks", equal_across_ranks(flat(module.parameters())))
    put("final", [dist.get_rank(), dist.get_world_size(), generation()])
    rankkit.done()


if __name__ == "__main__":
    main()
