"""Phases: labels for what this rank is doing (``phase("eval", batch=37)``), nested, per thread."""

from __future__ import annotations

import os
import threading
from contextlib import ContextDecorator
from typing import Any

__all__ = ["phase", "current_phase", "main_thread_phase"]


class _Track:
    """One thread's open phases and their path, kept joined so that reading it costs nothing."""

    __slots__ = ("stack", "path", "ident")

    def __init__(self, ident: int | None = None) -> None:
        self.stack: list[str] = []
        self.path = ""
        self.ident = ident  # the owning thread's ident (kept for the main thread's track only)

    def push(self, text: str) -> None:
        self.stack.append(text)
        self.path = " > ".join(self.stack)

    def pop(self, text: str) -> None:
        if self.stack and self.stack[-1] == text:
            self.stack.pop()
        elif text in self.stack:  # exited out of order (a generator, say): drop ours only
            self.stack.remove(text)
        self.path = " > ".join(self.stack)


_local = threading.local()
# The main thread's phases live here, where the watchdog thread (and the recorder) read them.
MAIN = _Track(threading.main_thread().ident)


def _after_fork() -> None:
    MAIN.ident = threading.main_thread().ident  # the forking thread is the child's main thread


os.register_at_fork(after_in_child=_after_fork)


def _track() -> _Track:
    if threading.get_ident() == MAIN.ident:  # read on every recorded collective: kept cheap
        return MAIN
    track = getattr(_local, "track", None)
    if track is None:
        track = _local.track = _Track()
    return track


def _label(name: str, labels: dict[str, Any]) -> str:
    return " ".join([name, *(f"{k}={v}" for k, v in labels.items())])


class phase(ContextDecorator):
    """Labels the enclosed code: ``with phase("train", step=1201): ...`` or ``@phase("eval")``.

    Phases nest; the current one reads as ``"train step=1201 > eval batch=37"`` in flight
    records, heartbeats and incident reports.

    Args:
        name: what the rank is doing.
        **labels: details shown after the name (step, batch, ...).

    Raises:
        ValueError: ``name`` is not a non-empty string.
    """

    def __init__(self, name: str, **labels: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("phase name must be a non-empty string, e.g. phase('eval', batch=3)")
        self.text = _label(name, labels)

    def __enter__(self) -> phase:
        _track().push(self.text)
        return self

    def __exit__(self, *exc: object) -> None:
        _track().pop(self.text)


def current_phase() -> str:
    """The calling thread's phase path, ``""`` outside any phase."""
    return _track().path


def main_thread_phase() -> str:
    """The main thread's phase path, readable from any thread (the watchdog's)."""
    return MAIN.path
