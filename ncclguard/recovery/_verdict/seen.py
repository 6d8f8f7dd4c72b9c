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
    self_asked: float | None = None  # when this rank, judging itself stuck, asked its supervisor to end it
    self_awaiting: bool = False  # it judged itself stuck, and its peers did not (yet): no action
    generation: int = 0  # the world it was armed in: its ranks' numbers and progress are that world's
    release: Release | None = None  # its watch on the world's death notices (made at its first look)
    about: str | None = None  # the step it judges, "<generation>/<step>": the votes it counts are about it
