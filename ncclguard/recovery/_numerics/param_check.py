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

__all__ = ["carries_every", "install"]


def _carries(check: GradCheck, param: torch.Tensor) -> bool:
    # A weak reference, not the ``id`` alone: a new parameter at a dead one's address is not hooked.
    # Not an attribute on the parameter: ``copy.deepcopy`` and ``torch.save`` of a module copy those.
    ref = check.hooked.get(id(param))
    return ref is not None and ref() is param


class _Scan:
    """One parameter's hook: notes the scan of the gradient it is handed, changes nothing."""

    def __init__(self, check: GradCheck, index: int, param: torch.Tensor) -> None:
        # A weak reference: the hook lives on the parameter, which must not keep itself alive.
        self.check, self.index, self.param = check, index, weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> None:
        param = self.param()
        self.check.note(self.index, grad, [param] if param is not None else [])


def install(check: GradCheck, module: torch.nn.Module) -> int:
    """Puts the check on every parameter of ``module`` that takes a gradient and does not carry it
    yet (a second hook would scan its gradient twice).

    Args:
        check: the engine's check (its findings named from ``module``'s parameter names).
        module: the module whose gradients are checked.

    Returns:
        How many parameters carry it (0: none takes a gradient; nothing is checked).
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    check.hooked = {k: ref for k, ref in check.hooked.items() if ref() is not None}  # the dead let go
    for index, (_, param) in enumerate(named):
        if _carries(check, param):
            continue
        param.register_hook(_Scan(check, index, param))
        check.hooked[id(param)] = weakref.ref(param)
    if named:
        check.watch(module, {id(p): name for name, p in named})
    return len(named)


def carries_every(check: GradCheck, module: torch.nn.Module) -> bool:
    """Whether each parameter of ``module`` that takes a gradient carries ``check``'s hook: false for a
    module whose parameters were replaced in place (the HF Trainer's new DeepSpeed engine after a redo,
    :func:`~ncclguard.integrations.hf.deepspeed.renew_in_place`)."""
    return all(_carries(check, p) for p in module.parameters() if p.requires_grad)
