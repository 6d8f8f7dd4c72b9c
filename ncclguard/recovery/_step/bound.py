"""The step bound: how long a collective inside a recovering step may wait for its peers.

A framework leaves its own timeout on the process groups: HF's ``TrainingArguments.ddp_timeout``
is 1,800 s, gloo's default 30 min, NCCL's 10 min. A rank stuck for good inside a step then keeps
its peers waiting that long before anything can recover (measured: 300 s with HF's defaults and
nothing broke the wait). The recovery engine bounds the collectives of each step itself:

- gloo fixes an op's timeout when the op starts (a later change does not reach an op in flight;
  ``tests/integrations/test_hf_timeouts.py``), so while a step runs every group of this rank's world whose own
  timeout is longer gets the bound as its timeout, and gets its own back when the step is settled:
  evaluations, saves and logging between steps keep the framework's timeout;
- NCCL ends a timed-out op by tearing the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, 3 by
  default), so its groups keep their timeout and a timer thread aborts them at the bound instead
  (``ProcessGroup.abort``, as torch's ``_abort_process_group``): the op in flight then fails and the
  step's commit fails with it. Written against torch 2.13's source; no GPU was at hand to run it.

A group's timeout is read and written through :mod:`ncclguard._torch_compat`, a few microseconds
per group and step.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import TorchCompatError

__all__ = ["StepBound"]


def _device_of(pg: dist.ProcessGroup) -> torch.device | None:
    for device in getattr(pg, "_device_types", []):
        return torch.device(device)
    return None


class StepBound:
    """Arms and disarms the bound on one rank's groups (see the module doc).

    Args:
        seconds: the bound; None leaves every group's timeout as it is and arms nothing.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._saved: dict[dist.ProcessGroup, timedelta] = {}
        self._abort_at: float | None = None
        self._cond = threading.Condition()
        self._timer: threading.Thread | None = None
        self.aborted = 0  # times the timer aborted the groups (NCCL)

    @property
    def armed(self) -> bool:
        """True between :meth:`arm` and :meth:`disarm`."""
        return bool(self._saved) or self._abort_at is not None

    def arm(self) -> None:
        """Gives this rank's groups the bound (gloo), or starts the abort timer (other backends)."""
        if self.seconds is None or not (dist.is_available() and dist.is_initialized()):
            return
        self.disarm()
        bound = timedelta(seconds=self.seconds)
        timer = False
        for pg in list(compat.group_names()):
            if compat.rank_not_in_group(pg):
                continue
            if str(dist.get_backend(pg)) != "gloo":
                timer = True
                continue
            device = _device_of(pg)
            try:
                own = compat.backend_timeout(pg, device)
                if own > bound:  # a group whose own timeout is shorter keeps it
                    compat.set_group_timeout(pg, bound)
                    self._saved[pg] = own
            except (TorchCompatError, RuntimeError, ValueError) as exc:
                log.debug("step bound: group %s keeps its timeout (%s)", pg, exc)
        if timer:
            self._start_timer(time.monotonic() + self.seconds)

    def disarm(self) -> None:
        """Gives every group its own timeout back and stops the abort timer."""
        saved, self._saved = self._saved, {}
        for pg, own in saved.items():
            try:
                if pg in compat.group_names():  # an abandoned world's groups are the reaper's
                    compat.set_group_timeout(pg, own)
            except (TorchCompatError, RuntimeError, ValueError) as exc:
                log.debug("step bound: could not give group %s its timeout back (%s)", pg, exc)
        with self._cond:
            self._abort_at = None
            self._cond.notify_all()

    def _start_timer(self, at: float) -> None:
        with self._cond:
            self._abort_at = at
            if self._timer is None or not self._timer.is_alive():
                self._timer = threading.Thread(target=self._wait, name="ncclguard-step-bound", daemon=True)
                self._timer.start()
            self._cond.notify_all()

    def _wait(self) -> None:
        with self._cond:
            while True:
                if self._abort_at is None:
                    if not self._cond.wait(timeout=60.0) and self._abort_at is None:
                        self._timer = None
                        return
                    continue
                left = self._abort_at - time.monotonic()
                if left > 0:
                    self._cond.wait(timeout=left)
                    continue
                self._abort_at = None
                break
        aborted, failed = compat.abort_all_groups()
        self.aborted += 1
        log.error(
            "step bound: a collective of this step ran past %.3g s; aborted groups %s%s",
            self.seconds,
            aborted,
            f" (failed: {failed})" if failed else "",
        )
        with self._cond:
            self._timer = None
