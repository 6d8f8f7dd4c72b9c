"""The evidence: one rank's assessments window after window, and the incident a run of slow windows
makes (its report, its reason line). Pure: assessments in, a detection out.

A cause raises an incident once ``windows`` windows in a row show it, naming one culprit: for compute
and input the rank itself (the rank its peers wait for judges itself), for a link the host (or the
pair of hosts) every slow link touches, where the windows of the run agree on a slow link (a link
slow in one window and another link in the next is noise, not a culprit). Once raised, the same
culprit and cause raise again only after ``2 * windows`` windows without it: a straggler that recovers and
comes back is a new incident (its signature counts the episodes).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ncclguard._naming import rank_ranges
from ncclguard.incidents.model import IncidentKind, StragglerReport, StragglerWindow
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.straggler.links import Link, locate, named
from ncclguard.watching.sensors.straggler.rules import MAX_SLOWDOWN, Assessment, assess

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
    compute_run: list[Assessment] = field(default_factory=list)
    link_run: list[Assessment] = field(default_factory=list)
    transfers: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    per_op: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    link_rates: dict[Link, deque[float]] = field(default_factory=dict)  # each link's rate in healthy windows
    fired: dict[str, int] = field(default_factory=dict)  # incidents raised per cause and culprit
    quiet: dict[str, int] = field(default_factory=dict)  # windows since each raised one was last seen

    @property
    def baseline(self) -> float | None:
        """The median transfer of the earlier windows that were not slow; None before the first."""
        return statistics.median(self.transfers) if self.transfers else None

    def feed(self, own: StragglerWindow, peers: Mapping[int, StragglerWindow]) -> Detection | None:
        """Takes in this rank's new window and its peers' fresh ones.

        Returns:
            The straggler incident to raise: a cause that held ``windows`` windows in a row, unless
            the same cause and culprit was raised and has not been gone ``2 * windows`` windows since.
        """
        per_op = statistics.median(self.per_op) if self.per_op else None
        bases = {k: statistics.median(v) for k, v in self.link_rates.items() if v}
        found = assess(
            own,
            peers,
            self.threshold,
            self.min_share,
            self.baseline,
            link_threshold=self.link_threshold,
            baseline_compute_per_op=per_op,
            link_baselines=bases,
        )
        if found is None:
            return None
        self.assessed += 1
        self.score = found.score
        self.compute_run = [*self.compute_run, found][-self.windows :] if found.compute_slow else []
        slow = set(found.slow_links or ())
        if found.link_slow and self.link_run and self.link_run[-1].slow_links is not None and slow:
            if not slow & set(self.link_run[-1].slow_links):
                self.link_run = []  # another link than the window before: noise, not a culprit yet
        self.link_run = [*self.link_run, found][-self.windows :] if found.link_slow else []
        self._learn(found, own)
        hosts = self._hosts({**peers, self.rank: own})
        made = None
        if len(self.compute_run) >= self.windows:
            made = self._raise(self._compute(self.compute_run))
        if made is None and len(self.link_run) >= self.windows:
            link = self._link(self.link_run, hosts, sorted({self.rank, *peers}))
            made = self._raise(link) if link is not None else None
        self._quiet(found)
        return made

    def _learn(self, found: Assessment, own: StragglerWindow) -> None:
        """The baselines: the transfer and each link's rate, from windows that were not slow."""
        ev = found.evidence
        base = self.baseline
        # Halfway to the threshold is not healthy either: a link that slowed a little less than the
        # threshold would otherwise raise the baseline window after window (a drill run: from 10 ms to
        # 13 ms in five windows of a 1.2x slow link, which then read under 2x and went unreported).
        healthy = base is None or ev.op_wait_s < (1 + self.link_threshold) / 2 * base
        if not found.link_slow and not found.straggling and ev.op_wait_s > 0 and healthy:
            # A window whose transfer is already past the threshold stays out of the baseline even
            # when another rule kept it from counting (its compute moved under load): taken in, a
            # few such windows raised the baseline to the slow link's level and the link was never
            # reported (a fresh-clone run with the suite's other tests beside it).
            # Nor does a window in which some rank straggles: the transfer is then the op's time for
            # the straggler alone, which never waits for anyone (a drill run: once the straggler
            # recovered, the healthy transfer read 2x that baseline, a false slow link).
            self.transfers.append(ev.op_wait_s)
            self.per_op.append(own.compute_s / own.ops)
        if not found.link_slow and not found.straggling:
            for k, (moved, busy) in (found.rates or {}).items():
                self.link_rates.setdefault(k, deque(maxlen=BASELINE_WINDOWS)).append(moved / busy)

    @staticmethod
    def _hosts(windows: Mapping[int, StragglerWindow]) -> dict[str, set[int]]:
        """The ranks at each address, as their own links tell (a link's source is its sender's address)."""
        out: dict[str, set[int]] = {}
        for rank, w in windows.items():
            for local, *_ in w.links:
                out.setdefault(local, set()).add(rank)
        return out

    def _raise(self, det: Detection) -> Detection | None:
        key = det.signature
        if key in self.quiet:
            return None  # raised already, and not gone 2 * windows windows since: the same incident
        self.fired[key] = self.fired.get(key, 0) + 1
        self.quiet[key] = 0
        return Detection(
            det.kind,
            det.reason,
            f"{key}/{self.fired[key]}",
            ranks=det.ranks,
            straggler=det.straggler,
        )

    def _quiet(self, found: Assessment) -> None:
        """Counts, for each cause and culprit raised, the windows it has been gone; once ``2 * windows``
        in a row, it may be raised again (a new episode: a load burst hides a straggler for a window or
        two now and then, which is not a recovery)."""
        for key in list(self.quiet):
            # A slow window of a kind keeps every incident of that kind raised (the cause of one window
            # may differ from its run's: an input straggler's window can read as compute now and then).
            link = key.startswith("straggler/link")
            if found.link_slow if link else found.compute_slow:
                self.quiet[key] = 0
                continue
            self.quiet[key] += 1
            if self.quiet[key] >= 2 * self.windows:
                del self.quiet[key]

    def _compute(self, run: list[Assessment]) -> Detection:
        evidence = [a.evidence for a in run]
        slowdown = round(statistics.median(e.slowdown for e in evidence), 3)
        # The cause of the run: where most of its extra time went, over its windows.
        extra = sum(a.excess for a in run)
        cause = (
            "input"
            if all(a.evidence.input_frac is not None for a in run)
            and extra > 0
            and (sum(a.input_excess for a in run) >= 0.5 * extra)
            else "compute"
        )
        last = evidence[-1]
        waits = f"; its peers wait for it in {last.op}" if last.op else ""
        if last.source == "backend":  # the figures are torch's arrival times, not ncclguard's records
            waits += ", timed by torch's flight recorder, which sees the collectives issued from C++"
        if cause == "input":
            share, peers = last.input_frac or 0.0, last.peers_input_frac or 0.0
            where = f"its input pipeline: {share:.0%} of the window waiting for batches, its peers {peers:.0%}{waits}"
        else:
            where = f"compute in phase {(last.phase or 'no phase')!r}{waits}"
        report = StragglerReport(
            rank=self.rank, cause=cause, slowdown=slowdown, where=where, windows=evidence, culprit=f"rank {self.rank}"
        )
        cpu = " (less the time each waited for a CPU)" if last.work_frac is not None else ""
        what = "an input straggler (its data loader)" if cause == "input" else "a compute straggler"
        reason = (
            f"rank {self.rank} is {what}: {slowdown:.2f}x its peers' time outside collectives{cpu} over "
            f"{len(run)} windows ({where})"
        )
        return Detection(
            IncidentKind.STRAGGLER, reason, f"straggler/{cause}/{self.rank}", ranks=(self.rank,), straggler=report
        )

    def _link(self, run: list[Assessment], hosts: Mapping[str, set[int]], ranks: list[int]) -> Detection | None:
        evidence = [a.evidence for a in run]
        pooled: dict[Link, tuple[float, float]] = {}
        for a in run:
            for k, (moved, busy) in (a.rates or {}).items():
                b, t = pooled.get(k, (0.0, 0.0))
                pooled[k] = (b + moved, t + busy)
        if pooled:  # the kernel's figures: which links, and who they name, over the run's windows
            bases = {k: statistics.median(v) for k, v in self.link_rates.items() if v}
            slow = locate(pooled, bases)
            who, addrs = named(slow)
            if not who:
                return None  # every link slowed alike (the host's load), or no culprit yet: wait
            speed = {k: b / t for k, (b, t) in pooled.items()}
            worst = max(slow, key=lambda k: slow[k])
            others = [v for k, v in speed.items() if k not in slow]
            ref = max([*others, bases.get(worst, 0.0)])
            slowdown = round(min(ref / speed[worst], MAX_SLOWDOWN), 3) if ref > 0 else round(slow[worst], 3)
            ranks = sorted({r for addr in addrs for r in hosts.get(addr, ())}) or ranks
            links = ", ".join(f"{a} -> {b} {speed[(a, b)] / 1e6:.1f} MB/s" for a, b in sorted(slow))
            where = f"the slow links {links}, against {ref / 1e6:.1f} MB/s (the other links, or theirs before)"
            if evidence[-1].baseline_op_wait_s:
                where += f"; the transfer itself {evidence[-1].op_wait_s * 1e3:.1f} ms an op, {evidence[-1].baseline_op_wait_s * 1e3:.1f} ms before"
            reason = f"a slow link: {who}, {slowdown:.2f}x slower over {len(run)} windows, with no rank computing more ({where})"
            signature = f"straggler/link/{who.replace(' ', '-')}"
        else:  # no TCP figures (another transport): the transfer against its past, the ranks it slows
            base = evidence[0].baseline_op_wait_s or 0.0
            slowdown = round(statistics.median(e.op_wait_s / base for e in evidence), 3) if base > 0 else MAX_SLOWDOWN
            op = evidence[-1].op or "its collectives"
            where = (
                f"the transfer itself in {op}: {evidence[-1].op_wait_s * 1e3:.1f} ms an op, {base * 1e3:.1f} ms before"
            )
            who = ""
            reason = (
                f"a slow link: the transfers of ranks {rank_ranges(ranks)} are {slowdown:.2f}x slower than before over "
                f"{len(run)} windows, with no rank computing more ({where})"
            )
            signature = "straggler/link"
        report = StragglerReport(
            rank=self.rank,
            cause="link",
            slowdown=slowdown,
            where=where[:1000],
            ranks=ranks[:1024],
            windows=evidence,
            culprit=who,
        )
        return Detection(IncidentKind.STRAGGLER, reason, signature, ranks=tuple(ranks), straggler=report)
