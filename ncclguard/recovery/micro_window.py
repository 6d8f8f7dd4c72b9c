"""The micro-batch window: the micro-batches of one optimizer step under gradient accumulation,
recorded as they run so that a failed step can run them all again on a rebuilt world.

A step made of several micro-batches commits once, after its last; if the commit fails, every
micro-batch of the window runs again, each with the gradient-sync state it had the first time
(the framework's ``sync_gradients`` flag and DDP's ``no_sync``), so that the redo sums the same
gradients. Nothing here imports a framework: the adapter says how to set its flag and how to enter
``no_sync`` (Accelerate's ``accelerator.no_sync``, the HF Trainer's model).

A recorded ``step_fn`` that reads the loop's variables from outside (a lambda over ``batch``)
would compute another micro-batch when redone; :func:`check_window` refuses such a window before
the commit, with what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Micro", "bound_names", "check_window", "replay_window"]


def bound_names(fn: Callable[..., Any]) -> dict[str, int]:
    """The identity of each value ``fn`` reads from its closure or its module's globals, by name.

    Args:
        fn: a function (a callable without code, e.g. a builtin, reads nothing).

    Returns:
        ``{name: id(value)}`` for its closure cells that hold a value and the globals it names.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    out: dict[str, int] = {}
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            out[name] = id(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    glob = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in glob and name not in out:
            out[name] = id(glob[name])
    return out


@dataclass
class Micro:
    """One micro-batch of the open window, as the loop gave it.

    Attributes:
        step_fn: runs the micro-batch again: ``step_fn(model, *inputs)``.
        inputs: what ``step_fn`` is given after the model (kept for the redo).
        sync_gradients: the framework's flag for this micro-batch (True on the window's last).
        grad_sync: False when it ran under DDP's ``no_sync``.
        bound: the identities of what ``step_fn`` read from outside when it was recorded
            (:func:`bound_names`), for :func:`check_window`.
    """

    step_fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    sync_gradients: bool
    grad_sync: bool
    bound: dict[str, int] = field(default_factory=dict)

    @classmethod
    def record(
        cls, step_fn: Callable[..., Any], inputs: tuple[Any, ...], *, sync_gradients: bool, grad_sync: bool
    ) -> Micro:
        """A micro-batch as it runs now, with what its ``step_fn`` reads from outside.

        Args:
            step_fn: runs the micro-batch (again): ``step_fn(model, *inputs)``.
            inputs: its inputs after the model.
            sync_gradients: the framework's ``sync_gradients`` flag for it.
            grad_sync: False when it runs under ``no_sync``.

        Returns:
            The record, to append to the window.
        """
        return cls(step_fn, inputs, sync_gradients, grad_sync, bound_names(step_fn))


def check_window(window: Sequence[Micro]) -> None:
    """Refuses a window whose redo would compute other micro-batches.

    Args:
        window: the recorded micro-batches, oldest first (the last one has just run).

    Raises:
        ValueError: a recorded micro-batch's ``step_fn`` reads a variable that changed since it ran.
    """
    for i, micro in enumerate(window[:-1]):
        changed = sorted(n for n, v in bound_names(micro.step_fn).items() if micro.bound.get(n, v) != v)
        if changed:
            raise ValueError(
                f"the step_fn of micro-batch {i} of this window reads {', '.join(changed)} from outside, which "
                "changed since it ran: a redo of the window would compute another micro-batch. Pass the "
                "micro-batch as an argument, stepper(step_fn, batch), with def step_fn(model, batch): ..."
            )


def replay_window(
    window: Sequence[Micro],
    model: Callable[[], Any],
    *,
    set_sync_gradients: Callable[[bool], None],
    no_sync: Callable[[Any], AbstractContextManager[Any]],
) -> list[Any]:
    """Every micro-batch of the window again, each with the ``sync_gradients`` and ``no_sync`` it had.

    Args:
        window: the recorded micro-batches.
        model: gives the model of the current world (a rebuild may have made a new one).
        set_sync_gradients: sets the framework's ``sync_gradients`` flag.
        no_sync: ``no_sync(model)`` enters the framework's ``no_sync`` for a micro-batch recorded under it.

    Returns:
        What each micro-batch's ``step_fn`` returned, in order.
    """
    out = []
    try:
        for micro in window:
            set_sync_gradients(micro.sync_gradients)
            with nullcontext() if micro.grad_sync else no_sync(model()):
                out.append(micro.step_fn(model(), *micro.inputs))
    finally:
        set_sync_gradients(True)  # the window's last micro-batch's: the optimizer steps
    return out
