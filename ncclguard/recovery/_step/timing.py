"""The engine's learned timing: the judge bound learned from the job, and the verdict that uses it.

Each :class:`~ncclguard.recovery.engine.Recovery` has one :class:`StepTiming`. It measures the
interval from one step's start to the next (a step that needed a recovery, and the one after it,
are not counted: a rebuild is no measure of the job), learns the judge bound from them
(:mod:`ncclguard.watching.base.learner`, capped at half the step bound, the hard cap; off when that is
below the floor: the step bound then acts first), logs each change,
and carries what it learned in the job's store (:mod:`ncclguard.store.learned`): a rebuilt world
keeps its engine and its learner, and a restarted process reads it at its first step. The user's
``NCCLGUARD_STUCK_AFTER_S`` wins over the learned bound (``off`` turns the verdict off).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.recovery._verdict.levers import DEFAULT_JUDGE_S, job_store, judge_after
from ncclguard.recovery._verdict.verdict import VerdictDriver
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.learned import read_learned, write_learned
from ncclguard.watching.base.learner import FLOOR_S, Learner, parse_state
from ncclguard.world import current_world

__all__ = ["StepTiming"]

STORE_BOUND_S = 5.0
NO_CAP_S = 1800.0  # the learned bound's cap when the step bound is off (collective_timeout=None)


class StepTiming:
    """Learns the judge bound and drives the verdict (see the module doc).

    Args:
        hard_cap_s: the step bound (``collective_timeout``), None when off.
        name: how logs name the engine's adapter.
        exits: the engine's left-out policy is ``"exit"``: a rank its peers judged stuck exits 0
            once it runs again.
        heals: the engine heals restarted ranks (``heal=True``): said in an ask to a stuck rank's
            supervisor, which then restarts it.

    Raises:
        ValueError: ``NCCLGUARD_STUCK_AFTER_S`` is set to something that is not seconds or ``off``.
    """

    def __init__(self, hard_cap_s: float | None, name: str, exits: bool = True, heals: bool = False) -> None:
        self.user_s = judge_after()
        self.hard_cap_s = hard_cap_s
        cap = (hard_cap_s if hard_cap_s is not None else NO_CAP_S) / 2
        self.learner = Learner(min(DEFAULT_JUDGE_S, cap), floor_s=min(FLOOR_S, cap), cap_s=cap)
        self.name = name
        self.driver = VerdictDriver(self.judge_s, name, exits, heals)
        self._last: float | None = None  # the start of the last step counted from
        self._loaded = False

    def judge_s(self) -> float:
        """The judge bound now: the user's, else the learned one (0: the verdict is off, also when
        the step bound is so short that it acts before any judgment could: below twice the floor)."""
        if self.user_s is not None:
            return self.user_s
        return self.learner.bound("step") if self.learner.cap_s >= FLOOR_S else 0.0

    def begins(self) -> None:
        """A step's first attempt starts: counts the interval since the last one, arms the verdict."""
        now = time.monotonic()
        if not self._loaded:
            self._loaded = True
            self._load()
        if self._last is not None:
            change = self.learner.observe("step", now - self._last)
            if change is not None:
                log.warning(
                    "%s: learned step bound %.3g s -> %.3g s (%s); a rank behind that long is judged from its progress",
                    self.name,
                    change.old_s,
                    change.new_s,
                    change.why,
                )
                self._save()
        self._last = now
        self.driver.arm()

    def redo(self) -> None:
        """A redo starts after a rebuild: the verdict looks afresh; the interval is not counted."""
        self._last = None
        self.driver.arm()

    def pause(self) -> None:
        """A failed attempt goes to the rebuild: nothing is judged until the redo arms the verdict
        again (the rebuild, the heal and the restore have their own bounds, and a rank waiting
        there, or still importing after a restart, is no step's straggler)."""
        self.driver.disarm()

    def ends(self, clean: bool) -> None:
        """The step is settled; ``clean``: committed at its first attempt."""
        self.driver.disarm()
        if not clean:
            self._last = None  # the interval up to the next step holds a recovery

    def _save(self) -> None:
        job = job_store()
        if job is None or current_world().rank not in (0, None):
            return
        deadline = Deadline.within(STORE_BOUND_S)
        try:
            store = store_for_this_thread(job, deadline)
            write_learned(store, self.learner.state.model_dump_json(), deadline)
        except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
            log.info("%s: the learned step bound is not in the store (%s)", self.name, exc)

    def _load(self) -> None:
        job = job_store()
        if job is None:
            return
        deadline = Deadline.within(STORE_BOUND_S)
        try:
            raw = read_learned(store_for_this_thread(job, deadline), deadline)
        except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
            log.info("%s: no learned step bound read from the store (%s)", self.name, exc)
            return
        state = parse_state(raw, "the job's store (ncclguard/learned)")
        if state is not None:
            before = self.learner.bound("step")
            self.learner.adopt(state)
            log.warning(
                "%s: learned step bound from the store: %.3g s (was %.3g s)", self.name, self.learner.bound(), before
            )
