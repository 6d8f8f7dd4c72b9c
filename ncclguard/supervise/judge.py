"""The supervisor's eye on its rank: its progress from ``/proc``, and what the waiting ranks ask of it.

A rank stuck on another host whose threads cannot run (SIGSTOP, the GIL held in C) publishes
nothing, and its peers cannot cut their connections to it from there: they ask its supervisor
(:mod:`ncclguard.store.asks`). The supervisor runs on the rank's host and is not stuck. Every
:data:`POLL_S` it samples its rank's process (:func:`ncclguard.watching.sensors.progress.sample_process`:
stopped or not, main-thread CPU time, I/O) and reads the one key of asks about its rank (one store
call, bounded). On an ask about its process:

- ``unknown`` (the peers cannot tell): it judges from its samples (:class:`~ncclguard.watching.sensors.progress.Progress`,
  the asker's window). Stuck: it ends the process with SIGKILL (its sockets close, so the peers'
  gloo op fails at once); moving: it answers so, and the process is left alone;
- ``confirm`` (the only waiting rank judged it stuck: nobody else waits to agree): this supervisor's
  own look is the second view. It ends the process as on ``unknown`` only when its samples say stuck
  too; moving: answered so, left alone;
- ``stuck`` (the peers judged it stuck, posted its death and went on): it ends the process if it has
  not exited by itself within :data:`STUCK_GRACE_S` (a rank whose threads run exits 0 by itself);
- ``stuck`` with ``heal`` (the peers agreed it is stuck, or the rank judged itself and its peers
  agreed, and posted nothing: the engine heals): unless its own samples show the process moving (a
  save blocked in ``close()`` on network storage, its CPU: then it answers moving and leaves it
  alone), it ends the process at once and posts its death, as a kill when a restart is left (the
  rank is restarted, rejoins and is healed: the full world back), else as stuck.

What may act is the one judge's to say (:func:`ncclguard.watching.judge.rules.rule_ask`); the kill
is its lever and refuses to act without its ruling.

Each ask is settled once (answered moving, or the process ended), never acted on later, and one not
settled within :data:`ASK_TTL_S` of its first read is stale: a rank idle in a later, healthy wait
must not be ended on an old ask.

An ask that is not about this supervisor's process is refused, said once (one line per ask, not per
poll) and never acted on: one that names another launch rank, a process of an earlier life of this
rank (the peers asked before its restart), or any other pid (garbage, a process it did not start).
A value under the key that is not a valid ask (not JSON, over :data:`~ncclguard.store.asks.MAX_ASK_BYTES`,
out of its model's bounds, NaN) is read as no ask (:func:`~ncclguard.store.asks.read_ask`).

:class:`Ended` says what the supervisor does next (:mod:`ncclguard.supervise.loop`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.asks import JudgeAnswer, JudgeAsk, post_answer, read_ask
from ncclguard.store.bounded import bounded_store_call
from ncclguard.watching.judge.rules import Ruling, rule_ask
from ncclguard.watching.sensors.progress import Progress, sample_process

__all__ = ["POLL_S", "STUCK_GRACE_S", "Ended", "StuckWatch"]

POLL_S = 1.0  # how often the supervisor samples its rank and reads the asks about it
STUCK_GRACE_S = 3.0  # a rank its peers judged stuck may exit 0 by itself this long (its verdict looks every 2 s)
STORE_BOUND_S = 2.0
DEFAULT_STILL_S = 10.0  # the window before any ask names one (the verdict's floor)
ASK_TTL_S = 120.0  # an ask not settled this long after it was first read is stale: its step is long over


@dataclass(frozen=True)
class Ended:
    """A process the supervisor ended because it was stuck.

    Attributes:
        pid: the process.
        judged: who judged it: ``"peers"`` (their death notice is posted) or ``"supervisor"``.
        evidence: what decided, in words.
        restart: the rank is restarted (the engine heals, said in the ask, and a restart is left).
        post: the supervisor posts its death (nobody else did): as a kill when it is restarted (the
            rebuild waits for it), else as stuck (the rebuild settles without it).
    """

    pid: int
    judged: str
    evidence: str
    restart: bool
    post: bool = False


class StuckWatch:
    """Samples the rank's process and acts on the asks about it (see the module doc).

    Args:
        origin: the rank's launch rank (``RANK``).
        store: returns the job's store client, or None while there is none.
        say: how the supervisor writes a line (its standard error).
    """

    def __init__(self, origin: int, store: Any, say: Any) -> None:
        self.origin, self._store, self._say = origin, store, say
        self._restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self._pid: int | None = None  # the process sampled (the rank's, from the first ask naming it)
        self._lives: list[int] = []  # the rank's processes followed so far, the current one last
        self._prog = Progress(DEFAULT_STILL_S)
        self._stuck_seen: float | None = None  # when a ``stuck`` ask about the current process was first read
        self._first_read: dict[float, float] = {}  # each ask (by its ``at``) -> when it was first read here
        self._settled: set[float] = set()  # the asks answered: an ask is acted on once, never later
        self._unread = False  # the last read failed (said once)

    def follow(self, proc: subprocess.Popen[Any]) -> None:
        """A new process runs the rank: its samples start afresh."""
        self._pid, self._prog, self._stuck_seen = proc.pid, Progress(DEFAULT_STILL_S), None
        self._lives.append(proc.pid)

    def look(self, proc: subprocess.Popen[Any], can_restart: bool) -> Ended | None:
        """One poll: samples the process, reads the asks, ends the process when it is stuck.

        Args:
            proc: the rank's running process.
            can_restart: a restart is left.

        Returns:
            What was ended (the process has been sent SIGKILL), or None.
        """
        now = time.monotonic()
        if self._pid is None:
            self._pid = proc.pid
        sample = sample_process(self._pid, now)
        if sample is not None:
            self._prog.observe(sample)
        ask = self._read()
        if ask is None or ask.at in self._settled:
            return None
        if not self._about(ask, proc):
            self._refuse(ask, proc)
            return None
        if now - self._first_read.setdefault(ask.at, now) > ASK_TTL_S:
            return None  # stale: the ranks that asked went on long ago
        if ask.pid != self._pid:  # the rank runs under a wrapper: sample the process the peers named
            self._pid, self._prog = ask.pid, Progress(ask.still_s)
            return None
        self._prog.still_s = ask.still_s
        mine = self._prog.judge(now)
        if ask.judged == "stuck" and not ask.heal and self._stuck_seen is None:
            self._stuck_seen = now
        waited = 0.0 if self._stuck_seen is None else now - self._stuck_seen
        ruling = rule_ask(ask.judged, ask.heal, mine.state, mine.evidence, self._prog.stopped, waited, STUCK_GRACE_S)
        who = "it judged itself stuck" if ask.asker == self.origin else "its peers agreed it is stuck"
        if ruling.kind in ("veto", "busy"):
            # Answered once: a later stillness (a healthy wait, once its peers got their op) is no reason
            # to act on this ask. A process stopped now is no answer yet: the window tells once it has passed.
            self._settled.add(ask.at)
            if ruling.kind == "veto":  # the peers' agreement is one view; what moves on this host vetoes it
                said = (
                    f": {who} (asked by launch rank {ask.asker}), but this supervisor sees it moving ({mine.evidence})"
                )
            else:
                said = f" is behind but moving ({mine.evidence})"
            self._say(f"launch rank {self.origin} (pid {ask.pid}){said}; left alone")
            self._answer(ask.pid, "moving", mine.evidence, False)
            return None
        if not ruling.acts:
            return None
        if ask.judged == "stuck" and ask.heal:  # nobody posted its death: ended now, restarted when one is left
            return self._end(proc, ask, ruling, "peers", f"{who} (asked by launch rank {ask.asker})", can_restart, True)
        if ask.judged == "stuck":
            why = f"its peers judged it stuck (asked by launch rank {ask.asker})"
            return self._end(proc, ask, ruling, "peers", why, False)
        return self._end(proc, ask, ruling, "supervisor", mine.evidence, ask.heal and can_restart)

    def _answer(self, pid: int, state: str, evidence: str, restarted: bool) -> None:
        """Posts the answer about process ``pid`` for the asking ranks (bounded; a failure is said, nothing more)."""
        ans = JudgeAnswer.model_validate(
            {
                "origin": self.origin,
                "pid": pid,
                "state": state,
                "evidence": evidence[:300],
                "restarted": restarted,
                "host": socket.gethostname(),
                "at": time.time(),
            }
        )
        store = self._store()
        if store is None:
            return
        try:
            bounded_store_call(
                store, lambda: post_answer(store, ans, self._restart), Deadline.within(STORE_BOUND_S), "an answer"
            )
        except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
            self._say(f"the answer about launch rank {self.origin} was not posted: {exc}")

    def _about(self, ask: JudgeAsk, proc: subprocess.Popen[Any]) -> bool:
        """The ask names this rank's process, or one it started (a wrapper's child)."""
        if ask.origin != self.origin:
            return False
        if ask.pid == proc.pid:
            return True
        import psutil

        try:
            return ask.pid in {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            return False

    def _refuse(self, ask: JudgeAsk, proc: subprocess.Popen[Any]) -> None:
        """An ask not about this rank's process: settled unacted (never read again), said once."""
        self._settled.add(ask.at)
        if ask.origin != self.origin:
            what = f"names launch rank {ask.origin}, not this supervisor's"
        elif ask.pid in self._lives[:-1]:
            what = f"names pid {ask.pid}, an earlier process of this rank (it runs as pid {proc.pid} now)"
        else:
            what = f"names pid {ask.pid}, neither this supervisor's rank (pid {proc.pid}) nor a process it started"
        self._say(f"an ask about launch rank {self.origin} {what}: refused, nothing done")

    def _read(self) -> JudgeAsk | None:
        store = self._store()
        if store is None:
            return None
        try:
            ask = bounded_store_call(
                store, lambda: read_ask(store, self.origin, self._restart), Deadline.within(STORE_BOUND_S), "the asks"
            )
        except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
            if not self._unread:
                self._say(f"the asks about launch rank {self.origin} are unreadable now ({exc}); trying every poll")
            self._unread = True
            return None
        self._unread = False
        return ask

    def _end(
        self,
        proc: subprocess.Popen[Any],
        ask: JudgeAsk,
        ruling: Ruling,
        judged: str,
        evidence: str,
        restart: bool,
        post: bool = False,
    ) -> Ended:
        ruling.require(f"SIGKILL of launch rank {self.origin} (pid {ask.pid})")
        # The answer first: the asking ranks' op fails the moment the process dies, and they read it then.
        self._settled.add(ask.at)
        self._answer(ask.pid, "stuck", evidence, restart)
        self._say(
            f"launch rank {self.origin} (pid {ask.pid}, at {ask.site or '?'}) is stuck: {evidence}; SIGKILL, "
            "so that the ranks waiting for it go on at once"
        )
        for pid in {ask.pid, proc.pid}:  # the rank, and the wrapper that runs it if any
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return Ended(ask.pid, judged, evidence, restart, post or judged == "supervisor")
