"""The one judge's rules: whether anything may act on a rank judged stuck, whoever looks.

Five seats can see a stuck rank. Each sees something the others cannot, none decides alone: each
asks these rules, and only a ruling that says so opens a lever (a death notice, an ask to end a
rank, a cut of its connections, a SIGKILL, an exit). The levers other parts reach (the death notice,
the ask, the supervisor's SIGKILL) call :meth:`Ruling.require` first, and one reached without an
acting ruling raises :class:`~ncclguard.errors.UnjudgedAction` before acting.

============== ======================================================= ==========================================
seat           who                                                     what it sees
============== ======================================================= ==========================================
``peer``       a waiting rank's verdict on a peer behind it            the peers' heartbeats; ``/proc`` on its host
               (``recovery/_verdict/verdict.py``)
``self``       a rank's verdict on itself (``recovery/_verdict/        its own samples, its peers' votes
               self_check.py``)
``supervisor`` the rank's supervisor, on the waiting ranks' ask        its process's ``/proc``, every second
               (``supervise/judge.py``)
``fence``      the watchdog's fence rung (``watching/ladder/           the merged incident: every rank's statement
               actions.py``)
``left-behind`` the watchdog (``watching/desk/left_behind.py``)        the job's world record
============== ======================================================= ==========================================

The rules; the first that applies decides:

1. **Stale.** A look about a step other than the one open at the seat (the step ended while the
   look ran, the world was rebuilt) acts on nothing; a vote counts only for the step it is about
   (:mod:`~ncclguard.watching.judge.agreement`).
2. **Busy.** Any movement is progress: CPU, threads, children, network bytes, a thread blocked in
   file I/O or inside a filesystem under its own bound (:mod:`ncclguard.watching.sensors.progress`).
   Reported, never acted on.
3. **Victim.** A rank that itself waits for a rank it judged stuck is a victim, never acted on.
4. **Two views.** A rank is acted on only when two independent views say it is stuck: the seat's
   and at least one other waiting rank's vote about the same step, or, where the seat is the only
   rank waiting, its supervisor's own look (``confirm``: the supervisor ends it only if it sees it
   stuck too). With no second view to be had (no other waiting rank, no supervisor), nothing acts;
   the step bound is the cap.
5. **Veto.** A supervisor that sees its process moving vetoes what the waiting ranks agreed.

Pure: no clock, no store, no process; the seats read those and pass what they saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ncclguard.errors import UnjudgedAction
from ncclguard.watching.judge.agreement import Agreement

__all__ = [
    "Kind",
    "Ruling",
    "Seat",
    "rule_ask",
    "rule_fence",
    "rule_left_behind",
    "rule_peer",
    "rule_self",
    "rule_silent",
]

Seat = Literal["peer", "self", "supervisor", "fence", "left-behind"]
# act: a lever may act now; confirm: ask the rank's supervisor for the second view (nothing acts
# here); ask: ask its supervisor to judge a rank nobody here can see; the rest act on nothing.
Kind = Literal["act", "confirm", "ask", "await", "busy", "unknown", "stale", "victim", "veto", "wait"]


@dataclass(frozen=True)
class Ruling:
    """What the judge allows one seat to do about one rank, and why.

    Attributes:
        seat: who asked.
        kind: what it may do (see :data:`Kind`).
        why: in words, for the log and the events.
        views: the views that said stuck, where it acts (``"rank 0"``, ``"its supervisor"``, ...).
    """

    seat: Seat
    kind: Kind
    why: str
    views: tuple[str, ...] = ()

    @property
    def acts(self) -> bool:
        """A lever may act on the rank now."""
        return self.kind == "act"

    @property
    def asks(self) -> bool:
        """The rank's supervisor is to be asked (for the second view, or to judge what nobody here sees)."""
        return self.kind in ("act", "confirm", "ask")

    def require(self, lever: str, asking: bool = False) -> None:
        """Called by a lever before it acts.

        Args:
            lever: what the lever does, in words (for the error).
            asking: the lever only asks a supervisor (``confirm`` and ``ask`` rulings allow that too).

        Raises:
            UnjudgedAction: the ruling does not allow it; nothing was done.
        """
        if self.acts or (asking and self.asks):
            return
        raise UnjudgedAction(
            f"{lever} refused: the judge's ruling for the {self.seat} seat is {self.kind!r} ({self.why})"
        )


