"""A rank's state for a real incident desk in one process, with no live rank behind it: used by
tests/incidents/test_merge_heads.py and tests/watching/test_near_filing.py."""

from __future__ import annotations

from ncclguard.incidents.model import OpRecord
from ncclguard.watching.sensors.rank_state import RankState


class QuietState(RankState):
    """A rank's state without a live process behind it: one frame in its main thread, no records,
    blocked in nothing."""

    def threads(self) -> dict[str, list[str]]:
        return {"MainThread (1)": ["/job/train.py:412 in train_step"]}

    def records(self) -> list[OpRecord]:
        return []

    def blocked_in(self) -> OpRecord | None:
        return None
