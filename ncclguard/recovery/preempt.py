"""Preemption: SIGTERM to a rank under a recovery engine ends training at a step every rank agrees on,
with the newest state written in the framework's own checkpoint format.

A job told to stop (Slurm's preemption and ``scancel``, a spot notice: SIGTERM, then SIGKILL after
the grace) loses what it had in memory, and a rank that stops alone leaves the others hanging in
their next collective. So, while a :class:`~ncclguard.recovery.engine.Recovery` runs:

1. a SIGTERM handler (installed by the engine, in the main thread, chained to the handler that was
   there) only notes the request (:func:`stop_requested`);
2. the rank says so in its next commit's statement (``Statement.stop``); the settled outcome carries
   ``stop`` when any rank asked, so every rank learns it at the same step, in the round it holds
   anyway (:func:`~ncclguard.recovery.commit.should_commit`; ``CommitResult.stop``);
3. the step is applied as usual; when the loop comes back for its next step, every rank calls its
   adapter's :meth:`~ncclguard.recovery.adapter.Adapter.save_checkpoint` into the directory the user
   named (``preempt_dir=``, else :data:`PREEMPT_DIR_VAR`), rank 0 writes :data:`MARKER` there, and
   the process exits with :data:`PREEMPTED_STATUS` (:func:`stop_now`). Without a directory nothing
   is written: the log says so and the rank exits with the same status.

A supervisor (:mod:`ncclguard.supervise`) never restarts a rank that ended with that status or by
SIGTERM. docs/recovery.md ("Preemption") gives each framework's format and its resume call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.exits import exit_now
from ncclguard.recovery._rebuild.restarts import stop_grace_s

if TYPE_CHECKING:
    from ncclguard.recovery.adapter import Adapter

__all__ = [
    "MARKER",
    "PREEMPTED_STATUS",
    "PREEMPT_DIR_VAR",
    "PreemptMarker",
    "check_preempt_dir",
    "give_sigterm_back",
    "grace_note",
    "install_handler",
    "request_stop",
    "save_dcp",
    "stop_now",
    "stop_requested",
    "take_sigterm",
]

PREEMPT_DIR_VAR = "NCCLGUARD_PREEMPT_DIR"
# 128 + SIGTERM: what a shell reports for a process SIGTERM ended, so the job's status reads
# "preempted" whichever way a rank ended; the supervisor restarts neither.
PREEMPTED_STATUS = 128 + int(signal.SIGTERM)
MARKER = "PREEMPTED.json"  # rank 0's note of what was written, beside the checkpoint


class PreemptMarker(BaseModel):
    """What rank 0 writes to :data:`MARKER` after the checkpoint (JSON).

    Attributes:
        adapter: the adapter that wrote it (``"RecoveringStep"``, ``"guard_trainer"``, ...).
        path: the checkpoint (a directory) to give the framework's resume call.
        step: the number of the last step applied before the stop (the adapter's numbering).
        world_size: the ranks that wrote it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter: str = Field(max_length=100)
    path: str = Field(max_length=4096)
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)


class _Requests:
    """This process's stop request and the handler it installed (a process is one rank)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None  # time.monotonic() of the first request
        self.installed = False
        self.previous: Any = None


_REQUESTS = _Requests()


def stop_requested() -> bool:
    """Whether this process was asked to stop (SIGTERM, or :func:`request_stop`)."""
    return _REQUESTS.signum is not None


def request_stop(signum: int = int(signal.SIGTERM)) -> None:
    """Notes a stop request, as the SIGTERM handler does (the next commit carries it).

    Args:
        signum: the signal that asked (for the log).
    """
    _REQUESTS.signum = int(signum)
    if _REQUESTS.at is None:
        _REQUESTS.at = time.monotonic()


def _handler(signum: int, frame: Any) -> None:
    # Only a note: logging from a signal handler can deadlock on the logging lock it interrupted.
    request_stop(signum)
    previous = _REQUESTS.previous
    if callable(previous):
        previous(signum, frame)


def install_handler() -> bool:
    """Installs the SIGTERM handler that notes the request, chained to the one that was there.

    Returns:
        True when it is installed (now or before); False outside the main thread, where Python
        lets no handler be set (the request can then still be made by :func:`request_stop`).
    """
    if _REQUESTS.installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        log.info("preemption: the engine was built outside the main thread; SIGTERM is left to its handler")
        return False
    _REQUESTS.previous = signal.signal(signal.SIGTERM, _handler)
    _REQUESTS.installed = True
    return True


def take_sigterm() -> Any:
    """Puts the noting handler back on SIGTERM over one a framework set after the engine's (Lightning's
    signal connector sets its own when ``fit`` starts), without chaining to that one.

    Returns:
        The handler replaced, for the caller to give back; None when none was replaced (the engine's
        handler is not installed, or this is not the main thread, where Python lets none be set).
    """
    if not _REQUESTS.installed or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _handler)


def give_sigterm_back(handler: Any) -> None:
    """Gives SIGTERM back to ``handler`` (what :func:`take_sigterm` returned) if the noting handler
    still holds it; a handler set since then is left alone.

    Args:
        handler: the handler to put back (None: nothing to do).
    """
    if handler is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _handler:
        signal.signal(signal.SIGTERM, handler)


def check_preempt_dir(value: str | os.PathLike[str] | None) -> Path | None:
    """The directory a preempted job writes to: ``value``, else :data:`PREEMPT_DIR_VAR`, else None.

    Args:
        value: the option, as the user gave it.

    Returns:
        The directory, absolute (it is made when the stop comes), or None.

    Raises:
        TypeError: ``value`` is not a path.
        ValueError: it (or the variable) names an existing file, or is empty.
    """
    if value is not None and not isinstance(value, str | os.PathLike):
        raise TypeError(f"preempt_dir must be a path (str or os.PathLike), got {type(value).__name__}")
    where = "preempt_dir"
    if value is None:
        value, where = os.environ.get(PREEMPT_DIR_VAR), PREEMPT_DIR_VAR
        if value is None:
            return None
    if not os.fspath(value):
        raise ValueError(f"{where} is empty; name the directory a preempted job writes its checkpoint to")
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where}={os.fspath(value)!r} is a file; name a directory (made if missing)")
    return path


def save_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, step: int) -> Path:
    """Writes a model's and its optimizer's state with ``torch.distributed.checkpoint`` (DCP).

    ``get_state_dict`` gives the keys of the unwrapped module for DDP and FSDP2 alike (FSDP2's as
    sharded tensors), so ``dcp.load`` plus ``set_state_dict`` restore them on a new launch.

    Args:
        model: the wrapped model (DDP or FSDP2) or the module.
        optimizer: its optimizer.
        path: the checkpoint's directory.
        step: the last step applied (saved as ``{"ncclguard": {"step": tensor}}``).

    Returns:
        ``path``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd, "ncclguard": {"step": torch.tensor(step)}}, checkpoint_id=path)
    return path