def _open(seat: Seat, about: str | None, open_about: str | None) -> Ruling | None:
    if about != open_about:
        now = f"step {open_about} is open" if open_about else "no step is open"
        return Ruling(seat, "stale", f"the look is about step {about}, and {now}: nothing acts on it")
    return None


def _evidence(seat: Seat, state: str, evidence: str) -> Ruling | None:
    if state == "moving":
        return Ruling(seat, "busy", f"moving ({evidence}): reported, never acted on")
    if state != "stuck":
        return Ruling(seat, "unknown", f"not judged yet ({evidence or state})")
    return None


def rule_peer(
    me: int, state: str, evidence: str, agreed: Agreement, about: str | None, open_about: str | None, supervised: bool
) -> Ruling:
    """A waiting rank's ruling on a peer behind it.

    Args:
        me: the waiting rank.
        state: its judgment of the peer (``moving``, ``stuck``, ``unknown``).
        evidence: what decided, in words.
        agreed: the other waiting ranks' votes about the peer (:func:`~ncclguard.watching.judge.agreement.agreement`).
        about: the step the look is about (``"<generation>/<step>"``).
        open_about: the step open at this rank now (None: none).
        supervised: the ranks run under a supervisor (``python -m ncclguard.supervise``), which can
            give the second view.

    Returns:
        ``act`` with two views or more; ``confirm`` where this rank waits alone under a supervisor;
        else no action (``stale``, ``busy``, ``unknown``, ``victim``, ``await``).
    """
    first = _open("peer", about, open_about) or _evidence("peer", state, evidence)
    if first is not None:
        return first
    if agreed.victim or not agreed.agreed:
        return Ruling("peer", "victim" if agreed.victim else "await", agreed.why)
    if agreed.voters:
        views = (f"rank {me}", *(f"rank {v}" for v in agreed.voters))
        return Ruling("peer", "act", f"{agreed.why}: {len(views)} views", views)
    if supervised:
        why = f"{agreed.why}: its supervisor's own look is the second view, asked to end it only if it sees it stuck"
        return Ruling("peer", "confirm", why, (f"rank {me}",))
    why = f"{agreed.why}, and no supervisor to look: one view, no action (the step bound is the cap)"
    return Ruling("peer", "await", why)


def rule_silent(silent_s: float, about: str | None, open_about: str | None) -> Ruling:
    """A waiting rank's ruling on a peer behind it on another host that publishes nothing (SIGSTOP,
    the GIL held in C): nobody here can see it, so its supervisor is asked to judge it from ``/proc``
    (its look is the view that decides, the silence this rank's).

    Args:
        silent_s: how long its heartbeats have been silent.
        about: the step the look is about.
        open_about: the step open now.
    """
    return _open("peer", about, open_about) or Ruling(
        "peer", "ask", f"no heartbeat for {silent_s:.1f} s, on another host: its supervisor is asked to judge it"
    )


def rule_self(state: str, evidence: str, agreed: Agreement, about: str | None, open_about: str | None) -> Ruling:
    """A rank's ruling on itself (its peers wait in an op it never reached).

    Args:
        state: its judgment of itself.
        evidence: what decided, in words.
        agreed: its waiting peers' votes about it.
        about: the step the look is about.
        open_about: the step open now.

    Returns:
        ``act`` once its own samples and at least one waiting peer say stuck; else no action.
    """
    first = _open("self", about, open_about) or _evidence("self", state, evidence)
    if first is not None:
        return first
    if agreed.agreed and agreed.voters:
        return Ruling(
            "self", "act", f"{agreed.why}: its own samples too", ("itself", *(f"rank {v}" for v in agreed.voters))
        )
    return Ruling("self", "await", agreed.why or "no peer judges it yet")


