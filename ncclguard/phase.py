"""Phases: labels for what this rank is doing (``phase("eval", batch=37)``), nested, per thread."""

from __future__ import annotations

import threading
from contextlib import ContextDecorator
from typing import Any

__all__ = ["phase", "current_phase", "main_thread_phase"]

_local = threading.local()
# The main thread's stack is also kept here so the watchdog thread can read it.
_main_stack: list[str] = []


def _stack() -> list[str]:
    if threading.current_thread() is threading.main_thread():
        return _main_stack
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _label(name: str, labels: dict[str, Any]) -> str:
    return " ".join([name, *(f"{k}={v}" for k, v in labels.items())])


class phase(ContextDecorator):
    """Labels the enclosed code: ``with phase("train", step=1201): ...`` or ``@phase("eval")``.

    Phases nest; the current one reads as ``"train step=1201 > eval batch=37"`` in flight
    records, heartbeats and incident reports.

    Args:
        name: what the rank is doing.
        **labels: details shown after the name (step, batch, ...).
    """

    def __init__(self, name: str, **labels: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("phase name must be a non-empty string, e.g. phase('eval', batch=3)")
        self.text = _label(name, labels)

    def __enter__(self) -> "phase":
        _stack().append(self.text)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _stack()
        if stack and stack[-1] == self.text:
            stack.pop()
        elif self.text in stack:  # exited out of order (a generator, say): drop ours only
            stack.remove(self.text)


def current_phase() -> str:
    """The calling thread's phase path, ``""`` outside any phase."""
    return " > ".join(_stack())


def main_thread_phase() -> str:
    """The main thread's phase path, readable from any thread (the watchdog's)."""
    return " > ".join(list(_main_stack))
