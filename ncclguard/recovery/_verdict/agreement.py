"""Act only on an agreed culprit: the waiting ranks must agree before one of them acts on a peer.

Two victims of one culprit can leave the op at different times (one cuts its link first); from the
other victim's side the first then looks still, and a judgment made by one rank alone names a
victim (NOTES.md, "Real size, and doing no harm"). So a rank that judges a peer stuck acts only
when, in the heartbeats every rank publishes (their ``judged`` field: what each judged of the
ranks it waits for), every other rank that beats judges that peer stuck too, and the peer itself
judges nobody stuck (a rank that waits for a stuck rank is a victim, whatever it looks like).
A rank with no fresh heartbeat has no say (it may be the culprit's twin, stopped or gone).
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


def _says_stuck(text: str | None) -> bool:
    return bool(text) and str(text).startswith("stuck")


def agreement(accused: int, me: int, beats: Mapping[int, tuple[Heartbeat, float]], fresh_s: float) -> Agreement:
    """Whether this rank may act on ``accused``, judged stuck here (see the module doc).

    Args:
        accused: the rank this rank judged stuck.
        me: this rank.
        beats: each peer's newest heartbeat and its age in seconds.
        fresh_s: a heartbeat older than this has no say.

    Returns:
        The :class:`Agreement`.
    """
    own = beats.get(accused)
    if own is not None and own[1] < fresh_s:
        waits_for = sorted(int(k) for k, v in (own[0].judged or {}).items() if _says_stuck(v) and int(k) != accused)
        if waits_for:
            return Agreement(False, f"rank {accused} itself waits for rank(s) {waits_for}, which it judged stuck")
    voters = []
    for r, (hb, age) in sorted(beats.items()):
        if r in (me, accused) or age >= fresh_s:
            continue
        said = (hb.judged or {}).get(str(accused))
        if not _says_stuck(said):
            return Agreement(False, f"rank {r} does not judge rank {accused} stuck ({said or 'not judged yet'})")
        voters.append(r)
    if voters:
        return Agreement(True, f"rank(s) {voters} judge it stuck too", tuple(voters))
    return Agreement(True, "no other rank waits with a fresh heartbeat", ())
