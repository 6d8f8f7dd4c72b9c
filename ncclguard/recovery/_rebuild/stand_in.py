"""A restarted rank's stand-in world, until it joins the survivors' world.

A process restarted after its rank died (``NCCLGUARD_RESTART_COUNT`` above 0, set by its supervisor,
``python -m ncclguard.supervise``) must not join the job's first world again: the survivors are in
a later one. But frameworks make a process group as they start (HF's ``TrainingArguments`` through
Accelerate, Lightning's strategy, ``Accelerator()``), and build on it: DDP's constructor broadcasts,
``main_process_first`` holds a barrier. So in such a process ``init_process_group`` makes a
stand-in: a world of one on torch's ``fake`` backend (:func:`ncclguard._torch_compat.init_stand_in_group`),
whose collectives return at once, talk to nobody and are self-consistent (an object broadcast
from rank 0 returns the caller's own: Lightning broadcasts its log directory at setup). Until the
join, ``dist.get_rank()`` and ``dist.get_world_size()`` say 0 and 1; frameworks that read their rank
from the launcher's environment (Lightning) see the real ones, and Accelerate's state is made to
follow the joined world at the join (``follow_world``).

The adapter's join point drops the stand-in and joins the survivors' next rebuild
(:func:`~ncclguard.recovery.rejoin.rejoin_world`), then receives a live peer's state: the
constructor of ``RecoveringStep`` (and Accelerate's ``recovering_step``); ``trainer.train()`` under
``guard_trainer(recover=True, heal=True)``; Lightning's fit loop under
``NcclGuardCallback(recover=True, heal=True)``. What was built on the stand-in (DDP) is built again.

Where it is in place before the script's first line, whatever the script's order:

- under ``ncclguard run`` and ``python -m ncclguard.supervise`` (the start-up hook,
  ``autostart/ncclguard_autostart.py``, loaded by ``ncclguard-autostart.pth`` in every process whose
  ``NCCLGUARD_RESTART_COUNT`` is set, wraps torch's ``init_process_group`` as c10d loads and calls
  :func:`stand_in_for`): a script that makes its group first (``TrainingArguments``, ``Accelerator()``,
  ``dist.init_process_group`` at the top of ``main()``) and imports ncclguard later stands in too;
- in the warm spare when it takes over (:mod:`ncclguard.supervise.spare`);
- when ncclguard is imported in a restarted process (this module patches at import).

Elsewhere ``init_process_group`` is torch's own.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.recovery._rebuild.restarts import restart_count

__all__ = ["active", "awaiting_join", "install", "leave", "stand_in_for", "torch_init_process_group"]


class _StandIn:
    """The process's stand-in: whether it is the default group now, torch's function, and how many
    calls are passing through to it (a join, a rebuild, the stand-in's own fake group): the wrappers
    around torch's function (this module's and the start-up hook's) make no stand-in for those."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.original: Callable[..., Any] | None = None
        self.passing = 0


_STAND_IN = _StandIn()


@contextlib.contextmanager
def _passing() -> Iterator[None]:
    with _STAND_IN.lock:
        _STAND_IN.passing += 1
    try:
        yield
    finally:
        with _STAND_IN.lock:
            _STAND_IN.passing -= 1


def torch_init_process_group(*args: Any, **kwargs: Any) -> Any:
    """torch's own ``init_process_group``, whatever the patch: what a rebuild and a rejoin make is
    the real world."""
    original = _STAND_IN.original or dist.init_process_group
    with _passing():
        return original(*args, **kwargs)


def stand_in_for(init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Makes the stand-in world in place of ``init(*args, **kwargs)`` when this process must not
    make the job's world: it is a restarted one (``NCCLGUARD_RESTART_COUNT`` above 0), it has no
    process group, and the call is none of ncclguard's own (a join, a rebuild).

    Args:
        init: the ``init_process_group`` the caller would have called (torch's, or a wrapper of it).
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.

    Returns:
        True when the stand-in was made (the call is answered: ``init_process_group`` returns None);
        False when the caller goes on with ``init``.

    Raises:
        TypeError: the arguments do not fit torch's ``init_process_group`` (its own error, as
            without the stand-in).
        ValueError: ``NCCLGUARD_RESTART_COUNT`` is set but is no count.
    """
    if _STAND_IN.passing or restart_count() == 0 or dist.is_initialized():
        return False
    inspect.signature(_STAND_IN.original or init).bind(*args, **kwargs)
    with _passing():
        compat.init_stand_in_group(init=init)
    _STAND_IN.active = True
    log.warning(
        "restarted launch rank %s (restart %d): init_process_group made a stand-in world of one instead of "
        "joining the job's first world (the survivors are in a later one); the rank joins them at its "
        "recovery's join point",
        os.environ.get("RANK", "?"),
        restart_count(),
    )
    return True


def active() -> bool:
    """True while the default process group is the stand-in (the rank has not joined yet)."""
    return _STAND_IN.active and dist.is_available() and dist.is_initialized()


def awaiting_join(heal: bool) -> bool:
    """True in a process restarted after its rank died that the recovery engine joins to the
    survivors' world at its adapter's join point: ``heal`` is on, the restart number is above 0, and
    this process has no world of its own yet (no process group, or the stand-in).

    Args:
        heal: the engine's ``heal`` option (without it a restarted process joins nothing).

    Raises:
        ValueError: ``NCCLGUARD_RESTART_COUNT`` is set but is no count.
    """
    return heal and restart_count() > 0 and (not dist.is_initialized() or active())


def leave() -> None:
    """Drops the stand-in group (before the join); nothing when there is none."""
    if active():
        compat.destroy_world_quietly()  # a rebuild is no end: the store's host tells nobody
    _STAND_IN.active = False


def _stand_in(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if stand_in_for(original, args, kwargs):
            return None
        return original(*args, **kwargs)

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    return init_process_group


def install() -> bool:
    """Makes ``init_process_group`` a stand-in in a restarted process (see the module doc); idempotent.

    Returns:
        True when the patch is in place.
    """
    try:
        if restart_count() == 0:
            return False
    except ValueError as exc:  # a bad NCCLGUARD_RESTART_COUNT: said here, raised where it is used
        log.warning("%s; init_process_group is left as it is", exc)
        return False
    from torch.distributed import distributed_c10d

    with _STAND_IN.lock:
        if _STAND_IN.original is None:
            _STAND_IN.original = distributed_c10d.init_process_group
            patched = _stand_in(_STAND_IN.original)
            dist.init_process_group = patched
            distributed_c10d.init_process_group = patched  # code that imported the name from here
    return True


install()  # at import: a restarted process must not make the job's first world again
