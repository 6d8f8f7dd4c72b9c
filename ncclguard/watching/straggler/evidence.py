"""The evidence: one rank's assessments window after window, and the incident a run of slow windows
makes (its report, its reason line). Pure: assessments in, a detection out."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ncclguard._naming import rank_ranges
from ncclguard.incidents.model import IncidentKind, StragglerReport, StragglerWindow, WindowEvidence
from ncclguard.watching.detect import Detection
from ncclguard.watching.straggler.rules import MAX_SLOWDOWN, assess

__all__ = ["BASELINE_WINDOWS", "StragglerTracker"]

BASELINE_WINDOWS = 8  # earlier windows whose median transfer is the link's baseline


@dataclass
class StragglerTracker:
    """One rank's assessments window after window, and the incidents they make.

    Args:
        rank: this rank.
        threshold, min_share, link_threshold: see :func:`assess`.
        windows: slow windows in a row that make an incident.
    """

    rank: int
    threshold: float
    min_share: float
    windows: int
    link_threshold: float = 2.0
    score: float | None = None
    assessed: int = 0  # windows assessed against peers
    compute_run: list[WindowEvidence] = field(default_factory=list)
    link_run: list[WindowEvidence] = field(default_factory=list)
    transfers: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    per_op: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    fired: set[str] = field(default_factory=set)

    @property
    def baseline(self) -> float | None:
        """The median transfer of the earlier windows that were not slow; None before the first."""
        return statistics.median(self.transfers) if self.transfers else None

    def feed(self, own: StragglerWindow, peers: Mapping[int, StragglerWindow]) -> Detection | None:
        """Takes in this rank's new window and its peers' fresh ones.

        Returns:
            The straggler incident to raise, the first time a cause holds ``windows`` windows in a row.
        """
        per_op = statistics.median(self.per_op) if self.per_op else None
        found = assess(
            own,
            peers,
            self.threshold,
            self.min_share,
            self.baseline,
            link_threshold=self.link_threshold,
            baseline_compute_per_op=per_op,
        )
        if found is None:
            return None
        self.assessed += 1
        self.score = found.score
        ev = found.evidence
        self.compute_run = [*self.compute_run, ev][-self.windows :] if found.compute_slow else []
        self.link_run = [*self.link_run, ev][-self.windows :] if found.link_slow else []
        base = self.baseline
        healthy = base is None or ev.op_wait_s < self.link_threshold * base
        if not found.link_slow and ev.op_wait_s > 0 and healthy:
            # A window whose transfer is already past the threshold stays out of the baseline even
            # when another rule kept it from counting (its compute moved under load): taken in, a
            # few such windows raised the baseline to the slow link's level and the link was never
            # reported (a fresh-clone run with the suite's other tests beside it).
            self.transfers.append(ev.op_wait_s)
            self.per_op.append(own.compute_s / own.ops)
        if len(self.compute_run) >= self.windows and "compute" not in self.fired:
            self.fired.add("compute")
            return self._compute(self.compute_run)
        if len(self.link_run) >= self.windows and "link" not in self.fired:
            self.fired.add("link")
            return self._link(self.link_run, sorted({self.rank, *peers}))
        return None

    def _compute(self, run: list[WindowEvidence]) -> Detection:
        slowdown = round(statistics.median(e.slowdown for e in run), 3)
        phase = run[-1].phase or "no phase"
        waits = f"; its peers wait for it in {run[-1].op}" if run[-1].op else ""
        if run[-1].source == "backend":  # the figures are torch's arrival times, not ncclguard's records
            waits += ", timed by torch's flight recorder, which sees the collectives issued from C++"
        where = f"compute in phase {phase!r}{waits}"
        report = StragglerReport(rank=self.rank, cause="compute", slowdown=slowdown, where=where, windows=run)
        cpu = " (less the time each waited for a CPU)" if run[-1].work_frac is not None else ""
        reason = (
            f"rank {self.rank} is a compute straggler: {slowdown:.2f}x its peers' compute time{cpu} over "
            f"{len(run)} windows ({where})"
        )
        return Detection(
            IncidentKind.STRAGGLER, reason, f"straggler/compute/{self.rank}", ranks=(self.rank,), straggler=report
        )

    def _link(self, run: list[WindowEvidence], ranks: list[int]) -> Detection:
        base = run[0].baseline_op_wait_s or 0.0
        slowdown = round(statistics.median(e.op_wait_s / base for e in run), 3) if base > 0 else MAX_SLOWDOWN
        op = run[-1].op or "its collectives"
        where = f"the transfer itself in {op}: {run[-1].op_wait_s * 1e3:.1f} ms an op, {base * 1e3:.1f} ms before"
        report = StragglerReport(
            rank=self.rank, cause="link", slowdown=slowdown, where=where, ranks=ranks[:1024], windows=run
        )
        reason = (
            f"a slow link: the transfers of ranks {rank_ranges(ranks)} are {slowdown:.2f}x slower than before over "
            f"{len(run)} windows, with no rank computing more ({where})"
        )
        return Detection(IncidentKind.STRAGGLER, reason, "straggler/link", ranks=tuple(ranks), straggler=report)
