"""What a redone step must find as its failed attempt found it: the module's buffers and every
random generator a step draws from.

A failed step never reached ``optimizer.step()``, so the parameters and the optimizer's state need
no copy. Its forward may have changed buffers (BatchNorm's running statistics) and drawn from the
generators: torch's (dropout, on the CPU and on every CUDA device), Python's ``random`` and NumPy's
(data augmentation in user code). The recovery engine (:mod:`ncclguard.recovery.engine`) takes a
:class:`StepState` when a step begins and restores it before each redo, whatever the framework.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepState", "generators_to_send", "load_scheduler", "restore_sent_generators"]


@dataclass(frozen=True)
class StepState:
    """A module's buffers and the generator states, as they were.

    Attributes:
        buffers: copies of the module's buffers, in ``module.buffers()`` order.
        cpu_rng: torch's CPU generator state.
        cuda_rng: every CUDA device's generator state; empty where CUDA is not initialized.
        py_rng: Python's ``random`` state.
        np_rng: NumPy's legacy global generator state, or None without NumPy.
    """

    buffers: tuple[torch.Tensor, ...]
    cpu_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]
    py_rng: Any = None
    np_rng: Any = None

    @classmethod
    def take(cls, module: torch.nn.Module) -> StepState:
        """Copies ``module``'s buffers and the generator states now."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        buffers = tuple(b.detach().clone() for b in module.buffers())
        return cls(buffers, torch.get_rng_state(), cuda, random.getstate(), _numpy_state())

    def restore(self, module: torch.nn.Module) -> None:
        """Puts the buffers back into ``module`` (the same module, or one of the same structure)
        and the generators back as they were.

        Raises:
            ValueError: ``module`` has another number of buffers than the one taken.
        """
        with torch.no_grad():
            for live, kept in zip(module.buffers(), self.buffers, strict=True):
                live.copy_(kept)
        self.restore_generators()

    def restore_generators(self) -> None:
        """Puts every generator back as it was (the buffers are left alone)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))
        if self.py_rng is not None:
            random.setstate(self.py_rng)
        if self.np_rng is not None:
            import numpy

            numpy.random.set_state(self.np_rng)


def generators_to_send(state: StepState) -> dict[str, Any]:
    """The generator states of ``state`` as tensors and JSON values (what a heal can carry).

    Args:
        state: a step's snapshot.

    Returns:
        A dict for :func:`restore_sent_generators`.
    """
    sent: dict[str, Any] = {"cpu": state.cpu_rng, "cuda": list(state.cuda_rng), "py": state.py_rng}
    if state.np_rng is not None:
        name, keys, pos, has_gauss, cached = state.np_rng
        sent["np"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return sent


def restore_sent_generators(sent: dict[str, Any]) -> None:
    """Sets every generator from what :func:`generators_to_send` made (on another process).

    Raises:
        ValueError, TypeError, KeyError: ``sent`` is not of that shape.
    """
    torch.set_rng_state(sent["cpu"])
    if sent.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(sent["cuda"]))
    py = sent.get("py")
    if py is not None:
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    np_state = sent.get("np")
    if np_state is not None:
        import numpy

        name, keys, pos, has_gauss, cached = np_state
        numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a core dependency
        return None
    return numpy.random.get_state()


def load_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """Loads an LR scheduler's state and puts the learning rates it was at back into its optimizer.

    A scheduler's ``load_state_dict`` restores its counters, not the optimizer's ``lr``; a scheduler
    made anew (the HF Trainer's, when its loop is entered again after a join) has just written the
    schedule's first rate there. A checkpoint resume loads the optimizer's state too, which carries
    the rates; a resume fed from memory keeps the optimizer as it is, so the rates are set here.

    Args:
        scheduler: a torch LR scheduler, or Accelerate's wrapper of one.
        state: what its ``state_dict()`` gave.
    """
    scheduler.load_state_dict(state)
    inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps one
    optimizer, rates = getattr(inner, "optimizer", None), getattr(inner, "_last_lr", None)
    if optimizer is None or not isinstance(rates, list) or len(rates) != len(optimizer.param_groups):
        return
    for group, lr in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = lr
