"""Rank side of tests/recovery/test_fsdp2_numerics_multirank.py. Usage: fsdp2_numerics_worker.py.

torchrun, 3 ranks, gloo: three runs in a row from the same start (numerics_worker's 956,042-parameter
classifier with dropout, AdamW, a warm-up schedule, its shuffled shard), each through
``RecoveringStep(..., wrap=FSDP2(each Linear, then the root))`` for STEPS steps:

1. ``off``: ``on_nonfinite="off"``: FSDP2's own reduce-scatters (the reference);
2. ``clean``: ``on_nonfinite="redo"``, no fault: each FSDP module's reduce-scatter checked;
3. ``redo``: the same, rank 1's loss times NaN at step K in the first attempt (its every gradient NaN).

Then ``on_nonfinite="auto"`` (FSDP2 left unchecked, said once). Each run's full parameters and AdamW
state are gathered over the world at its end.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from framework_numerics_worker import Said
from numerics_worker import start, summary
from rankkit import put
from recovering_worker import full_state  # the full parameters and Adam's state, gathered

from ncclguard import FSDP2, RecoveringStep

STEPS, K = 6, 3


def shard(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in (module.fc1, module.fc2, module.fc3, module.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def run(base: int, policy: str, fault: bool) -> dict[str, Any]:
    module, opt, sched, loader = start()
    stepper = RecoveringStep(
        module, opt, scheduler=sched, wrap=FSDP2(shard), on_nonfinite=policy, collective_timeout=30
    )
    check = stepper.engine.numerics.check
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
                loss = loss * float("nan")  # every gradient of this rank: FSDP2 reduces the unsharded ones
            loss.backward()

        res = stepper(step_fn, step=base + step)
        sched.step()
        results.append(summary(res))
    seen = [[s.step - base, s.ranks, s.finite_ranks, s.action] for s in stepper.engine.numerics.seen]
    carries = check is not None and check.carries(stepper.model)
    return {"carries": carries, "results": results, "seen": seen, "state": full_state(stepper)}


def main() -> None:
    dist.init_process_group("gloo")
    said = Said()
    logging.getLogger("ncclguard").addHandler(said)
    out = {}
    for name, base, policy, fault in (
        ("off", 0, "off", False),
        ("clean", 100, "redo", False),
        ("redo", 200, "redo", True),
    ):
        said.lines.clear()
        out[name] = run(base, policy, fault)
        put(name, {k: v for k, v in out[name].items() if k != "state"})
        put(f"{name}_said", [line for line in said.lines if "non-finite" in line or "not checked for NaN" in line])
    put("clean_equal_to_off", torch.equal(out["clean"]["state"], out["off"]["state"]))
    put("redo_equal_to_off", torch.equal(out["redo"]["state"], out["off"]["state"]))
    said.lines.clear()
    auto = run(300, "auto", False)
    put("auto", {"carries": auto["carries"], "said": [line for line in said.lines if "not checked for NaN" in line]})
    dist.barrier()
    dist.destroy_process_group()
    rankkit.save()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main()
    sys.exit(0)
