"""The action ladder: what the watchdog does about an incident, rung by rung.

Each rung is an :class:`Action`: a small callable object that gets the incident and a context
and returns an :class:`Outcome`. The built-in rungs, in the order ``WatchdogConfig.action``
climbs them:

``Report``  the dump and the log line (always the first rung: done when the incident is handled);
``Raise``   raises :class:`~ncclguard.errors.CollectiveTimeout` in the main thread by a signal
            (``raise_signal``). Works where the main thread runs Python (a stalled loop, a sleep);
            a main thread blocked in a C++ collective is skipped, since no exception can reach it
            before the backend returns;
``Abort``   ``ProcessGroup.abort()`` on every process group (``_torch_compat.abort_all_groups``):
            blocked NCCL waits return with an error. Gloo's abort does not wake a blocked op;
``Fence``   on the rank the merged incident names the culprit (stuck elsewhere, not waiting in the
            op), ``fence_after_s`` after the rung before: its dump, a fence mark in the store, and
            ``os._exit(0)``. Its peers' blocked op then fails at once (gloo: "Connection closed by
            peer"), their step's commit fails, and ``RecoveringStep(allow_shrink=True)`` rebuilds
            without it; status 0 so that torchrun leaves the survivors running. On any other rank
            it does nothing (``done`` False);
``Exit``    ``os._exit(code)`` (default 75, EX_TEMPFAIL) after the dump, so torchrun or an elastic
            agent restarts the job.

The built-in ladders are :data:`~ncclguard.watching.base.settings.LADDERS`: ``fence`` climbs
report, abort, fence (no raise, no exit: it is for loops that recover in process).

Between rungs the ladder waits ``escalate_after_s`` and stops once the hung op completed. Your own
rung is a subclass (it runs in the watchdog thread: keep it short, and never call a collective on
the hung group from it)::

    class SaveCheckpoint(Action):
        name = "checkpoint"

        def __call__(self, incident, ctx):
            path = save_my_state(incident.dir)  # your code
            return Outcome(done=True, details={"path": str(path)})

    ncclguard.start_watchdog(hang_timeout_s=300, actions=["report", SaveCheckpoint(), "exit"])
"""

from __future__ import annotations

import abc
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.errors import CollectiveTimeout
from ncclguard.exits import exit_now
from ncclguard.incidents.model import ActionEntry, IncidentDoc, MergedNote, OpRecord
from ncclguard.watching.base.settings import LADDERS
from ncclguard.watching.judge.rules import rule_fence
from ncclguard.world import current_world

if TYPE_CHECKING:
    from ncclguard.watching.base.settings import WatchdogConfig

__all__ = [
    "Abort",
    "Action",
    "ActionContext",
    "Exit",
    "Fence",
    "IncidentRef",
    "Ladder",
    "LadderState",
    "MainThreadRaiser",
    "Outcome",
    "Raise",
    "Report",
    "Step",
    "build_ladder",
]


@dataclass
class Outcome:
    """What a rung did.

    Attributes:
        done: it took effect (False: skipped or failed; ``why`` says why).
        why: the reason it did not.
        details: anything else worth keeping in the dump (JSON data).
    """

    done: bool
    why: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IncidentRef:
    """The incident as an action sees it: what was raised, and its directory."""

    doc: IncidentDoc
    dir: Path

    def error(self) -> CollectiveTimeout:
        """The exception that stands for this incident (the ``raise`` rung's)."""
        doc = self.doc
        return CollectiveTimeout(
            f"ncclguard watchdog, incident {doc.id}: {doc.reason}; report in {self.dir}",
            op=doc.op or "",
            group=doc.group or "",
            elapsed_s=time.time() - doc.created,
            missing_ranks=doc.ranks,
        )


