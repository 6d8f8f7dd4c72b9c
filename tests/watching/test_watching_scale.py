"""The watchdog's store protocol at scale (issue 12, point 6), at a size CI affords.

32 and 128 simulated ranks, each a real ``Watchdog`` loop with its own TCPStore client against one
real TCPStore, in worker processes (``benchmarks/watchdog_scale.py``, which also runs 1,024). A
desync (rank N // 3 stops one backend op short while the others wait) must be reported after the
hang timeout, naming that rank alone, within a generous hang guard; and the store requests per beat
must not grow with the number of ranks (each rank reads ``watch_peers`` peers, not all). Per beat
done, not per second: a CI run at 256 ranks beside the preemption launch beat a third as often as
due, and its requests per second fell with its beats (the protocol was right, the machine starved).
How soon the report comes (against ``hang_timeout_s + 2 * heartbeat_s``) is a latency, measured by
``benchmarks/watchdog_scale.py`` (its docstring has the command with this test's settings), not
asserted here: on a loaded 2-core CI machine the 256-rank report once came at 8.37 s against 8.0 s.
With ``watch_peers`` = 16, reading every peer instead would read 127 peers a beat at 128 ranks and
31 at 32: about 4x the requests per beat. The benchmark also runs 256 and 1,024.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import load_benchmark

pytestmark = pytest.mark.multirank  # worker processes, tens of seconds

HEARTBEAT_S = 2.0
HANG_S = 4.0
# Hang guard on the report, not a latency: a CI run beside the straggler launches wrote the 256-rank
# report (right, naming the culprit alone) after 31.9 s, its 320 simulated ranks starved of CPU (the
# bound of the benchmark, hang_timeout_s + 2 * heartbeat_s, is 8 s); must stay under HANG_S +
# max_report_wait.
REPORT_GUARD_S = 60.0
# The requests per beat at 128 ranks over those at 32: equal by the protocol (watch_peers = 16 peers
# read per beat, the incident counter read every half beat; per second, 1.00 at 256 and 0.92 at 1,024
# ranks against 64, benchmarks/results/watchdog_scale.json, before the counter was read less often). Reading every peer would make it about 4x; 2x leaves a
# loaded machine room while still telling flat from growing.
RATE_FACTOR = 2.0
SIZES = (32, 128)


def _scale_module():
    return load_benchmark("watchdog_scale")


@pytest.fixture(scope="module")
def runs():
    scale = _scale_module()
    args = argparse.Namespace(
        procs=2,
        heartbeat=HEARTBEAT_S,
        hang=HANG_S,
        store_timeout=2.0,
        step=1.0,
        warm=2 * HEARTBEAT_S,
        window=4 * HEARTBEAT_S,
        connect_timeout=120.0,
        max_report_wait=70.0,  # the search for the report gives up at HANG_S + this, past REPORT_GUARD_S
        max_wait=120.0,
    )
    # Both sizes at once, each with its own server and worker processes: most of a run is waiting
    # (for imports, the steady window, the hang timeout), so together they take the time of one.
    # 160 ranks beating every 2 s are fewer beats per second than the 1,024 ranks at 5 s that
    # benchmarks/watchdog_scale.py runs on this machine, and both sizes see the same load.
    with ThreadPoolExecutor(2) as pool:
        futures = {n: pool.submit(scale.run_size, n, args) for n in SIZES}
        return {n: f.result() for n, f in futures.items()}


@pytest.mark.parametrize("n", SIZES)
def test_a_desync_among_simulated_ranks_is_reported_in_time_naming_the_culprit(runs, n):
    run = runs[n]
    report = run["report"]
    assert report["found"], run
    assert report["kind"] == "desync"
    assert report["culprits"] == [n // 3] and report["victims"] == n - 1, report
    # Order, not latency: raised once the hang timeout had passed, then written; the guard only
    # catches a report that never comes (the latency is benchmarks/watchdog_scale.py's).
    assert HANG_S <= report["raised_after_s"] <= report["on_disk_after_s"] <= REPORT_GUARD_S, report
    assert run["ranks_that_handled_an_incident"] == n
    assert not [line for line in run["odd_log_lines"] if "tick failed" in line], run["odd_log_lines"]


def test_store_requests_per_beat_stay_flat_from_32_to_128_ranks(runs):
    small, large = (runs[n]["requests_per_beat_done"] for n in SIZES)
    assert small and large and 1 / RATE_FACTOR <= large / small <= RATE_FACTOR, (small, large)
    # Beats were made in the window (one a rank at least on average) and every rank had beaten by its
    # end: the figure is the protocol's, not stopped ranks'. No punctuality asked (a starved machine
    # beats late, and that is not the protocol's).
    for n in SIZES:
        assert runs[n]["beats_in_window_total"] >= n, (n, runs[n]["beats_in_window_total"])
        assert runs[n]["beats_at_window_end"]["min"] >= 1, (n, runs[n]["beats_at_window_end"])
