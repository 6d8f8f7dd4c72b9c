"""The rules: one window of one rank against its peers' windows of the same span, a verdict per cause.
Pure: figures in, an assessment out."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from ncclguard.incidents.model import StragglerWindow, WindowEvidence
from ncclguard.watching.straggler.measure import MIN_OPS, from_arrivals

__all__ = ["MAX_SLOWDOWN", "Assessment", "assess"]

MAX_SLOWDOWN = 1000.0  # a finite stand-in for "its peers computed nothing" (the store refuses inf)


@dataclass(frozen=True)
class Assessment:
    """One window of one rank against its peers."""

    evidence: WindowEvidence
    score: float  # the fastest compute share among it and its peers over its own: 1.0 is the fastest
    compute_slow: bool
    link_slow: bool


def _share(w: StragglerWindow, what: str) -> float:
    return (w.compute_s if what == "compute" else w.wait_s) / w.length_s


def _work(w: StragglerWindow, runnable: bool) -> float:
    """The share of the window the rank computed with a CPU (``runnable``: less its run delay)."""
    delay = (w.run_delay_s or 0.0) if runnable else 0.0
    return max(0.0, w.compute_s - delay) / w.length_s


def assess(
    own: StragglerWindow,
    peers: Mapping[int, StragglerWindow],
    threshold: float,
    min_share: float,
    baseline_op_wait: float | None = None,
    *,
    link_threshold: float = 2.0,
    baseline_compute_per_op: float | None = None,
) -> Assessment | None:
    """Compares ``own`` with its peers' windows (see the module's docstring for the rules).

    Args:
        own: this rank's window.
        peers: its watched peers' fresh windows.
        threshold: the compute slowdown factor that counts (> 1).
        min_share: the least share of the window the slowdown must cost.
        baseline_op_wait: the transfer of the earlier windows (None: no link verdict yet).
        link_threshold: the transfer's slowdown factor that counts (> 1).
        baseline_compute_per_op: this rank's compute between two ops in the earlier windows: a link
            is slow only while that holds within ``threshold`` (a loaded machine slows both).

    Returns:
        The assessment, or None without peers to compare with (a window with fewer than
        :data:`MIN_OPS` completed collectives, its own or a peer's, is not compared). When ``own``
        has fewer but carries the backend's arrivals, it is compared with the peers that carry
        them too, on figures from :func:`from_arrivals` (evidence ``source="backend"``).
    """
    source = "records"
    if own.ops < MIN_OPS and own.arrivals:
        backend = from_arrivals(own, {r: w for r, w in peers.items() if w.ops < MIN_OPS and w.arrivals})
        if backend is not None:
            (own, peers), source = backend, "backend"
    peers = {r: w for r, w in peers.items() if w.ops >= MIN_OPS}
    if not peers or own.ops < MIN_OPS:
        return None  # no steps to compare: a hang or a pause (the hang detectors' business), or no collectives
    cf, wf = _share(own, "compute"), _share(own, "wait")
    ref_c, ref_w = (
        statistics.median(_share(w, "compute") for w in peers.values()),
        statistics.median(_share(w, "wait") for w in peers.values()),
    )
    # Compute is judged less the time the rank was runnable but got no CPU (its run delay): on a
    # loaded host the scheduler starves one rank, then another, by 20% of a window and more, which
    # is the host's doing, not more work (docs/stragglers.md). Only when every rank compared tells
    # its run delay; otherwise wall-clock compute for all.
    runnable = own.run_delay_s is not None and all(w.run_delay_s is not None for w in peers.values())
    mine, pw = _work(own, runnable), [_work(w, runnable) for w in peers.values()]
    ref = statistics.median(pw)
    slowdown = min(mine / ref, MAX_SLOWDOWN) if ref > 0 else (MAX_SLOWDOWN if mine > 0 else 1.0)
    score = min(1.0, min([*pw, mine]) / mine) if mine > 0 else 1.0
    # The physics check: its peers wait for it. Told run delays, a rank that waited for a CPU did not
    # work meanwhile either, so that time counts with its waits (1 - its work share).
    idle, ref_idle = (1.0 - mine, 1.0 - ref) if runnable else (wf, ref_w)
    compute_slow = slowdown >= threshold and mine - ref >= min_share and idle < ref_idle
    timed = [w.op_wait_s for w in (own, *peers.values()) if w.transfer_ops >= MIN_OPS]
    transfer = min(timed) if timed else 0.0
    per_op = own.compute_s / own.ops
    link_slow = (
        not compute_slow
        and own.transfer_ops >= MIN_OPS
        and baseline_op_wait is not None
        and baseline_op_wait > 0
        and transfer >= link_threshold * baseline_op_wait
        and baseline_compute_per_op is not None
        and per_op < threshold * baseline_compute_per_op
        and (transfer - baseline_op_wait) * own.transfer_ops / own.length_s >= min_share
    )
    evidence = WindowEvidence(
        n=own.n,
        end=own.end,
        compute_frac=round(cf, 4),
        wait_frac=round(wf, 4),
        peers_compute_frac=round(ref_c, 4),
        peers_wait_frac=round(ref_w, 4),
        slowdown=round(slowdown, 4),
        run_delay_frac=round((own.run_delay_s or 0.0) / own.length_s, 4) if runnable else None,
        work_frac=round(mine, 4) if runnable else None,
        peers_work_frac=round(ref, 4) if runnable else None,
        op_wait_s=round(transfer, 6),
        baseline_op_wait_s=None if baseline_op_wait is None else round(baseline_op_wait, 6),
        phase=own.phase,
        op=own.op,
        source=source,
        common_ops=own.ops + 1 if source == "backend" else None,
    )
    return Assessment(evidence, round(max(0.0, score), 4), compute_slow, link_slow)
