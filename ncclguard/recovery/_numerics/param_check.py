"""The check of each parameter's gradient before a framework reduces it: a hook on the parameter.

Where ncclguard cannot reach a framework's reduction (DeepSpeed's ZeRO reduces each gradient in its
own hooks, on ``AccumulateGrad``, and takes no comm hook), it can still see each gradient as
autograd hands it over: a hook on the parameter (``Tensor.register_hook``) runs on this rank's
gradient before it is accumulated into ``.grad``, so before any hook that runs after the
accumulation reduces it. :func:`install` puts one on every parameter that takes a gradient; each
queues one scan of the gradient (:meth:`~ncclguard.recovery._numerics.hook.GradCheck.note`) and
returns nothing, so the gradient goes on unchanged. A "bucket" is then one parameter: its index
counts the parameters that take a gradient, in the module's order.
"""

from __future__ import annotations

import weakref

import torch

from ncclguard.recovery._numerics.hook import GradCheck

__all__ = ["install"]


class _Scan:
    """One parameter's hook: notes the scan of the gradient it is handed, changes nothing."""

    def __init__(self, check: GradCheck, index: int, param: torch.Tensor) -> None:
        # A weak reference: the hook lives on the parameter, which must not keep itself alive.
        self.check, self.index, self.param = check, index, weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> None:
        param = self.param()
        self.check.note(self.index, grad, [param] if param is not None else [])


def install(check: GradCheck, module: torch.nn.Module) -> int:
    """Puts the check on every parameter of ``module`` that takes a gradient.

    Args:
        check: the engine's check (its findings named from ``module``'s parameter names).
        module: the module whose gradients are checked.

    Returns:
        How many parameters carry it (0: none takes a gradient; nothing is checked).
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    for index, (_, param) in enumerate(named):
        param.register_hook(_Scan(check, index, param))
    if named:
        check.watch(module, {id(p): name for name, p in named})
    return len(named)
