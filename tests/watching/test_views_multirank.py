"""The live views on real gloo ranks: `python -m ncclguard status --json` read from outside the job
while it trains and while it hangs, the metrics scraped over HTTP and written as textfiles, the
incident's timeline.png, and `report --trace/--plot` on that incident.

One launch (tests/workers/views_worker.py, torchrun, 2 ranks), driven through marker files; the
job runs on a thread while this test reads it.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.cli import main
from ncclguard.cli.status import EXIT_CODES
from ncclguard.incidents.pictures import PICTURE_FILE
from ncclguard.testing.launch import free_port

pytestmark = pytest.mark.multirank
PNG = b"\x89PNG\r\n\x1a\n"
# Hang guards: a loaded 2-core machine starts the two ranks in ~10-20 s and merges the hang ~2 s
# after hang_timeout_s (4 s); every wait below is over 3x that.
START_GUARD_S = 90.0
HANG_GUARD_S = 40.0


def status(addr: str, capsys) -> tuple[int, dict | None]:
    code = main(["status", "--store", addr, "--json", "--timeout", "10"])
    out = capsys.readouterr().out
    return code, json.loads(out) if code in (0, 3, 4) else None


def poll(check, bound_s: float, what: str):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {bound_s} s: {what}")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def serving(port: int) -> bool:
    """Both ranks' metrics servers take connections (``port`` and ``port + 1``)."""
    for p in (port, port + 1):
        try:
            socket.create_connection(("127.0.0.1", p), timeout=5).close()
        except OSError:
            return False
    return True


def sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_status_metrics_and_pictures_of_a_live_job(tmp_path, capsys):
    port = free_port(2)
    box: dict = {}

    def launch() -> None:
        try:
            box["job"] = run_ranks(
                "views_worker", 2, timeout_s=240, env={"VIEWS_DIR": str(tmp_path), "VIEWS_PORT": str(port)}
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    try:
        # The job's store address: torchrun's, written by rank 0 (the test knows no other way in).
        addr_file = tmp_path / "store.txt"
        addr = poll(lambda: addr_file.is_file() and addr_file.read_text().strip(), START_GUARD_S, "store address")

        # 1. Training: healthy, both ranks in phase train, beating, no incident.
        def healthy():
            code, out = status(addr, capsys)
            ok = out is not None and all(r["state"] == "ok" and r["last_seq"].get("0", 0) >= 6 for r in out["ranks"])
            return (code, out) if ok else None

        code, out = poll(healthy, START_GUARD_S, "both ranks beating in training")
        assert code == EXIT_CODES["healthy"] == 0
        assert (out["health"], out["reasons"], out["incident_count"], out["incidents"]) == ("healthy", [], 0, [])
        assert out["index"]["world_size"] == 2 and out["index"]["generation"] == 0
        assert out["index"]["heartbeat_s"] == 0.5 and out["index"]["hang_timeout_s"] == 4.0
        assert [r["rank"] for r in out["ranks"]] == [0, 1]
        assert {r["phase"] for r in out["ranks"]} == {"train"}
        assert all(r["age_s"] <= 1.5 for r in out["ranks"])  # "ok": within 3 beats of 0.5 s
        assert sum(g["count"] for g in out["groups"]) == 2
        assert out["requests"] <= 8

        # A rank serves its metrics from the end of its first heartbeat: status can read that beat a
        # moment before (seen once in a full run: connection refused). Polled, within the start guard.
        m0, m1 = poll(lambda: serving(port) and (scrape(port), scrape(port + 1)), START_GUARD_S, "metrics served")
        assert (sample(m0, "ncclguard_collectives_total", rank="0") or 0) >= 6
        assert (sample(m1, "ncclguard_collectives_total", rank="1") or 0) >= 6
        assert (sample(m0, "ncclguard_collective_wait_seconds_total", rank="0") or 0) > 0
        assert sample(m0, "ncclguard_peer_heartbeat_age_seconds", peer="1", rank="0") is not None
        assert sample(m1, "ncclguard_peer_heartbeat_age_seconds", peer="0", rank="1") is not None
        assert sample(m0, "ncclguard_peer_stale", peer="1", rank="0") == 0.0
        assert sample(m0, "ncclguard_world_generation", rank="0") == 0.0
        assert sample(m0, "ncclguard_rebuilds_total", rank="0") == 0.0
        assert "ncclguard_incidents_total{" not in m0
        for r in (0, 1):
            text = (tmp_path / f"metrics-{r}.prom").read_text()
            assert f'ncclguard_collectives_total{{rank="{r}"}}' in text
        assert sorted(p.name for p in tmp_path.glob("metrics-*")) == ["metrics-0.prom", "metrics-1.prom"]

        # 2. The hang: rank 1 in eval, rank 0 waiting in all_reduce; an open incident.
        (tmp_path / "go-hang").write_text("1")

        def incident():
            code, out = status(addr, capsys)
            return (code, out) if code == EXIT_CODES["incident"] and out["incidents"][0]["report"] else None

        code, out = poll(incident, HANG_GUARD_S, "the hang incident open and merged in status")
        assert code == 4 and out["health"] == "incident"
        (inc,) = out["incidents"]
        assert (inc["n"], inc["kind"], inc["open"], inc["problem"]) == (1, "hang", True, None)
        assert inc["report"].endswith(inc["id"])
        assert out["reasons"][0] == f"open incident(s): {inc['id']} (hang)"
        by_rank = {r["rank"]: r for r in out["ranks"]}
        assert by_rank[1]["phase"] == "eval" and by_rank[1]["inflight"] is None
        assert by_rank[0]["phase"] == "sync" and by_rank[0]["inflight"].startswith("all_reduce(SUM) #")
        assert len(out["groups"]) == 2

        got = poll(
            lambda: sample(scrape(port), "ncclguard_incidents_total", kind="hang", rank="0"),
            HANG_GUARD_S,
            "the hang counted in rank 0's metrics",
        )
        assert got == 1.0
        assert (sample(scrape(port), "ncclguard_inflight_ops", rank="0") or 0) >= 1
        (tmp_path / "go-end").write_text("1")
    finally:
        (tmp_path / "go-hang").write_text("1")
        (tmp_path / "go-end").write_text("1")
        thread.join(300)
    if "error" in box:
        raise box["error"]
    job = box["job"]
    assert job[0]["incidents"] == job[1]["incidents"]
    (incident_doc,) = job[0]["incidents"]
    assert incident_doc["kind"] == "hang"
    assert job[0]["picture"] is True and job[1]["picture"] is True
    where = Path(incident_doc["dir"])
    assert (where / PICTURE_FILE).read_bytes()[:8] == PNG

    # 3. report --trace / --plot on the incident the job wrote.
    trace, plot = tmp_path / "out" / "trace.json", tmp_path / "out" / "plot.png"
    assert main(["report", str(where), "--trace", str(trace), "--plot", str(plot)]) == 0
    capsys.readouterr()
    assert plot.read_bytes()[:8] == PNG
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(tracks) == [0, 1] and tracks[1].startswith("rank 1 (")
    spans = [e for e in events if e["ph"] == "X" and e["tid"] == 0]  # the collectives' thread
    for r in (0, 1):
        ts = [e["ts"] for e in spans if e["pid"] == r]
        assert len(ts) >= 6 and ts == sorted(ts)
        # and where the main thread was, and torch's own records of the ops
        assert [e for e in events if e["ph"] == "X" and e["pid"] == r and e["tid"] == 1]
        assert [e for e in events if e["ph"] in ("i", "X") and e["pid"] == r and e["tid"] == 2]
    open_on_0 = [e for e in spans if e["pid"] == 0 and e["args"]["open"]]
    assert [e["args"]["phase"] for e in open_on_0] == ["sync"]
    assert [e["name"] for e in events if e["ph"] == "i" and e["s"] == "g"][0].startswith(
        f"incident {incident_doc['id']} (hang)"
    )
