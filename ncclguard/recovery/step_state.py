"""What a redone step must find as its failed attempt found it: the module's buffers and torch's
random generators.

A failed step never reached ``optimizer.step()``, so the parameters and the optimizer's state need
no copy. Its forward may have changed buffers (BatchNorm's running statistics) and drawn from the
generators (dropout). :class:`~ncclguard.recovery.recovering.RecoveringStep` and the HF Trainer's
and Lightning's recovery take a :class:`StepState` before a step and restore it before a redo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepState"]


@dataclass(frozen=True)
class StepState:
    """A module's buffers and torch's CPU and CUDA generator states, as they were.

    Attributes:
        buffers: copies of the module's buffers, in ``module.buffers()`` order.
        cpu_rng: torch's CPU generator state.
        cuda_rng: every CUDA device's generator state; empty where CUDA is not initialized.
    """

    buffers: tuple[torch.Tensor, ...]
    cpu_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]

    @classmethod
    def take(cls, module: torch.nn.Module) -> StepState:
        """Copies ``module``'s buffers and the generator states now."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        return cls(tuple(b.detach().clone() for b in module.buffers()), torch.get_rng_state(), cuda)

    def restore(self, module: torch.nn.Module) -> None:
        """Puts the buffers back into ``module`` (the same module, or one of the same structure)
        and the generators back as they were.

        Raises:
            ValueError: ``module`` has another number of buffers than the one taken.
        """
        with torch.no_grad():
            for live, kept in zip(module.buffers(), self.buffers, strict=True):
                live.copy_(kept)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