class MainThreadRaiser:
    """Carries an exception into the main thread: arm it, then signal; the handler raises it.

    Args:
        signum: the signal (``WatchdogConfig.raise_signal``).
        completed: tells whether this rank's part of an op ``(group, seq)`` completed.
    """

    def __init__(self, signum: int, completed: Callable[[tuple[str, int]], bool]) -> None:
        self.signum, self.completed = signum, completed
        self._pending: tuple[BaseException, tuple[str, int] | None, Outcome] | None = None
        self._prev: Any = None

    def install(self, handler: Callable[[int, FrameType | None], None]) -> None:
        """Installs ``handler`` (which calls :meth:`on_signal`); main thread only."""
        self._prev = signal.signal(self.signum, handler)

    def uninstall(self) -> None:
        # None: the old handler was installed from C, which Python cannot put back.
        signal.signal(self.signum, self._prev if self._prev is not None else signal.SIG_DFL)
        self._prev = None

    def fire(self, exc: BaseException, key: tuple[str, int] | None, outcome: Outcome, thread_ident: int) -> None:
        """Raises ``exc`` in thread ``thread_ident`` unless op ``key`` completes first (then
        ``outcome`` is marked not done)."""
        self._pending = (exc, key, outcome)
        signal.pthread_kill(thread_ident, self.signum)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler's body, in the main thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            exc, key, outcome = pending
            # Checked here, in the main thread, so it cannot race with the op completing: a rank
            # whose part of the hung op completed meanwhile is not stuck any more.
            if key is not None and self.completed(key):
                outcome.done = False
                outcome.why = f"dropped: op #{key[1]} on group {key[0]} completed on this rank before the signal landed"
                log.warning("watchdog: raise %s", outcome.why)
                return
            raise exc
        prev = self._prev
        if callable(prev):  # not ours: the application's own use of the signal
            prev(signum, frame)


@dataclass
class ActionContext:
    """What an action may use.

    Attributes:
        config: the watchdog's settings.
        rank: this rank.
        main_ident: the main thread's ident.
        raiser: carries an exception into the main thread (None unless a rung needs it).
        blocked_in: the synchronous op the main thread is blocked in, if any.
        save: records an outcome in the rank's dump now (for a rung that does not return).
        merged: the merged report of the incident (its culprits) from the store; None until a
            rank merged it, or without a store.
        mark_fenced: puts this rank's fence mark in the store; True once it is there.
    """

    config: WatchdogConfig
    rank: int
    main_ident: int | None
    raiser: MainThreadRaiser | None
    blocked_in: Callable[[], OpRecord | None]
    save: Callable[[Outcome], None]
    merged: Callable[[], MergedNote | None] = field(default=lambda: None)
    mark_fenced: Callable[[], bool] = field(default=lambda: False)


