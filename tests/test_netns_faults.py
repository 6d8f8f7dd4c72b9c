"""Faults between hosts: two ranks in two network namespaces joined by a veth pair, the store in A.

F5: the link goes down in the middle of a chunked ``safe_all_reduce``. Every rank returns by its
deadline; the rank that holds the store names the rank it lost; the other learns that the store
(on the lost host) is unreachable; each watchdog writes an incident.
F6: the link is rate-limited (``tc ... tbf``; this kernel has no ``netem`` qdisc, so delay is not
injected) and a large chunked call completes exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from netns import WORKERS, _ip, run_two_ranks

pytestmark = pytest.mark.multirank


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20, check=check
    )


def _ranks(pair, scenario: str, out: Path, timeout_s: float) -> list:
    argv = [sys.executable, str(WORKERS / "netfault_worker.py"), scenario]
    return run_two_ranks(pair, argv, out, port=29501, timeout_s=timeout_s)


def _when_started(out: Path, then, bound_s: float = 60.0) -> threading.Thread:
    """Runs ``then()`` once both ranks have entered the large call."""

    def watch() -> None:
        end = time.monotonic() + bound_s
        while time.monotonic() < end:
            if all((out / f"started.rank{r}").exists() for r in (0, 1)):
                then()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def linkdown(pair):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-linkdown-"))
    # A rate limit makes the 48 MB call last several seconds, so the link can go down mid-call.
    _ip("link", "set", pair.if_a, "up", ns=pair.ns_a)
    _tc(
        pair.ns_a,
        "qdisc",
        "add",
        "dev",
        pair.if_a,
        "root",
        "tbf",
        "rate",
        "100mbit",
        "burst",
        "64kb",
        "latency",
        "50ms",
    )
    downed: dict[str, float] = {}

    def down() -> None:
        time.sleep(0.8)
        _ip("link", "set", pair.if_a, "down", ns=pair.ns_a)
        downed["at"] = time.time()

    watcher = _when_started(out, down)
    try:
        ranks = _ranks(pair, "linkdown", out, 40)
    finally:
        watcher.join(5)
        _tc(pair.ns_a, "qdisc", "del", "dev", pair.if_a, "root", check=False)
        _ip("link", "set", pair.if_a, "up", ns=pair.ns_a)
    for r in ranks:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "at" in downed, "the link was never taken down"
    res = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return res, out


def test_f5_every_rank_returns_by_its_deadline(linkdown):
    res, _ = linkdown
    for r in (0, 1):
        assert res[r]["warm_ok"] is True
        assert res[r]["ok"] is False
        assert res[r]["error_type"] == "CollectiveTimeout", res[r]["error"]
        # deadline 5 s; the post-mortem round is bounded by it too
        assert 4.5 <= res[r]["took_s"] <= 7.0, res[r]["took_s"]


def test_f5_the_link_went_down_in_the_middle(linkdown):
    res, _ = linkdown
    for r in (0, 1):
        i, n = res[r]["chunk"]
        assert n == 24 and 0 < i < n, res[r]["chunk"]


def test_f5_unreachable_ranks_are_named(linkdown):
    res, _ = linkdown
    assert res[0]["missing_ranks"] == [1], res[0]["error"]
    # Rank 1 cannot reach the store (it lives on rank 0's host): it cannot learn who arrived.
    assert res[1]["missing_ranks"] in (None, [0]), res[1]["error"]


def test_f5_the_watchdog_reports_on_each_side(linkdown):
    res, out = linkdown
    kinds = {r: [i["kind"] for i in res[r]["incidents"]] for r in (0, 1)}
    assert kinds[0], f"rank 0's watchdog reported nothing: {res[0]['incidents']}"
    assert kinds[1], f"rank 1's watchdog reported nothing: {res[1]['incidents']}"
    written = sorted(p.name for p in (out / "incidents").rglob("rank*.json"))
    assert written, "no incident dump was written"


@pytest.fixture(scope="module")
def slowlink(pair):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-slowlink-"))
    for ns, ifname in ((pair.ns_a, pair.if_a), (pair.ns_b, pair.if_b)):
        _tc(ns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", "200mbit", "burst", "64kb", "latency", "50ms")
    try:
        ranks = _ranks(pair, "slowlink", out, 90)
    finally:
        for ns, ifname in ((pair.ns_a, pair.if_a), (pair.ns_b, pair.if_b)):
            _tc(ns, "qdisc", "del", "dev", ifname, "root", check=False)
    for r in ranks:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_f6_a_large_chunked_call_completes_exactly_over_a_slow_link(slowlink):
    for r in (0, 1):
        assert slowlink[r]["ok"] is True and slowlink[r]["exact"] is True
        assert slowlink[r]["chunks"] == 12
        # 24 MB each way at 200 Mbit/s: the link, not the loopback, set the pace
        assert slowlink[r]["took_s"] >= 0.9, slowlink[r]["took_s"]
