"""One step's look at the peers, as the verdict keeps it (:mod:`ncclguard.recovery._verdict.verdict`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ncclguard.recovery._verdict.release import Release
from ncclguard.watching.sensors.progress import Progress

__all__ = ["Seen"]


@dataclass
class Seen:
    """One step's look at the peers: their progress, what was said and done about each."""

    started: float
    still_s: float
    peers: dict[int, Progress] = field(default_factory=dict)
    beats: dict[int, int] = field(default_factory=dict)
    own: Progress | None = None
    reported: set[int] = field(default_factory=set)
    acted: set[int] = field(default_factory=set)
    awaiting: set[int] = field(default_factory=set)  # judged stuck here, not yet by the other waiting ranks
    asked: dict[int, tuple[int, int, str]] = field(default_factory=dict)  # rank -> (pid, launch rank, site) asked about
    confirming: set[int] = field(default_factory=set)  # asked to confirm: its supervisor decides, once per step
    self_asked: float | None = None  # when this rank, judging itself stuck, asked its supervisor to end it
    self_awaiting: bool = False  # it judged itself stuck, and its peers did not (yet): no action
    generation: int = 0  # the world it was armed in: its ranks' numbers and progress are that world's
    release: Release | None = None  # its watch on the world's death notices (made at its first look)
    about: str | None = None  # the step it judges, "<generation>/<step>": the votes it counts are about it
    looked_at: float | None = None  # its last look (time.monotonic())
    stood_until: float = 0.0  # after this process stood, nothing is judged before then (its views are stale)

    def stood(self, now: float, gap_s: float, fresh_s: float) -> float | None:
        """Called at each look. A look more than ``gap_s`` after the last one means this process
        stood (a C call holding the GIL, such as ``torch.save``'s ``close()`` on network storage;
        SIGSTOP; a descheduled host): its peers' heartbeats and samples are as old as the gap, and
        a peer idle in its op would look still. Its window starts afresh, and nothing is judged for
        ``fresh_s`` (its watchdog reads fresh heartbeats meanwhile).

        Returns:
            The gap when this process just stood, else None.
        """
        gap = None if self.looked_at is None else now - self.looked_at
        self.looked_at = now
        if gap is None or gap <= gap_s:
            return None
        self.peers.clear()
        self.beats.clear()
        self.own = None
        self.stood_until = now + fresh_s
        return gap