class Action(abc.ABC):
    """One rung of the ladder. Subclass it, set ``name``, implement ``__call__``.

    Attributes:
        name: how the rung is named in the dump and the log.
        needs_main_thread: it raises into the main thread, so the watchdog must be started from
            the main thread (to install the signal handler).
    """

    name: ClassVar[str] = "action"
    needs_main_thread: ClassVar[bool] = False
    wait_s: float | None = None  # the wait before this rung; None: the ladder's escalate_after_s

    @abc.abstractmethod
    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        """Acts on ``incident``; returns what it did. Runs in the watchdog thread."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Report(Action):
    """The first rung: the dump and the log line, written when the incident is handled."""

    name = "report"

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        return Outcome(done=True)


class Raise(Action):
    """Raises :class:`~ncclguard.errors.CollectiveTimeout` in the main thread, unless it is
    blocked in a C++ collective (no exception reaches it there)."""

    name = "raise"
    needs_main_thread = True

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        if ctx.raiser is None:
            return Outcome(done=False, why="no signal handler (the watchdog was started without a raising rung)")
        blocked = ctx.blocked_in()
        if blocked is not None:
            why = (
                f"the main thread is blocked in C++ ({blocked.op} #{blocked.seq}); "
                "an exception cannot reach it before the backend returns"
            )
            log.warning("watchdog: raise skipped: %s", why)
            return Outcome(done=False, why=why)
        outcome = Outcome(done=True)  # the handler marks it not done if the op completes first
        ctx.raiser.fire(incident.error(), incident.doc.op_key, outcome, ctx.main_ident or 0)
        log.error("watchdog: raised CollectiveTimeout in the main thread")
        return outcome


class Abort(Action):
    """``abort()`` on every process group: blocked NCCL waits return with an error."""

    name = "abort"

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return Outcome(done=False, why="no process group")
        if incident.doc.generation != current_world().generation:
            # Its groups were abandoned by a rebuild; the groups there now are the new world's.
            why = f"the world was rebuilt since (generation {incident.doc.generation} -> {current_world().generation})"
            return Outcome(done=False, why=why)
        aborted, failed = compat.abort_all_groups()
        log.error("watchdog: aborted process groups %s%s", aborted, f" (failed: {failed})" if failed else "")
        return Outcome(done=bool(aborted), details={"aborted": aborted, "failed": failed})


class Exit(Action):
    """Ends the process with ``os._exit(code)`` once the dump says so.

    Args:
        code: the exit status; default ``WatchdogConfig.exit_code`` (75).
    """

    name = "exit"

    def __init__(self, code: int | None = None) -> None:
        if code is not None and not 1 <= code <= 255:
            raise ValueError(f"exit code must be in 1..255, got {code}")
        self.code = code

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        code = self.code if self.code is not None else ctx.config.exit_code
        outcome = Outcome(done=True, details={"code": code})
        ctx.save(outcome)
        log.critical("watchdog: exiting with status %d after incident %s", code, incident.doc.id)
        exit_now(code)


class Fence(Action):
    """Ends this rank with status 0 when the merged incident names it the culprit.

    The rank acts on the report itself, from its watchdog thread: its main thread is stuck
    elsewhere (a loop, a sleep, a wait that never ends) and will not come back. It writes its
    dump, marks itself fenced in the store (``python -m ncclguard status`` shows it) and exits 0:
    torchrun's agent stops every worker when one exits non-zero, and leaves the others alone when
    one exits 0. The survivors' blocked op fails once this process is gone (gloo wakes them with
    "Connection closed by peer"; NCCL's waits were ended by the ``abort`` rung before), and
    ``RecoveringStep(allow_shrink=True)`` rebuilds without this rank.

    A rank whose GIL is held by C code cannot run its watchdog thread, so it cannot fence itself:
    its heartbeat stops, its peers name it lost, and it stays alive until the C call returns (see
    docs/reference/recovery-stuck-ranks.md, "Fencing a stuck rank").

    Args:
        after_s: the wait before this rung (default ``WatchdogConfig.fence_after_s``).
    """

    name = "fence"

    def __init__(self, after_s: float | None = None) -> None:
        if after_s is not None and not after_s > 0:
            raise ValueError(f"after_s must be > 0 seconds, got {after_s!r}")
        self.wait_s = after_s

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        note = ctx.merged()
        ruling = rule_fence(ctx.rank, None if note is None else list(note.culprits))
        if note is None:
            return Outcome(done=False, why=ruling.why)
        if not ruling.acts:
            named = f"rank(s) {rank_ranges(note.culprits)} named the culprit" if note.culprits else "no culprit named"
            return Outcome(done=False, why=f"{named}; this rank is not fenced", details={"culprits": note.culprits})
        marked = ctx.mark_fenced()
        outcome = Outcome(done=True, details={"fenced": True, "code": 0, "marked": marked, "culprits": note.culprits})
        ctx.save(outcome)
        log.critical(
            "watchdog: fenced: incident %s names this rank (%d) the culprit; exiting with status 0 so that the "
            "others rebuild without it",
            incident.doc.id,
            ctx.rank,
        )
        exit_now(0)


BUILTIN: dict[str, type[Action]] = {"report": Report, "raise": Raise, "abort": Abort, "fence": Fence, "exit": Exit}


def build_ladder(
    action: str, actions: Sequence[Action | str] | None = None, fence_after_s: float | None = None
) -> list[Action]:
    """The rungs to climb.

    Args:
        action: ``WatchdogConfig.action``: the built-in ladder up to it (:data:`LADDERS`).
        actions: a ladder of your own instead: built-in names and :class:`Action` instances, in
            order. ``report`` is put first when it is not.
        fence_after_s: the wait before a ``fence`` rung named here (``WatchdogConfig.fence_after``).

    Raises:
        TypeError: an entry that is neither a built-in name nor an Action.
    """

    def builtin(name: str) -> Action:
        return Fence(fence_after_s) if name == "fence" else BUILTIN[name]()

    if actions is None:
        return [builtin(name) for name in LADDERS[action]]
    ladder: list[Action] = []
    for a in actions:
        if isinstance(a, str) and a in BUILTIN:
            ladder.append(builtin(a))
        elif isinstance(a, Action):
            ladder.append(a)
        else:
            raise TypeError(
                f"each of actions must be one of {list(BUILTIN)} or an ncclguard.watching.ladder.actions.Action "
                f"instance, got {a!r}"
            )
    if not ladder or not isinstance(ladder[0], Report):
        ladder.insert(0, Report())
    return ladder


def _wall(now: float) -> float:
    """The wall-clock time of the monotonic reading ``now``: a rung is stamped with the reading its
    wait was counted from, so two stamps are at least the wait apart however long a loaded tick took
    between its reading and the rung (a stamp taken later once made them 0.27 s apart for a 0.4 s wait)."""
    return time.time() - (time.monotonic() - now)


@dataclass
class Step:
    """One rung as taken: its name, when (the tick's reading that took it), and what it did."""

    rung: str
    time: float
    outcome: Outcome

    def entry(self) -> ActionEntry:
        o = self.outcome
        return ActionEntry.model_validate(
            {**o.details, "rung": self.rung, "time": self.time, "done": o.done, "why": o.why}
        )


@dataclass
class LadderState:
    """Where one incident stands on the ladder."""

    rung: int = 0
    deadline: float = 0.0  # monotonic time before which the next rung waits
    steps: list[Step] = field(default_factory=list)
    settled: bool = False


Climb = Literal["settled", "waiting", "resolved", "stepped"]


class Ladder:
    """The rungs, and the rule that climbs them.

    Args:
        actions: the rungs (see :func:`build_ladder`).
        escalate_after_s: the time each rung gets to clear the hang before the next one.
    """

    def __init__(self, actions: Sequence[Action], escalate_after_s: float) -> None:
        self.actions = list(actions)
        self.escalate_after_s = escalate_after_s

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.actions)

    @property
    def needs_main_thread(self) -> bool:
        return any(a.needs_main_thread for a in self.actions)

    def start(self, state: LadderState, now: float, run: Callable[[Action, Step], Outcome]) -> None:
        """Takes the first rung (the report) at once; the next follows without waiting, unless it
        has a wait of its own (``Action.wait_s``: the fence's)."""
        step = Step(self.actions[0].name, _wall(now), Outcome(done=False, why="running"))
        state.steps.append(step)
        step.outcome = run(self.actions[0], step)
        following = self.actions[1] if len(self.actions) > 1 else None
        state.deadline = now + (following.wait_s or 0.0 if following is not None else 0.0)

    def climb(
        self, state: LadderState, now: float, resolved: Callable[[], bool], run: Callable[[Action, Step], Outcome]
    ) -> Climb:
        """Takes the next rung when its time has come and the hang has not cleared.

        Args:
            state: the incident's place on the ladder.
            now: ``time.monotonic()``.
            resolved: True once the hung op completed (then no rung follows).
            run: takes a rung: calls the action with its context, returns its outcome.

        Returns:
            ``settled`` (no rung left), ``waiting`` (not yet), ``resolved`` (cleared; settled),
            or ``stepped`` (a rung was taken).
        """
        if state.rung + 1 >= len(self.actions):
            state.settled = True
            return "settled"
        if now < state.deadline:
            return "waiting"
        if resolved():
            state.steps.append(Step("resolved", _wall(now), Outcome(done=True)))
            state.settled = True
            return "resolved"
        state.rung += 1
        following = self.actions[state.rung + 1] if state.rung + 1 < len(self.actions) else None
        wait = following.wait_s if following is not None and following.wait_s is not None else None
        state.deadline = now + (wait if wait is not None else self.escalate_after_s)
        action = self.actions[state.rung]
        step = Step(action.name, _wall(now), Outcome(done=False, why="running"))
        state.steps.append(step)
        try:
            step.outcome = run(action, step)
        except Exception as exc:  # noqa: BLE001 - a user's rung that fails must not stop the ladder
            log.exception("watchdog: the %s rung failed", action.name)
            step.outcome = Outcome(done=False, why=f"failed: {type(exc).__name__}: {exc}")
        return "stepped"
