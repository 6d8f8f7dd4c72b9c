"""Act only on an agreed culprit: the waiting ranks must agree before one of them acts on a peer.

Two victims of one culprit can leave the op at different times (one cuts its link first); from the
other victim's side the first then looks still, and a judgment made by one rank alone names a
victim (NOTES.md, "Real size, and doing no harm"). So a rank that judges a peer stuck acts only
when, in the heartbeats every rank publishes (their ``judged`` field: what each judged of the
ranks it waits for), every other rank that beats judges that peer stuck too, and the peer itself
judges nobody stuck (a rank that waits for a stuck rank is a victim, whatever it looks like).
A rank with no fresh heartbeat has no say (it may be the culprit's twin, stopped or gone), and a
vote counts only for the step it is about (the heartbeat's ``judged_about``): one left from another
step, or another world, is no vote.
Without agreement nothing is done: the judgment is re-read at the next look, and the step bound
stays the hard cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ncclguard.incidents.beats import Heartbeat

__all__ = ["Agreement", "agreement"]


@dataclass(frozen=True)
class Agreement:
    """Whether the waiting ranks agree that ``accused`` is stuck, and why (or why not)."""

    agreed: bool
    why: str
    voters: tuple[int, ...] = ()
    victim: bool = False  # the accused itself waits for a rank it judged stuck


def _says_stuck(text: str | None) -> bool:
    return bool(text) and str(text).startswith("stuck")


def _votes(hb: Heartbeat, about: str | None) -> dict[str, str]:
    """A heartbeat's votes, if they are about the step ``about`` (all of them when ``about`` is None)."""
    if about is not None and hb.judged_about != about:
        return {}
    return hb.judged or {}


def agreement(
    accused: int, me: int, beats: Mapping[int, tuple[Heartbeat, float]], fresh_s: float, about: str | None = None
) -> Agreement:
    """Whether this rank may act on ``accused``, judged stuck here (see the module doc).

    Args:
        accused: the rank this rank judged stuck.
        me: this rank.
        beats: each peer's newest heartbeat and its age in seconds.
        fresh_s: a heartbeat older than this has no say.
        about: the step this rank judges (``"<generation>/<step>"``): only votes about it count.

    Returns:
        The :class:`Agreement`.
    """
    own = beats.get(accused)
    if own is not None and own[1] < fresh_s:
        waits_for = sorted(int(k) for k, v in _votes(own[0], about).items() if _says_stuck(v) and int(k) != accused)
        if waits_for:
            return Agreement(
                False, f"rank {accused} itself waits for rank(s) {waits_for}, which it judged stuck", victim=True
            )
    voters = []
    for r, (hb, age) in sorted(beats.items()):
        if r in (me, accused) or age >= fresh_s:
            continue
        said = _votes(hb, about).get(str(accused))
        if not _says_stuck(said):
            other = hb.judged_about if about is not None and hb.judged and hb.judged_about != about else None
            why = f"its votes are about step {other}, not {about}" if other else (said or "not judged yet")
            return Agreement(False, f"rank {r} does not judge rank {accused} stuck ({why})")
        voters.append(r)
    if voters:
        return Agreement(True, f"rank(s) {voters} judge it stuck too", tuple(voters))
    return Agreement(True, "no other rank waits with a fresh heartbeat", ())
