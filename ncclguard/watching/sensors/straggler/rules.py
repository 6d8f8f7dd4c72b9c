"""The rules: one window of one rank against its peers' windows of the same span, a finding per cause.
Pure: figures in, an assessment out.

- **compute / input**: the rank's work share (its time outside collectives, less its run delay where
  every rank compared tells it) is ``threshold`` times its peers' median or more, by at least
  ``min_share`` of the window, while it idles less than they do (they wait for it). Where every rank
  compared times its input pipeline (:mod:`.inputs`), the extra time is the input pipeline's when at
  least half of it was spent there (its share of the window above its peers' median), else the model's.
- **link**: from the kernel's figures of each TCP connection (:mod:`.links`), a link whose rate is
  ``link_threshold`` times below what the other links achieve, at a cost of ``min_share`` of the
  window or more (a slow link from the start is named too; the slow links name their common host).
  Where the ranks tell no TCP figures, the transfer itself against the earlier windows, as before:
  the least median time of an op of :data:`~.measure.LINK_MIN_NUMEL` elements or more among the rank
  and its peers, ``link_threshold`` times its baseline, costing ``min_share``, while the rank's compute
  between two ops holds within ``threshold`` (a loaded machine slows both).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ncclguard.incidents.model import StragglerWindow, WindowEvidence
from ncclguard.incidents.straggler_model import LinkSample
from ncclguard.watching.sensors.straggler.links import Link, link_rates, locate, one_pair, slow_links
from ncclguard.watching.sensors.straggler.window_figures import MIN_OPS, from_arrivals

__all__ = ["INPUT_SHARE", "MAX_SLOWDOWN", "Assessment", "assess"]

MAX_SLOWDOWN = 1000.0  # a finite stand-in for "its peers computed nothing" (the store refuses inf)
INPUT_SHARE = 0.5  # of a slow rank's extra time, the part in its input pipeline that makes the cause "input"


@dataclass(frozen=True)
class Assessment:
    """One window of one rank against its peers.

    Attributes:
        evidence: what the window showed (published in the incident).
        score: the fastest work share among it and its peers over its own: 1.0 is the fastest.
        compute_slow: this rank is the one its peers wait for (its cause: ``cause``).
        link_slow: a link is slow (``slow_links`` where the TCP figures tell which).
        cause: where a slow rank's extra time went: ``"input"`` or ``"compute"``.
        excess, input_excess: its work share and input share above its peers' medians.
        slow_links: the slow links, each with the rate (bytes a second) it was judged against.
        rates: every link compared, ``(bytes, busy seconds)``.
        straggling: some rank compared works ``threshold`` times its peers' median or more: the
            transfer then is the last arriver's alone, lower than a healthy window's (no baseline).
    """

    evidence: WindowEvidence
    score: float
    compute_slow: bool
    link_slow: bool
    cause: Literal["compute", "input"] = "compute"
    excess: float = 0.0
    input_excess: float = 0.0
    slow_links: Mapping[Link, float] | None = None
    rates: Mapping[Link, tuple[float, float]] | None = None
    straggling: bool = False


def _share(w: StragglerWindow, what: str) -> float:
    return (w.compute_s if what == "compute" else w.wait_s) / w.length_s


def _work(w: StragglerWindow, runnable: bool) -> float:
    """The share of the window the rank computed with a CPU (``runnable``: less its run delay)."""
    delay = (w.run_delay_s or 0.0) if runnable else 0.0
    return max(0.0, w.compute_s - delay) / w.length_s


def _input(w: StragglerWindow) -> float:
    return min(w.input_s or 0.0, w.length_s) / w.length_s


def assess(
    own: StragglerWindow,
    peers: Mapping[int, StragglerWindow],
    threshold: float,
    min_share: float,
    baseline_op_wait: float | None = None,
    *,
    link_threshold: float = 2.0,
    baseline_compute_per_op: float | None = None,
    link_baselines: Mapping[Link, float] | None = None,
) -> Assessment | None:
    """Compares ``own`` with its peers' windows (see the module's docstring for the rules).

    Args:
        own: this rank's window.
        peers: its watched peers' fresh windows.
        threshold: the compute slowdown factor that counts (> 1).
        min_share: the least share of the window the slowdown must cost.
        baseline_op_wait: the transfer of the earlier windows (None: no transfer finding yet).
        link_threshold: the transfer's or a link's slowdown factor that counts (> 1).
        baseline_compute_per_op: this rank's compute between two ops in the earlier windows: without
            another link to compare with, a link is slow only while that holds within ``threshold``
            (a loaded machine slows both).
        link_baselines: each link's rate in the earlier windows (bytes a second).

    Returns:
        The assessment, or None without peers to compare with (a window with fewer than
        :data:`MIN_OPS` completed collectives, its own or a peer's, is not compared). When ``own``
        has fewer but carries the backend's arrivals, it is compared with the peers that carry
        them too, on figures from :func:`from_arrivals` (evidence ``source="backend"``).
    """
    told = [own.links, *(w.links for w in peers.values())]  # every peer that tells links, whatever its ops
    compared = _comparable(own, peers)
    if compared is None:
        return None  # no steps to compare: a hang or a pause (the hang detectors' business), or no collectives
    own, peers, source = compared
    work = _judge_work(own, peers, threshold, min_share)
    link = _judge_links(
        own,
        peers,
        told,
        work,
        threshold,
        min_share,
        link_threshold,
        baseline_op_wait,
        baseline_compute_per_op,
        link_baselines,
    )
    return Assessment(
        _evidence(own, peers, source, work, link, baseline_op_wait),
        round(max(0.0, work.score), 4),
        work.compute_slow,
        link.slow,
        work.cause,
        work.excess,
        work.input_excess,
        (link.slow_links or None) if link.slow else None,
        link.rates or None,
        work.straggling,
    )


def _comparable(
    own: StragglerWindow, peers: Mapping[int, StragglerWindow]
) -> tuple[StragglerWindow, dict[int, StragglerWindow], Literal["records", "backend"]] | None:
    """The windows to compare (the backend's figures where the records are too few), or None."""
    source: Literal["records", "backend"] = "records"
    if own.ops < MIN_OPS and own.arrivals:
        backend = from_arrivals(own, {r: w for r, w in peers.items() if w.ops < MIN_OPS and w.arrivals})
        if backend is not None:
            (own, peers), source = backend, "backend"
    kept = {r: w for r, w in peers.items() if w.ops >= MIN_OPS}
    if not kept or own.ops < MIN_OPS:
        return None
    return own, kept, source


@dataclass(frozen=True)
class _Work:
    """The compute (and input) finding of one window: the shares compared and what they say."""

    runnable: bool  # every rank compared tells its run delay: work is compute less that delay
    mine: float
    ref: float
    straggling: bool
    slowdown: float
    score: float
    compute_slow: bool
    timed_input: bool
    in_own: float
    in_ref: float
    cause: Literal["compute", "input"]
    excess: float
    input_excess: float


def _judge_work(
    own: StragglerWindow, peers: Mapping[int, StragglerWindow], threshold: float, min_share: float
) -> _Work:
    """Whether this rank is the one its peers wait for, and whether its input pipeline is why."""
    # Compute is judged less the time the rank was runnable but got no CPU (its run delay): on a
    # loaded host the scheduler starves one rank, then another, by 20% of a window and more, which
    # is the host's doing, not more work (docs/stragglers.md). Only when every rank compared tells
    # its run delay; otherwise wall-clock compute for all.
    runnable = own.run_delay_s is not None and all(w.run_delay_s is not None for w in peers.values())
    mine, pw = _work(own, runnable), [_work(w, runnable) for w in peers.values()]
    ref = statistics.median(pw)
    everyone = [mine, *pw]
    others = [statistics.median(everyone[:i] + everyone[i + 1 :]) for i in range(len(everyone))]
    straggling = any(x >= threshold * o and x - o >= min_share for x, o in zip(everyone, others, strict=True))
    slowdown = min(mine / ref, MAX_SLOWDOWN) if ref > 0 else (MAX_SLOWDOWN if mine > 0 else 1.0)
    score = min(1.0, min([*pw, mine]) / mine) if mine > 0 else 1.0
    # The physics check: its peers wait for it. Told run delays, a rank that waited for a CPU did not
    # work meanwhile either, so that time counts with its waits (1 - its work share).
    wf, ref_w = _share(own, "wait"), statistics.median(_share(w, "wait") for w in peers.values())
    idle, ref_idle = (1.0 - mine, 1.0 - ref) if runnable else (wf, ref_w)
    compute_slow = slowdown >= threshold and mine - ref >= min_share and idle < ref_idle
    timed_input = own.input_s is not None and all(w.input_s is not None for w in peers.values())
    in_own, in_ref = (_input(own), statistics.median(_input(w) for w in peers.values())) if timed_input else (0, 0)
    excess, input_excess = mine - ref, in_own - in_ref
    cause: Literal["compute", "input"] = (
        "input" if timed_input and excess > 0 and input_excess >= INPUT_SHARE * excess else "compute"
    )
    return _Work(
        runnable,
        mine,
        ref,
        straggling,
        slowdown,
        score,
        compute_slow,
        timed_input,
        in_own,
        in_ref,
        cause,
        excess,
        input_excess,
    )


@dataclass(frozen=True)
class _Links:
    """The transfer's finding of one window: the transfer time, the links' rates, the slow ones."""

    transfer: float
    rates: dict[Link, tuple[float, float]]
    slow_links: dict[Link, float]
    slow: bool


def _judge_links(
    own: StragglerWindow,
    peers: Mapping[int, StragglerWindow],
    told: Sequence[Sequence[LinkSample]],  # each rank's links as its window tells them
    work: _Work,
    threshold: float,
    min_share: float,
    link_threshold: float,
    baseline_op_wait: float | None,
    baseline_compute_per_op: float | None,
    link_baselines: Mapping[Link, float] | None,
) -> _Links:
    """Whether a link is slow: the kernel's figures of each link, else the transfer against its past."""
    timed = [w.op_wait_s for w in (own, *peers.values()) if w.transfer_ops >= MIN_OPS]
    transfer = min(timed) if timed else 0.0
    rates = link_rates(told)
    per_op = own.compute_s / own.ops
    # The transfer itself against its past (the op's time for the last rank to reach it), while this
    # rank's compute between two ops holds: a loaded machine slows both, a slow link the transfer only.
    # Where the kernel tells links between more than two hosts, the links must also name a culprit
    # (a load that slows everything slows every link alike: evidence.py): compute may then move up to
    # the link threshold itself (on the loaded drill host it moved 15-40% in slow-link windows).
    held = threshold if one_pair(rates) else link_threshold
    slower = (
        own.transfer_ops >= MIN_OPS
        and baseline_op_wait is not None
        and baseline_op_wait > 0
        and transfer >= link_threshold * baseline_op_wait
        and baseline_compute_per_op is not None
        and per_op < held * baseline_compute_per_op
        and (transfer - baseline_op_wait) * own.transfer_ops / own.length_s >= min_share
    )
    # A link slow from the start, against what the other links carry (the kernel's TCP figures).
    ops = own.transfer_ops if own.transfer_ops >= MIN_OPS else 0
    slow = slow_links(rates, link_threshold, min_share, own.length_s, transfer, ops)
    if slower and not slow and rates:
        slow = locate(rates, link_baselines)  # which links the slower transfer is theirs
    # A window in which some rank straggles says nothing of the links: the transfer is then the
    # straggler's alone, and its late reads and CPU-starved host blur its peers' connections (a drill
    # run: a data loader 10% slower read as the link into its host, 2.7x slower).
    return _Links(transfer, rates, slow, not work.straggling and (slower or bool(slow)))


def _evidence(
    own: StragglerWindow,
    peers: Mapping[int, StragglerWindow],
    source: Literal["records", "backend"],
    work: _Work,
    link: _Links,
    baseline_op_wait: float | None,
) -> WindowEvidence:
    """What the window showed, rounded for the incident."""
    runnable = work.runnable
    return WindowEvidence(
        n=own.n,
        end=own.end,
        compute_frac=round(_share(own, "compute"), 4),
        wait_frac=round(_share(own, "wait"), 4),
        peers_compute_frac=round(statistics.median(_share(w, "compute") for w in peers.values()), 4),
        peers_wait_frac=round(statistics.median(_share(w, "wait") for w in peers.values()), 4),
        slowdown=round(work.slowdown, 4),
        run_delay_frac=round((own.run_delay_s or 0.0) / own.length_s, 4) if runnable else None,
        work_frac=round(work.mine, 4) if runnable else None,
        peers_work_frac=round(work.ref, 4) if runnable else None,
        op_wait_s=round(link.transfer, 6),
        baseline_op_wait_s=None if baseline_op_wait is None else round(baseline_op_wait, 6),
        phase=own.phase,
        op=own.op,
        source=source,
        common_ops=own.ops + 1 if source == "backend" else None,
        input_frac=round(work.in_own, 4) if work.timed_input else None,
        peers_input_frac=round(work.in_ref, 4) if work.timed_input else None,
        clock_offset_s=own.clock_offset_s,
        links=[(a, b, round(m), round(t, 4)) for (a, b), (m, t) in sorted(link.rates.items())][:64],
    )
