"""eval_mode: evaluation mode on a model and everything it wraps, restored exactly afterwards.

``DeepSpeedEngine.eval()`` calls ``self.module.train(False)`` only: the engine's own ``training``
stays True (deepspeed 0.19; checked by tests/integrations/test_deepspeed_eval_multirank.py),
so code that reads ``engine.training`` still thinks it trains. And ``model.train()`` after an
evaluation would put every submodule in training mode, including ones the user had frozen in eval
mode (a frozen vision tower, say). So the flags of all modules are saved and put back one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["eval_mode"]


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Sets ``model`` (an engine, a wrapper or a plain model) and all its submodules to eval mode.

    The previous ``training`` flag of every module is restored on exit, on an exception too.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module (a model or a DeepSpeed engine), got {type(model).__name__}")
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.eval()  # lets a wrapper do its own bookkeeping (DeepSpeed: module.train(False))
        for m, _ in saved:
            m.training = False
        yield
    finally:
        for m, mode in saved:
            m.training = mode
