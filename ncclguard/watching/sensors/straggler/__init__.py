"""Straggler detection: which rank is slower than its peers, window after window, and where its time goes.

In a synchronous collective every rank leaves when the last one arrives, so the slow rank waits the
least and its peers wait for it. Each rank measures, per window of ``straggler_window_s``, its time
outside collectives (*compute*) and inside them (*wait*, from ncclguard's records of the main thread's
synchronous collectives), and publishes the figures in its heartbeat (:class:`StragglerWindow`). At each
window it compares its figures with its watched peers' (the heartbeats it reads anyway, so the store
traffic does not grow with the world):

- **compute**: its compute share is ``straggler_threshold`` times its peers' median or more, by at least
  ``straggler_min_share`` of the window, while it waits less than they do: it is the one they wait for.
  Where every rank compared tells its run delay (the time its main thread was runnable but got no CPU,
  :func:`run_delay`), compute is counted less that delay and the delay with the waits: on a loaded
  host the scheduler starves one rank, then another, which is the host's doing, not the rank's work;
- **link**: nobody computes more, but the transfer itself (the least median time of an op of at least
  :data:`LINK_MIN_NUMEL` elements among the rank and its peers: what even the last to arrive pays) is ``straggler_link_threshold`` times what it was in
  the earlier windows, costing ``straggler_min_share`` of the window or more, while the rank's compute
  between two ops holds within ``straggler_threshold`` of what it was (a loaded machine slows both).

Where a window's records hold too few ops but the world group's backend ran more (a loop that only
calls DDP: its bucket all_reduce is issued from C++), the window carries the backend's arrival times
instead, read once from torch's flight recorder, and the compute rule judges figures derived from them
(:func:`from_arrivals`; no link finding).

``straggler_windows`` such windows in a row raise one ``straggler`` incident (once per rank and cause in a
world). Everything here but :class:`StragglerWatch` is pure: it takes records and figures, no clock.
See ``docs/stragglers.md``.
"""

from ncclguard.watching.sensors.straggler.evidence import BASELINE_WINDOWS, StragglerTracker
from ncclguard.watching.sensors.straggler.rules import MAX_SLOWDOWN, Assessment, assess
from ncclguard.watching.sensors.straggler.watch import DELAY_SAMPLES, ArrivalSource, StragglerWatch, from_config
from ncclguard.watching.sensors.straggler.window_figures import (
    LINK_MIN_NUMEL,
    MIN_OPS,
    delay_at,
    fresh_windows,
    from_arrivals,
    measure,
    phase_name,
    run_delay,
)

__all__ = [
    "BASELINE_WINDOWS",
    "DELAY_SAMPLES",
    "LINK_MIN_NUMEL",
    "MAX_SLOWDOWN",
    "MIN_OPS",
    "ArrivalSource",
    "Assessment",
    "StragglerTracker",
    "StragglerWatch",
    "assess",
    "delay_at",
    "from_arrivals",
    "fresh_windows",
    "from_config",
    "measure",
    "phase_name",
    "run_delay",
]