def rule_ask(
    judged: str, heal: bool, state: str, evidence: str, stopped: bool, waited_s: float, grace_s: float
) -> Ruling:
    """A supervisor's ruling on an ask about its rank's process.

    Args:
        judged: the ask: ``stuck`` (the waiting ranks agreed), ``confirm`` (one waiting rank judged
            it stuck, the only one waiting), ``unknown`` (nobody could see it).
        heal: the askers posted no death notice (the engine heals): the supervisor acts at once.
        state: its own judgment of the process (its samples, the asker's window).
        evidence: what decided its own judgment.
        stopped: the process is stopped (SIGSTOP): no movement it shows counts.
        waited_s: how long since it first read this ask.
        grace_s: a rank whose death was posted may exit by itself this long.

    Returns:
        ``act`` (end the process), ``veto`` or ``busy`` (answer moving, leave it), ``wait`` (read the
        ask again at the next poll).
    """
    moving = state == "moving" and not stopped
    if judged == "stuck" and heal:
        if moving:
            return Ruling(
                "supervisor", "veto", f"the waiting ranks agreed, but this supervisor sees it moving ({evidence})"
            )
        return Ruling(
            "supervisor",
            "act",
            "the waiting ranks agreed, and it does not move here",
            ("the waiting ranks", "its supervisor"),
        )
    if judged == "stuck":  # its death is posted on the agreed verdict: the world went on without it
        if waited_s < grace_s:
            return Ruling("supervisor", "wait", f"its death is posted; it may exit by itself for {grace_s:g} s")
        return Ruling(
            "supervisor", "act", "its death is posted on the waiting ranks' agreed verdict", ("the waiting ranks",)
        )
    if state == "stuck":
        asked = "the only waiting rank judged it stuck" if judged == "confirm" else "its peers cannot see it"
        return Ruling(
            "supervisor",
            "act",
            f"{asked}, and this supervisor sees it stuck too ({evidence})",
            ("the asker", "its supervisor"),
        )
    if moving:
        return Ruling("supervisor", "busy", f"behind but moving ({evidence})")
    return Ruling("supervisor", "wait", f"not judged yet here ({evidence or state})")


def rule_fence(rank: int, culprits: list[int] | None) -> Ruling:
    """The fence rung's ruling on its own rank.

    Args:
        rank: this rank.
        culprits: the ranks the merged incident names the culprits (every rank's statement merged),
            or None when no merged report exists yet.
    """
    if culprits is None:
        return Ruling("fence", "wait", "no merged report in the store yet: no rank is named the culprit")
    if rank not in culprits:
        return Ruling("fence", "await", "this rank is not named the culprit")
    return Ruling("fence", "act", "the merged incident names this rank the culprit", ("every rank's statement",))


def rule_left_behind(
    recorded: int | None, mine: int, told: bool, member: bool, seen_for_s: float | None, grace_s: float
) -> Ruling:
    """The watchdog's ruling on its own rank when the job's world record is newer than its world.

    Args:
        recorded: the generation in the job's world record (None: none recorded).
        mine: the generation this rank's watchdog follows.
        told: the process learned it is left out (its own code decides then).
        member: the process is in a world with a process group (a restarted process waiting to
            rejoin is behind by design).
        seen_for_s: how long a newer generation has been seen (None: not yet).
        grace_s: how long it must be seen first.
    """
    if told or not member or recorded is None or recorded <= mine:
        return Ruling("left-behind", "await", "not behind the job's world, or excused")
    if seen_for_s is None or seen_for_s < grace_s:
        return Ruling("left-behind", "wait", f"a newer world ({recorded}) seen for less than {grace_s:g} s")
    return Ruling(
        "left-behind",
        "act",
        f"the job went on to generation {recorded} without this rank, and its main thread never came back",
        ("the job's world record", "its own generation"),
    )
