"""Rank side of tests/recovery/test_recovering.py's engine scenarios, on a gloo world of one (a process of
its own: the pytest worker keeps no process group).

``reenter``: an adapter whose ``rewrap`` raises ``Reenter`` (the HF Trainer's and Lightning's do,
after a heal: the framework's own loop runs the next attempt). The step's first attempt ran its
backward here and then failed; the next attempt must start with no gradient of the failed one.
"""

from __future__ import annotations

import sys

import rankkit
import torch
from rankkit import put

from ncclguard.errors import NcclGuardError
from ncclguard.recovery.engine import Adapter, Recovery, Reenter
from ncclguard.recovery.options import recovery_options
from ncclguard.recovery.rebuild import RebuildResult


class LoopRunsTheRedo(Adapter):
    name = "test"

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def get_module(self) -> torch.nn.Module:
        return self.module

    def get_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def rewrap(self, rebuilt: RebuildResult) -> None:
        raise Reenter("the framework's loop runs the next attempt")


def reenter() -> None:
    module = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    engine = Recovery(LoopRunsTheRedo(module, opt), recovery_options(commit_timeout=10, rebuild_timeout=10))
    tx = engine.begin(0)

    def backward_then_fail() -> None:
        rankkit.fault_fired("a failed attempt")
        module(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        raise RuntimeError("the gradient all_reduce failed after the local backward")

    tx.run(backward_then_fail)
    put("grad_after_the_failed_attempt", module.weight.grad.tolist())
    try:
        tx.settle(lambda: None)
        put("raised", None)
    except Reenter as exc:
        put("raised", f"Reenter: {exc}")
    except NcclGuardError as exc:
        put("raised", repr(exc))
    put("grads_when_the_loop_goes_on", [p.grad for p in module.parameters()] == [None, None])
    # The loop's next attempt goes on with the same transaction: it commits as a redo.
    tx = engine.begin(0)
    tx.run(lambda: module(torch.ones(1, 2, dtype=torch.float64)).sum().backward())
    res = tx.settle(None)
    put("next_attempt", [res.ok, res.attempts, res.generation, module.weight.grad.tolist()])
    put("recovered", [[r.step, r.attempts, r.generation] for r in engine.recoveries])


if __name__ == "__main__":
    rankkit.init()
    {"reenter": reenter}[sys.argv[1]]()
    rankkit.done()