def grace_note(took_s: float, since_stop_s: float | None, grace_s: float | None) -> str:
    """How the save stood against the supervisor's stop grace, in words for the log.

    Args:
        took_s: the seconds the save took.
        since_stop_s: the seconds from the stop request to the end of the save (None: not known).
        grace_s: the supervisor's grace (None: no supervisor's).

    Returns:
        ``"1.2 s after the stop, of the supervisor's 8 s grace"``, with advice where the save used
        more than half of it (the next, larger state may not fit: SIGKILL, no checkpoint).
    """
    if grace_s is None:
        return "no supervisor's grace: the launcher's SIGKILL bounds the save"
    used = since_stop_s if since_stop_s is not None else took_s
    text = f"{used:.2f} s after the stop, of the supervisor's {grace_s:g} s grace"
    if used > grace_s / 2:
        text += (
            f"; over half of it: a larger state may not be written before SIGKILL. Raise the grace "
            f"(ncclguard run --ncclguard-stop-grace S, or python -m ncclguard.supervise --stop-grace S) to at least "
            f"{max(2 * used, grace_s + 1):.0f} s, within the launcher's own (Slurm's KillWait, 30 s by default)"
        )
    return text


def _write_marker(directory: Path, marker: PreemptMarker) -> None:
    """Writes :data:`MARKER` whole or not at all (a rename)."""
    tmp = directory / f".{MARKER}.{os.getpid()}"
    tmp.write_text(marker.model_dump_json(indent=1) + "\n")
    os.replace(tmp, directory / MARKER)


def stop_now(adapter: Adapter, directory: Path | None, step: int, end: Callable[[int], Any] = exit_now) -> NoReturn:
    """Writes the checkpoint (every rank, the stop being agreed), then exits :data:`PREEMPTED_STATUS`.

    Args:
        adapter: the framework's adapter (its :meth:`save_checkpoint` writes the files).
        directory: where (None: nothing is written, and the log says so).
        step: the last step applied.
        end: how the process ends (``os._exit`` after a flush; a test passes its own).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if directory is None:
        log.warning(
            "%s: stopping after step %d on SIGTERM (agreed by every rank); no checkpoint written: name a directory "
            "with preempt_dir= or %s",
            adapter.name,
            step,
            PREEMPT_DIR_VAR,
        )
    else:
        log.warning(
            "%s: stopping after step %d on SIGTERM; writing the checkpoint in %s", adapter.name, step, directory
        )
        try:
            directory.mkdir(parents=True, exist_ok=True)
            start = time.monotonic()
            path = adapter.save_checkpoint(directory, step)
            if rank == 0:
                _write_marker(
                    directory, PreemptMarker(adapter=adapter.name, path=str(path), step=step, world_size=size)
                )
            took = time.monotonic() - start
            since = time.monotonic() - _REQUESTS.at if _REQUESTS.at is not None else None
            log.warning(
                "%s: checkpoint of step %d written to %s in %.2f s (%s)",
                adapter.name,
                step,
                path,
                took,
                grace_note(took, since, stop_grace_s()),
            )
        except NotImplementedError as exc:
            log.error("%s: no checkpoint written on preemption: %s", adapter.name, exc)
        except Exception:  # noqa: BLE001 - the job is stopping either way; say why nothing is on disk
            log.exception("%s: writing the checkpoint of step %d failed", adapter.name, step)
    end(PREEMPTED_STATUS)
    raise SystemExit(PREEMPTED_STATUS)  # only when a test's ``end`` returns
