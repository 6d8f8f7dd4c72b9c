"""A side process group for evaluation, and routing ``group=None`` collectives to it for a while.

Why: an evaluation loop often reduces its metrics with ``dist.all_reduce(t)`` on the default
group. If one rank's evaluation stalls, the others block in that call for the default group's
timeout (10 or 30 min) and, when it fires, the training group is dead. During a guarded
evaluation, collectives that name no group go to a separate gloo group over the same ranks
instead, whose timeout follows the evaluation's deadline; a failure kills only that group, and
the next evaluation builds a new one.

How (torch 2.13, checked by tests/integrations/test_deepspeed_eval_multirank.py):
- ``torch.distributed`` resolves ``group=None`` and ``group=dist.group.WORLD`` through
  ``_world.default_pg`` at call time (``distributed_c10d._group_or_default_group``), so setting
  it routes those calls; the previous value is put back exactly afterwards. A group object that
  code captured earlier (DeepSpeed's data-parallel group, ZeRO-3's parameter gathers) is not
  routed: such calls still use the training group.
- gloo fixes an op's timeout when the op starts (an in-flight op ignores later changes), from
  the group's default timeout. A thread sets that default to the time left before the deadline
  every :data:`TIMEOUT_REFRESH_S`, so an op started at any moment gives up at the deadline
  (plus at most one refresh period).
- ``new_group`` is collective over the whole world but goes through the store, not through any
  communicator, so it works while the previous evaluation group is dead. Every rank must call
  it at the same point: :class:`EvalGroup` builds only after a barrier that every rank passed.
- A timed-out gloo group is never destroyed here (its destructor can wait on the abandoned
  op); it is kept referenced and leaks a few sockets per failed evaluation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._torch_compat import routed_default_group
from ncclguard.deadlines import Deadline

__all__ = ["TIMEOUT_REFRESH_S", "EvalGroup", "routed_default_group", "deadline_timeout"]

TIMEOUT_REFRESH_S = 0.05
_MIN_TIMEOUT = timedelta(milliseconds=1)


@contextmanager
def deadline_timeout(group: dist.ProcessGroup, deadline: Deadline) -> Iterator[None]:
    """Keeps ``group``'s default timeout equal to the time left before ``deadline``.

    Ops started inside the block give up at the deadline; afterwards the timeout stays small, so
    a stray op on the group fails fast instead of hanging.
    """
    stop = threading.Event()

    def refresh() -> None:
        compat.set_group_timeout(group, deadline.as_timedelta(_MIN_TIMEOUT.total_seconds()))

    def loop() -> None:
        while not stop.wait(TIMEOUT_REFRESH_S):
            refresh()
            if deadline.passed():
                return

    refresh()
    thread = threading.Thread(target=loop, name="ncclguard-eval-timeout", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        refresh()


class EvalGroup:
    """The evaluation's gloo group over all ranks: built on first use, rebuilt after a failure.

    Every method that builds must be called on every rank at the same point (after a barrier
    that all ranks passed), because ``new_group`` is collective over the world.
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._dead: list[dist.ProcessGroup] = []  # failed groups, kept alive on purpose (see the module doc)
        self.builds = 0

    def get(self, timeout_s: float) -> dist.ProcessGroup:
        """Returns the current group, building one (gloo, ``timeout_s``) if there is none.

        Raises:
            RuntimeError: ``new_group`` failed (a rank left between the barrier and here).
        """
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.builds += 1
            log.info("evaluation group %s built (%d so far)", self._group.group_name, self.builds)
        return self._group

    def discard(self) -> None:
        """Drops the current group after a failed evaluation; the next :meth:`get` builds a new one."""
        if self._group is not None:
            self._dead.append(self._group)
            self._group = None
