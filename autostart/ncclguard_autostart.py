"""ncclguard switched on without a line of the training script changed: the part that runs at start-up.

``ncclguard-autostart.pth`` (installed at the top of site-packages) imports this module, in every
Python process, only when ``NCCLGUARD_AUTO`` or ``NCCLGUARD_RESTART_COUNT`` is set; unset, the
``.pth`` line costs two look-ups in ``os.environ`` and nothing is imported. :func:`boot` then

- turns torch's flight recorder on (``TORCH_FR_BUFFER_SIZE=2000`` unless the job set it), and
- waits for ``torch.distributed.distributed_c10d`` to load (an import hook: nothing of torch or
  ncclguard is imported here) and wraps its ``init_process_group`` as soon as the module has run,
  before ``torch.distributed``, ``torch.distributed.device_mesh`` or any other module binds the name;
  every way a process group is made ends there: ``init_process_group``, ``init_device_mesh``, the
  HF Trainer and Accelerate, Lightning, DeepSpeed's ``init_distributed``.

Right before the default group is made, the wrapper applies the network plan
(:func:`ncclguard.cli.autostart.before_init`: the interface that routes to ``MASTER_ADDR``, where the
default would bind a loopback or unroutable address). Right after, it calls :func:`ncclguard.cli.autostart.started`,
which starts the watchdog (settings from ``NCCLGUARD_WATCHDOG_*``) and prints, on rank 0, the line
to run ``python -m ncclguard status``. ``python -m ncclguard run`` sets the variable for its ranks;
``NCCLGUARD_AUTO=1 torchrun ...`` or ``srun`` with the variable exported does the same.

**A restarted process** (``NCCLGUARD_RESTART_COUNT`` above 0: its supervisor, ``python -m
ncclguard.supervise`` or ``ncclguard run --ncclguard-restarts N``, started it again after its rank
died) must never make the job's first world: the survivors are in a later one, and torch's
``init_process_group`` would wait there (30 minutes on gloo) for ranks that never come. Before the
script's first line, whatever the order of its imports, the wrapper answers the first
``init_process_group`` with the stand-in world of one
(:func:`ncclguard.recovery._rebuild.stand_in.stand_in_for`), and the rank joins the survivors at its
recovery's join point. This is done with or without ``NCCLGUARD_AUTO``; without it nothing else
is. A restarted process that cannot load ncclguard raises at that call, saying why, instead of
waiting for the old world.

This module is top-level (not ``ncclguard.*``) because importing anything under ``ncclguard``
imports the package's face, and with it torch: at interpreter start-up that would cost seconds in
every process and import torch before the script's own environment settings.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["ENV_VAR", "RESTART_VAR", "boot", "enabled", "patch", "restarted"]

ENV_VAR = "NCCLGUARD_AUTO"
# The restart number its supervisor gives a rank's process (ncclguard.recovery._rebuild.restarts).
RESTART_VAR = "NCCLGUARD_RESTART_COUNT"
_C10D = "torch.distributed.distributed_c10d"
# Modules that bind c10d's init_process_group by name when they load after it: their copy is
# replaced too when the hook is installed late (c10d already loaded).
_BINDERS = ("torch.distributed", "torch.distributed.device_mesh")
_OFF = ("", "0", "false", "no", "off")


def enabled(environ: Any = None) -> bool:
    """True when ``NCCLGUARD_AUTO`` asks for ncclguard (set, and not 0, false, no or off)."""
    env = os.environ if environ is None else environ
    return str(env.get(ENV_VAR, "")).strip().lower() not in _OFF


def restarted(environ: Any = None) -> bool:
    """True in a process its supervisor restarted after its rank died (``NCCLGUARD_RESTART_COUNT``
    a count above 0); a value that is no count is said where ncclguard reads it."""
    env = os.environ if environ is None else environ
    raw = str(env.get(RESTART_VAR, "")).strip()
    return raw.isdigit() and int(raw) > 0


class _Booted:
    """What :func:`boot` did in this process (it runs once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.restart_only = False  # booted for a restarted process alone: the stand-in, nothing else


_BOOTED = _Booted()


class _ChainedLoader(importlib.abc.Loader):
    """Runs the real loader, then ``after(module)``; the module keeps the real loader as its own."""

    def __init__(self, real: Any, after: Callable[[ModuleType], object]) -> None:
        self.real, self.after = real, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Tracebacks (linecache) and inspect read source through the module's loader: the real one.
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.real
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.real
        self.real.exec_module(module)
        self.after(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands c10d's spec back with a loader that patches it once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _C10D:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ChainedLoader(spec.loader, patch)
                return spec
        return None


def _before_init(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Applies the network plan (the interface that routes to MASTER_ADDR) before the group is made;
    an interface the user named that cannot work stops the rank here, with the routes that exist."""
    backend = kwargs.get("backend", args[0] if args else None)
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    try:
        from ncclguard.cli import autostart
    except Exception:  # the job must go on without ncclguard rather than die of it
        logging.getLogger("ncclguard").exception("ncclguard: could not load; the job goes on without it")
        return
    autostart.before_init(backend, init_method)


def _stand_in(init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """In a restarted process: makes the stand-in world instead of the job's first world (see the
    module doc). True when it did; raises when ncclguard cannot load, rather than wait for the old world."""
    try:
        from ncclguard.cli import autostart
    except Exception as exc:
        raise RuntimeError(
            f"ncclguard: this process is restart {os.environ.get(RESTART_VAR)} of launch rank "
            f"{os.environ.get('RANK', '?')}, and ncclguard could not be loaded to stand in for the job's first "
            f"world ({type(exc).__name__}: {exc}); torch's init_process_group would wait there for ranks that "
            "are in a later world, so this process stops here"
        ) from exc
    return autostart.stand_in_for(init, args, kwargs)


def _after_init(backend_made: bool) -> None:
    if not backend_made:
        return
    try:
        from ncclguard.cli import autostart

        autostart.started()
    except Exception:  # the job must go on without ncclguard rather than die of it
        logging.getLogger("ncclguard").exception("ncclguard: could not start the watchdog; the job goes on without it")


def patch(c10d: ModuleType) -> bool:
    """Wraps ``c10d.init_process_group`` (and the copies bound from it) so that a restarted process
    stands in and, under ``NCCLGUARD_AUTO``, the watchdog starts right after the default group is
    made; idempotent.

    Args:
        c10d: ``torch.distributed.distributed_c10d``.

    Returns:
        True when the wrapper is in place.
    """
    original = getattr(c10d, "init_process_group", None)
    if original is None:
        return False
    if getattr(original, "__ncclguard_auto__", False):
        return True

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if restarted() and _stand_in(original, args, kwargs):
            return None  # torch's own answer: init_process_group returns None
        if _BOOTED.restart_only:  # NCCLGUARD_AUTO is not set: nothing else is switched on
            return original(*args, **kwargs)
        _before_init(args, kwargs)
        out = original(*args, **kwargs)
        _after_init(bool(getattr(c10d, "is_initialized", lambda: False)()))
        return out

    init_process_group.__ncclguard_auto__ = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group  # type: ignore[attr-defined]
    for name in _BINDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "init_process_group", None) is original:
            module.init_process_group = init_process_group  # type: ignore[attr-defined]
    return True


def boot() -> bool:
    """Switches ncclguard on in this process when ``NCCLGUARD_AUTO`` asks for it, or only the
    stand-in when this process is a restarted one (see the module doc).

    Returns:
        True when it is on (now or before).
    """
    if not enabled() and not restarted():
        return False
    with _BOOTED.lock:
        if _BOOTED.done:
            return True
        _BOOTED.done = True
        _BOOTED.restart_only = not enabled()
        if enabled():
            # torch reads it when a process group is made; 2000 entries is torch's own default in 2.13.
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        c10d = sys.modules.get(_C10D)
        if c10d is not None:
            patch(c10d)
        else:
            sys.meta_path.insert(0, _Finder())
    return True
