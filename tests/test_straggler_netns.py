"""A slow link told apart from a compute straggler: two ranks in two network namespaces joined by a
veth pair (tests/netns.py), each step 50 ms outside collectives (a sleep: see the worker) and a 1 MB
``all_reduce`` between them. After
about 10 s (5 windows of 2 s) the test rate-limits both ends of the veth (``tc ... tbf``, 100 mbit/s):
the transfer itself slows while neither rank computes more, and the watchdog must raise one
``straggler`` incident of cause ``link`` naming both ranks, and no compute straggler.
Skipped, as the other netns tests, where network namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from netns import WORKERS, run_two_ranks
from test_netns_faults import _tc

pytestmark = pytest.mark.multirank

HEALTHY_S = 10.0  # before the link slows: 5 windows, the baseline
BOUND_S = 90.0  # the worker's loop ends here without an incident (the test then fails)
ELEMENTS = 250_000  # 1 MB of float32
# Hang guard on the launch: the incident comes about 3 windows (6 s) after the rate limit; start-up
# and the 10 s before it took under 25 s on the loaded 2-core machine.
LAUNCH_GUARD_S = 150.0


@pytest.fixture(scope="module")
def slowed(pair):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-straggler-link-"))
    applied: dict[str, float] = {}

    def slow_down() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end and not all((out / f"started.rank{r}").exists() for r in (0, 1)):
            time.sleep(0.05)
        time.sleep(HEALTHY_S)
        for ns, ifname in ((pair.ns_a, pair.if_a), (pair.ns_b, pair.if_b)):
            _tc(ns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", "100mbit", "burst", "64kb", "latency", "50ms")
        applied["at"] = time.time()

    thread = threading.Thread(target=slow_down, daemon=True)
    thread.start()
    argv = [sys.executable, str(WORKERS / "straggler_worker.py"), str(BOUND_S), "-1", "1", str(ELEMENTS), "sleep"]
    try:
        ranks = run_two_ranks(pair, argv, out, port=29503, timeout_s=LAUNCH_GUARD_S)
    finally:
        thread.join(5)
        for ns, ifname in ((pair.ns_a, pair.if_a), (pair.ns_b, pair.if_b)):
            _tc(ns, "qdisc", "del", "dev", ifname, "root", check=False)
    for r in ranks:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "at" in applied, "the link was never slowed"
    return out, applied["at"]


def test_a_slow_link_is_reported_as_a_link_naming_both_ranks(slowed) -> None:
    out, applied_at = slowed
    dirs = sorted(p for p in (out / "incidents").iterdir() if p.is_dir())
    assert len(dirs) == 1, [p.name for p in dirs]
    doc = json.loads((dirs[0] / "incident.json").read_text())["incident"]
    report = doc["straggler"]
    assert (doc["kind"], doc["signature"], report["cause"], report["ranks"]) == (
        "straggler",
        "straggler/link",
        "link",
        [0, 1],
    )
    assert doc["created"] > applied_at
    assert report["slowdown"] >= 2.0  # straggler_link_threshold
    assert report["where"].startswith("the transfer itself in all_reduce(MAX)")
    for w in report["windows"]:
        assert w["op_wait_s"] >= 2.0 * w["baseline_op_wait_s"] and w["slowdown"] < 1.15  # no rank computes more
