"""What watches a recovering step while it runs, on every rank: the step bound, the learned judge
bound that drives the verdict, the left-behind fence, and the check that the ranks' loops are at
one step. The recovery engine (:mod:`ncclguard.recovery.engine`) arms each of them per step.

**The step bound** (:class:`StepBound`): how long a collective inside a recovering step may wait
for its peers. A framework leaves its own timeout on the process groups: HF's
``TrainingArguments.ddp_timeout`` is 1,800 s, gloo's default 30 min, NCCL's 10 min. A rank stuck
for good inside a step then keeps its peers waiting that long before anything can recover
(measured: 300 s with HF's defaults and nothing broke the wait). The recovery engine bounds the
collectives of each step itself:

- gloo fixes an op's timeout when the op starts (a later change does not reach an op in flight;
  ``tests/integrations/test_hf_timeouts.py``), so while a step runs every group of this rank's world whose own
  timeout is longer gets the bound as its timeout, and gets its own back when the step is settled:
  evaluations, saves and logging between steps keep the framework's timeout;
- NCCL ends a timed-out op by tearing the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, 3 by
  default), so its groups keep their timeout and a timer thread aborts them at the bound instead
  (``ProcessGroup.abort``, as torch's ``_abort_process_group``): the op in flight then fails and the
  step's commit fails with it. Which of the two is the backend's rule (:mod:`ncclguard.backend_rules`);
  the NCCL stand-in runs the timer on CPU.

A group's timeout is read and written through :mod:`ncclguard._torch_compat`, a few microseconds
per group and step.

**The learned timing** (:class:`StepTiming`): the judge bound learned from the job, and the verdict
that uses it. Each :class:`~ncclguard.recovery.engine.Recovery` has one. It measures the interval
from one step's start to the next (a step that needed a recovery, and the one after it, are not
counted: a rebuild is no measure of the job), learns the judge bound from them
(:mod:`ncclguard.watching.base.learner`, capped at half the step bound, the hard cap; off when that is
below the floor: the step bound then acts first), logs each change,
and carries what it learned in the job's store (:mod:`ncclguard.store.learned`): a rebuilt world
keeps its engine and its learner, and a restarted process reads it at its first step. The user's
``NCCLGUARD_STUCK_AFTER_S`` wins over the learned bound (``off`` turns the verdict off).

**The left-behind fence** (:func:`arm_left_behind_fence`), whatever the watchdog's ladder. A rank
stuck for good inside a step (a Python loop that never returns, a data stall) never reaches the
rebuild that would tell it the others went on without it, and torchrun waits for it for ever. The
watchdog's left-behind check (:mod:`ncclguard.watching.desk.left_behind`) ends such a rank, but only
on a ladder that fences. So each step of an engine arms it:

- with a watchdog running, :func:`ncclguard.watching.desk.left_behind.arm` turns its check on (it reads the world record only while a peer is silent: no store traffic in a
  healthy job);
- without one, a small thread (``ncclguard-left-behind``) reads the job's world record every
  :data:`POLL_S` seconds on a store connection of its own, and applies the same rule.

Either way the rank exits 0 once the record has shown a newer world for the grace, unless its own
``rebuild_world`` came late and told it (the engine's left-out policy then applies).

**The loop check** (:func:`diverged`, :func:`not_rewound`): whether the ranks' loops are at one
step; a loop that does not follow a rewind is told so. After a restore that sent every rank back
to a snapshot's step (``StepResult.rewound_to``), a loop written ``for step in range(...)`` goes on
from where it was while the restarted rank starts at the snapshot's step. Their collectives still
match, so nothing but the step numbers shows it, and a rebuild cannot mend it: each new world would
fail the same way. So the first commit that shows it ends the loop on every rank with the line to
write instead (:class:`~ncclguard.errors.LoopDiverged`).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.backend_rules import StepBoundBy, rules_of, stand_in_on
from ncclguard.deadlines import Deadline
from ncclguard.errors import LoopDiverged, StoreUnreachable, TorchCompatError
from ncclguard.exits import EXITING, exit_now, poller
from ncclguard.recovery._commit.statements import STEP_DIFFERS
from ncclguard.recovery._verdict.levers import DEFAULT_JUDGE_S, abort_world, job_store, judge_after
from ncclguard.recovery._verdict.verdict import VerdictDriver
from ncclguard.recovery.commit import CommitResult
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.learned import read_learned, write_learned
from ncclguard.store.world_record import WorldRecord, read_world_record
from ncclguard.watching.base.learner import FLOOR_S, Learner, parse_state
from ncclguard.watching.desk.left_behind import LeftBehind, arm
from ncclguard.watching.watchdog import current_watchdog
from ncclguard.world import current_world

__all__ = ["FIX", "POLL_S", "StepBound", "StepTiming", "arm_left_behind_fence", "diverged", "not_rewound"]

STORE_BOUND_S = 5.0  # one store call of the timing's or the fence's
NO_CAP_S = 1800.0  # the learned bound's cap when the step bound is off (collective_timeout=None)
POLL_S = 5.0  # one store read per rank this often, only while no watchdog runs
GRACE_S = 2 * POLL_S  # a newer world seen this long: covers a member whose rebuild is under way


# The step bound.


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
        self.lowered = 0  # steps whose groups got the bound as their timeout (gloo)
        # The rules that started the timer (an NCCL group's, or the stand-in's).
        self._timer_rules = rules_of("nccl")

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
        stand_in = stand_in_on()
        for pg in list(compat.group_names()):
            if compat.rank_not_in_group(pg):
                continue
            rules = rules_of(str(dist.get_backend(pg)), stand_in)
            if rules.step_bound is StepBoundBy.ABORT_TIMER:
                timer, self._timer_rules = True, rules
                continue
            device = _device_of(pg)
            try:
                own = compat.backend_timeout(pg, device)
                if own > bound:  # a group whose own timeout is shorter keeps it
                    compat.set_group_timeout(pg, bound)
                    self._saved[pg] = own
            except (TorchCompatError, RuntimeError, ValueError) as exc:
                log.debug("step bound: group %s keeps its timeout (%s)", pg, exc)
        if self._saved:
            self.lowered += 1
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
        aborted, failed, _ = abort_world(self._timer_rules)  # the stand-in cuts its sockets first
        self.aborted += 1
        log.error(
            "step bound: a collective of this step ran past %.3g s; aborted groups %s%s",
            self.seconds,
            aborted,
            f" (failed: {failed})" if failed else "",
        )
        with self._cond:
            self._timer = None


# The learned timing.


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


# The left-behind fence.


class _Monitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = poller(threading.Thread(target=self._run, name="ncclguard-left-behind", daemon=True))

    def _run(self) -> None:
        watch = LeftBehind(GRACE_S)
        while not EXITING.wait(POLL_S):  # at exit it reads nothing more (ncclguard/exits.py)
            wd = current_watchdog()
            if wd is not None:  # the watchdog's check takes over
                arm(wd)
                return
            world = current_world()
            if world.store is None or not (dist.is_available() and dist.is_initialized()):
                continue  # no world yet (a restarted process waiting to rejoin is never fenced)
            record = _read(world.store)
            if not watch.observe(
                record.generation if record else None, world.generation, world.left_behind, True, time.monotonic()
            ):
                continue
            assert record is not None
            log.critical(
                "left behind: the job went on to generation %d (launch ranks %s) while this rank (%s of generation "
                "%d) never left its step; exiting with status 0 so that the job can end",
                record.generation,
                rank_ranges(record.origins),
                world.rank,
                world.generation,
            )
            exit_now(0)


def _read(store: dist.Store) -> WorldRecord | None:
    deadline = Deadline.within(STORE_BOUND_S)
    try:
        return read_world_record(store_for_this_thread(store, deadline), deadline)
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("left-behind fence: the world record is unreadable now (%s)", exc)
        return None


_MONITOR = _Monitor()


def arm_left_behind_fence() -> None:
    """Turns the left-behind fence on for this process (see the module doc); cheap when it is on."""
    wd = current_watchdog()
    if wd is not None:
        arm(wd)
    else:
        _MONITOR.ensure()


# The loop check.

FIX = (
    "write the loop as `for step in stepper.steps(STOP):` (it starts a restarted process at "
    "stepper.resume_step and goes back when StepResult.rewound_to says so), or go back by hand to "
    "the step StepResult.rewound_to names"
)


def not_rewound(step: int, rewind_to: int) -> LoopDiverged:
    """This rank's failure when its loop passes ``step`` after every rank went back to ``rewind_to``."""
    return LoopDiverged(f"this rank's loop passed step={step} after every rank went back to step {rewind_to}")


def diverged(res: CommitResult) -> LoopDiverged | None:
    """The error every rank raises when a failed commit shows the ranks' loops at different steps
    (the same outcome on every rank, so the same answer), or None."""
    if res:
        return None
    mark = f"{LoopDiverged.__name__}: "  # a rank's own failure, as its statement words it
    why = {r: [t for t in texts if t.startswith(STEP_DIFFERS) or mark in t] for r, texts in res.reasons.items()}
    why = {r: texts for r, texts in why.items() if texts}
    if not why:
        return None
    said = "; ".join(f"rank {r} {', '.join(texts)}" for r, texts in sorted(why.items()))
    return LoopDiverged(
        f"the ranks' loops are at different steps ({said}): no rebuild can mend that; {FIX}",
        step=res.step,
        failed_ranks=sorted(why),
        reasons=why,
    )
