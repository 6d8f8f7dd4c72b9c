"""The watchdog's hang bound, learned from the job per phase: how long an op may stay open before it is a hang.

A fixed ``hang_timeout_s`` (300 s) is the same for a 0.1 s step and a 20 s one. Unless the user set it
(``WatchdogConfig(hang_timeout_s=...)``, ``NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S``,
``--ncclguard-hang-timeout-s``: then that value holds, always), or the ladder acts (a rung past
``report``: raise, abort, fence, exit, your own; they act on a hang without progress evidence, so a
busy rank must not meet them early: ``hang_timeout_s`` holds), the bound is learned from what the
job shows, with :class:`~ncclguard.watching.base.learner.Learner` (the one the engine's judge bound uses):

- **What is measured**: the intervals between moves of this rank's backend sequence numbers (every
  collective its backend ran, whoever issued it), at the watchdog's tick. An op in flight, and a peer
  whose numbers stand still, are both inside such an interval when the job is healthy.
- **Per phase**: each interval counts for a *kind*, the phase this rank and the peers it watches
  were in (``phase("eval")``, the adapters' ``train``/``eval``/``save``; :func:`phase_kind`). An
  interval during which any of them was in a phase other than ``train`` (or none) counts for that
  phase: a long evaluation or a save on one rank teaches the ``eval`` or ``save`` bound, never the
  ``train`` one. The bound in force is the largest of the kinds this rank and its watched peers are
  in now, so a rank waiting in a train step while a peer evaluates gets the ``eval`` bound.
- **Warm-up, factor, floor, cap**: a kind's bound is the configured ``hang_timeout_s`` (300 s by
  default) until :data:`~ncclguard.watching.base.learner.WARMUP` intervals of it were seen, then 5 x
  the longest, held within ``[max(10 s, 2 heartbeats), hang_timeout_s]``: learning only ever
  shortens the bound, and a clamp is logged. An interval in which an incident opened, or that
  spans a world change, is not counted (a hang is no measure of the job).
- **Kept**: the watchdog keeps its learner across a rebuild; each rank writes what it learned under
  ``ncclguard/learned/hang/<launch rank>`` (:mod:`ncclguard.store.learned`), and a restarted
  process reads its predecessor's at start; a value that does not parse is ignored with a warning.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.store.learned import hang_key
from ncclguard.watching.base.learner import FLOOR_S, Change, Learner, parse_state
from ncclguard.watching.base.watchdog_store import WatchdogStore

__all__ = ["HANG_VAR", "STEP_KINDS", "UNPHASED", "HangBound", "phase_kind"]

HANG_VAR = "NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S"
UNPHASED = "unphased"  # the kind of an interval outside any phase
STEP_KINDS = ("train", UNPHASED)  # the kinds of the steps themselves: any other phase explains a long interval
MAX_KIND_CHARS = 40
MAX_KINDS = 32  # phases beyond these many names all count as "other" (the persisted state stays small)


def phase_kind(path: str) -> str:
    """The kind of a phase path: the name of its innermost phase (``"train step=3 > eval batch=2"``
    is ``"eval"``), or :data:`UNPHASED` outside any phase."""
    names = [part.split()[0] for part in path.split(" > ") if part.strip()]
    return names[-1][:MAX_KIND_CHARS] if names else UNPHASED


def given(config_fields: Iterable[str]) -> bool:
    """Whether the user set ``hang_timeout_s``: as a field (``config.model_fields_set``), or in the
    environment (what ``--ncclguard-hang-timeout-s`` sets), which pydantic-settings does not mark."""
    return "hang_timeout_s" in set(config_fields) or bool(os.environ.get(HANG_VAR, "").strip())


class HangBound:
    """The hang bound in force, learned per phase (see the module doc).

    Args:
        hang_timeout_s: the configured value: the bound before a kind's warm-up, and the cap.
        heartbeat_s: the heartbeat; the floor is at least two of them.
        fixed: the user set ``hang_timeout_s``: it holds, nothing is learned.
        name: how log lines name the rank.
    """

    def __init__(self, hang_timeout_s: float, heartbeat_s: float, fixed: bool, name: str = "watchdog") -> None:
        self.fixed, self.name = fixed, name
        self.configured_s = hang_timeout_s
        floor = min(max(FLOOR_S, 2.0 * heartbeat_s), hang_timeout_s)
        self.learner = Learner(hang_timeout_s, floor_s=floor, cap_s=hang_timeout_s)
        self.dirty = False  # learned something not yet in the store
        self._total: int | None = None  # the sum of this rank's backend numbers at the last look
        self._start: float | None = None  # when they last moved (None before the first move)
        self._ticks: Counter[str] = Counter()  # ticks of each kind seen since
        self._cases = 0  # incidents handled when the interval began

    def bound(self, kinds: Iterable[str]) -> float:
        """The bound for an op while this rank and its watched peers are in ``kinds``."""
        if self.fixed:
            return self.configured_s
        return max((self.learner.bound(self._known(k)) for k in kinds), default=self.configured_s)

    def new_world(self) -> None:
        """A rebuild: the numbers start again; what was learned is kept."""
        self._total, self._start = None, None

    def tick(self, now: float, total: int | None, kinds: Iterable[str], cases: int) -> Change | None:
        """One watchdog tick.

        Args:
            now: ``time.monotonic()``.
            total: the sum of this rank's backend sequence numbers, None where unknown.
            kinds: this rank's phase kind and its watched peers' now.
            cases: incidents this watchdog handled so far.

        Returns:
            The change of a bound this tick caused (it is logged here), or None.
        """
        if self.fixed or total is None:
            return None
        if self._total is None or total < self._total:  # the first look, or numbers that started again
            self._total, self._start, self._cases, self._ticks = total, None, cases, Counter()
            return None
        for k in set(kinds):
            self._ticks[self._known(k)] += 1
        if total == self._total:
            return None
        start, kind, clean = self._start, self._kind(), cases == self._cases
        self._total, self._start, self._cases, self._ticks = total, now, cases, Counter()
        if start is None or not clean:
            return None  # the first move (the interval held the start-up), or a hang in it
        change = self.learner.observe(kind, now - start)
        if change is not None:
            self.dirty = True
            log.warning(
                "%s: learned hang bound for %s %.3g s -> %.3g s (%s)",
                self.name,
                _said(change.kind),
                change.old_s,
                change.new_s,
                change.why,
            )
        return change

    def _kind(self) -> str:
        """The kind an interval counts for: the phase other than a step's that was seen the most,
        else the step kind seen the most."""
        ranked = self._ticks.most_common()
        other = [k for k, _ in ranked if k not in STEP_KINDS]
        return other[0] if other else (ranked[0][0] if ranked else UNPHASED)

    def _known(self, kind: str) -> str:
        counts = self.learner.state.counts
        return kind if kind in counts or len(counts) < MAX_KINDS else "other"

    def save(self, store: WatchdogStore, origin: int) -> None:
        """Writes what was learned under this rank's key, if anything new (a failure waits for the next beat)."""
        if not self.dirty or self.fixed:
            return
        try:
            store.put_learned(hang_key(origin), self.learner.state.model_dump_json())
            self.dirty = False
        except (StoreTimeout, StoreUnreachable) as exc:
            log.info("%s: the learned hang bounds are not in the store yet (%s)", self.name, exc)

    def load(self, store: WatchdogStore, origin: int) -> None:
        """Goes on from what this launch rank's earlier process learned (a restart), if anything."""
        if self.fixed:
            return
        key = hang_key(origin)
        try:
            raw = store.read_learned(key)
        except (StoreTimeout, StoreUnreachable) as exc:
            log.info("%s: no learned hang bound read from the store (%s)", self.name, exc)
            return
        state = parse_state(raw, f"the job's store ({key})")
        if state is None:
            return
        self.learner.adopt(state)
        said = ", ".join(
            f"{_said(k)} {self.learner.explain(k)[0]:.3g} s ({self.learner.explain(k)[1]})"
            for k in sorted(state.counts)
            if self.learner.learned(k)
        )
        log.warning("%s: learned hang bounds from the store: %s", self.name, said or "none past the warm-up yet")


def _said(kind: str) -> str:
    return "outside any phase" if kind == UNPHASED else f"phase {kind!r}"
