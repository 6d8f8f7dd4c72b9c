"""Timeouts learned from the job: how long a step may take before a waiting rank looks for a stuck peer.

A fixed bound (300 s) is the same for a 0.1 s step and a 20 s one. Here the bound comes from what
the job has shown: after a warm-up of :data:`WARMUP` intervals, it is the longest interval seen
times :data:`SAFETY` (NVRx's ``safety_factor``, 5.0 by default), held within ``[floor, cap]``. A
value outside that range is clamped, and the clamp is said in the change's text. Intervals are
kept per kind (``"step"``: from one step's start to the next; phases such as ``"eval"`` where a
caller measures them), and the bound of a kind never shrinks (a longest interval only grows).

Before the warm-up ends the default holds (:attr:`Learner.bound` returns it). What was learned is
a small JSON model (:class:`LearnedState`), carried across a rebuild (the engine keeps its
learner) and a restart (:mod:`ncclguard.store.learned` and a file in the incident directory); a
value that does not parse is ignored with a warning. Pure logic: no clock, no process, no store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ncclguard._log import log

__all__ = ["FLOOR_S", "SAFETY", "WARMUP", "Change", "LearnedState", "Learner", "parse_state"]

WARMUP = 10  # intervals of a kind before its bound is learned (NVRx waits for a few iterations too)
SAFETY = 5.0  # NVRx's safety_factor: the longest interval seen times this
FLOOR_S = 10.0  # never below: a scheduler's hiccup or a garbage collection must not look like a hang
MAX_STATE_BYTES = 16 * 1024


class LearnedState(BaseModel):
    """What was learned, as persisted: per kind, the intervals counted and the longest seen."""

    model_config = ConfigDict(extra="forbid")

    counts: dict[str, int] = Field(default_factory=dict, max_length=64)
    longest_s: dict[str, float] = Field(default_factory=dict, max_length=64)


@dataclass(frozen=True)
class Change:
    """A bound that changed: its kind, the old and the new value, and why (for the log line)."""

    kind: str
    old_s: float
    new_s: float
    why: str


def parse_state(raw: bytes | str | None, where: str) -> LearnedState | None:
    """A persisted :class:`LearnedState`, or None (with a warning) when it does not parse.

    Args:
        raw: the persisted JSON; None: nothing was persisted.
        where: where it came from, for the warning.
    """
    if raw is None:
        return None
    if len(raw) > MAX_STATE_BYTES:
        log.warning("learned timeouts: the value in %s is over %d bytes; ignored", where, MAX_STATE_BYTES)
        return None
    try:
        state = LearnedState.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("learned timeouts: the value in %s does not parse; ignored (%s)", where, exc.errors()[:1])
        return None
    if any(c < 0 for c in state.counts.values()) or any(
        not (math.isfinite(v) and v >= 0) for v in state.longest_s.values()
    ):
        log.warning("learned timeouts: the value in %s has a negative or non-finite number; ignored", where)
        return None
    return state


class Learner:
    """Learns a bound per kind of interval (see the module doc).

    Args:
        default_s: the bound before the warm-up ends.
        floor_s: the least learned bound.
        cap_s: the largest learned bound (the hard cap the user sees and sets).
        safety: the factor over the longest interval seen.
        warmup: intervals of a kind before its bound is learned.

    Raises:
        ValueError: a bound that is not positive and finite, ``floor_s > cap_s``, a factor below 1.
    """

    def __init__(
        self,
        default_s: float,
        floor_s: float = FLOOR_S,
        cap_s: float = 300.0,
        safety: float = SAFETY,
        warmup: int = WARMUP,
    ) -> None:
        for name, v in (("default_s", default_s), ("floor_s", floor_s), ("cap_s", cap_s)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {v!r}")
        if floor_s > cap_s:
            raise ValueError(f"floor_s ({floor_s}) must be <= cap_s ({cap_s})")
        if not (math.isfinite(safety) and safety >= 1.0):
            raise ValueError(f"safety must be a finite factor >= 1, got {safety!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
        self.default_s, self.floor_s, self.cap_s = default_s, floor_s, cap_s
        self.safety, self.warmup = safety, warmup
        self.state = LearnedState()

    def learned(self, kind: str) -> bool:
        """True once ``kind`` has had its warm-up."""
        return self.state.counts.get(kind, 0) >= self.warmup

    def bound(self, kind: str = "step") -> float:
        """The bound of ``kind`` now: the default before its warm-up ends, else the learned one."""
        if not self.learned(kind):
            return self.default_s
        return self._clamped(self.state.longest_s.get(kind, 0.0) * self.safety)[0]

    def explain(self, kind: str = "step") -> tuple[float, str]:
        """The bound of ``kind`` now and why, in words (the default, a clamp, or the factor)."""
        if not self.learned(kind):
            return self.default_s, f"the default until {self.warmup} intervals"
        return self._clamped(self.state.longest_s.get(kind, 0.0) * self.safety)

    def _clamped(self, raw: float) -> tuple[float, str]:
        if raw < self.floor_s:
            return self.floor_s, f"clamped up to the floor {self.floor_s:g} s from {raw:.3g} s"
        if raw > self.cap_s:
            return self.cap_s, f"clamped down to the cap {self.cap_s:g} s from {raw:.3g} s"
        return raw, f"{self.safety:g} x the longest interval seen"

    def observe(self, kind: str, seconds: float) -> Change | None:
        """Takes in one interval of ``kind``.

        Args:
            kind: ``"step"`` or a phase's name.
            seconds: the interval; a negative or non-finite one is ignored.

        Returns:
            The change of the bound it caused, if any (log it), else None.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            return None
        before = self.bound(kind)
        st = self.state
        st.counts[kind] = st.counts.get(kind, 0) + 1
        st.longest_s[kind] = max(st.longest_s.get(kind, 0.0), seconds)
        after = self.bound(kind)
        if abs(after - before) <= 0.01 * before:  # a change under 1% is not worth a log line
            return None
        why = self._clamped(st.longest_s[kind] * self.safety)[1]
        return Change(kind, before, after, f"{why}, after {st.counts[kind]} intervals")

    def adopt(self, state: LearnedState | None) -> None:
        """Goes on from a persisted state (a restart): the larger of each count and each longest."""
        if state is None:
            return
        st = self.state
        for kind, n in state.counts.items():
            st.counts[kind] = max(st.counts.get(kind, 0), n)
        for kind, v in state.longest_s.items():
            st.longest_s[kind] = max(st.longest_s.get(kind, 0.0), v)
