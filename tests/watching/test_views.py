"""`python -m ncclguard status` against a real TCPStore made here (1,024 simulated ranks, garbage
values, a store nobody answers), the trace and the plot of an incident, and the metrics' names.

The live views (status during a run, metrics scraped over HTTP) are in
tests/watching/test_views_multirank.py.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.cli import main
from ncclguard.cli.status import _WIDE_COLUMNS, EXIT_CODES, show
from ncclguard.cli.status_read import (
    CHUNK,
    FIRST_READ,
    READ_BYTES,
    IncidentRow,
    JobStatus,
    RankGroup,
    StatusReader,
    read_index,
    read_status,
)
from ncclguard.incidents.files import load
from ncclguard.incidents.model import Heartbeat, IncidentDoc, IncidentKind, OpRecord
from ncclguard.incidents.numerics_model import NonFiniteReport
from ncclguard.incidents.pictures import timeline
from ncclguard.incidents.trace import chrome_trace
from ncclguard.store.keys import Keys, index_key
from ncclguard.testing.launch import free_port
from ncclguard.watching.base.index import WatchIndex

FIXTURE = Path(__file__).parents[1] / "fixtures" / "incidents_v1" / "20261122-090619-001"
PNG = b"\x89PNG\r\n\x1a\n"
INFLIGHT_AGE_GUARD_S = 60.0  # hang guard on an op's age (2 s when read): 30x, only a runaway clock passes it


class Applied:
    """A TCPStore whose ``set`` has been applied by the server when it returns. torch's does not wait
    for the server (measured here: a ``check`` on another connection right after a ``set`` missed
    the key 144 times in 300), while a round trip on the same connection follows the ``set``
    in order: the status view, on its own connection, then reads what the test wrote."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)
        self.store.check([key])

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.fixture(scope="module")
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield Applied(store)
    del store


HANG_GUARD_S = 30.0  # 3x the status CLI's default --timeout (10 s): a bound that only ends a hang


def index(session: str, world: int, run: str = "run-a") -> WatchIndex:
    return WatchIndex(
        run_id=run,
        restart="0",
        session=session,
        generation=0,
        world_size=world,
        heartbeat_s=5.0,
        peer_timeout_s=30.0,
        hang_timeout_s=300.0,
        written=time.time(),
    )


def beat(rank: int, now: float, **kw) -> Heartbeat:
    fields = {
        "rank": rank,
        "host": "node",
        "pid": 100 + rank,
        "beat": 3,
        "time": now,
        "phase": "train",
        "site": "train.py:40",
        "last_seq": {"0": 12},
        "last_completed": {"0": 12},
        "inflight": [],
        "backend_seq": {"0": 40},
        "step": 12,
        "straggler_score": 0.97,
        **kw,
    }
    return Heartbeat(**fields)


def fill(server, session: str, world: int, now: float, skip=(), **per_rank) -> Keys:
    """Publishes an index and ``world`` heartbeats under ``session``; ``per_rank[r]`` overrides fields."""
    idx = index(session, world)
    server.set(index_key(session), idx.model_dump_json())
    keys = idx.keys
    for r in range(world):
        if r not in skip:
            server.set(keys.heartbeat(r), beat(r, now, **per_rank.get(f"r{r}", {})).model_dump_json())
    return keys


def status_json(server, session: str, capsys, *extra: str) -> tuple[int, dict]:
    code = main(["status", "--store", f"127.0.0.1:{server.port}", "--session", session, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_1024_ranks_are_grouped_and_read_in_a_flat_number_of_requests(server, capsys):
    now = time.time()
    world = 1024
    stalled = OpRecord(seq=13, op="all_reduce(SUM)", group="0", start=now - 2.0)
    keys = fill(
        server,
        "big",
        world,
        now,
        skip=(7,),
        r100={"phase": "eval", "step": 11},
        r101={"phase": "eval", "step": 11},
        r512={"straggler_score": 0.5},
        r900={"inflight": [stalled.model_dump()], "last_seq": {"0": 13}},
    )
    assert keys.heartbeat(0) == "ncclguard/wd/run-a/0/big/g0/hb/0"
    reader = StatusReader(dist.TCPStore("127.0.0.1", server.port, is_master=False), 10.0)
    idx = read_index(reader, "big")
    assert isinstance(idx, WatchIndex)
    status = read_status(reader, idx, "here")
    reader.close()
    assert [(g.ranks, g.count, g.state, g.phase, g.step, g.slow, g.last_seq, g.inflight) for g in status.groups] == [
        ("0-6,8-99,102-511,513-899,901-1023", 1019, "ok", "train", 12, False, {"0": 12}, None),
        ("7", 1, "missing", "", None, False, {}, None),
        ("100-101", 2, "ok", "eval", 11, False, {"0": 12}, None),
        ("512", 1, "ok", "train", 12, True, {"0": 12}, None),
        ("900", 1, "ok", "train", 12, False, {"0": 13}, "all_reduce(SUM) #13 on 0"),
    ]
    assert status.health == "suspect"
    assert status.reasons == ["no heartbeat: ranks 7", "straggler score below 0.8: ranks 512"]
    # Requests: the index (check, multi_get); the heartbeats: one check of all 1,024 (CHUNK), split in
    # halves down to rank 7 (1 + 2 * 10 checks), a multi_get of FIRST_READ keys, then one of the
    # other 959 (their size known: far under READ_BYTES); the incident counter's check (absent:
    # nothing more to read).
    assert CHUNK == world and FIRST_READ == 64
    assert status.requests == 2 + (1 + 2 * 10) + 2 + 1 == 26
    assert status.requests / world < 0.03

    code, out = status_json(server, "big", capsys)
    assert code == EXIT_CODES["suspect"] == 3
    assert out["groups"][0]["ranks"] == "0-6,8-99,102-511,513-899,901-1023"
    assert out["groups"][3]["score"] == [0.5, 0.5]
    assert [r["state"] for r in out["ranks"]].count("ok") == 1023
    assert out["requests"] == 26

    main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "big"])
    screen = capsys.readouterr().out
    assert screen.startswith("SUSPECT  1024 ranks in 5 group(s), world generation 0\n")
    assert len(screen.splitlines()) < 40  # one screen


def test_16384_ranks_are_read_in_under_100_requests_and_no_read_is_over_its_byte_budget(server):
    """Issue 63's bound for ``status`` at 16,384 ranks, from one store: under 100 requests. The
    heartbeats are read in chunks sized by what the first read's values weigh, each under
    READ_BYTES, whatever a heartbeat weighs."""
    world, now = 16_384, time.time()
    fill(server, "huge", world, now, skip=(9000,))
    reader = StatusReader(dist.TCPStore("127.0.0.1", server.port, is_master=False), 30.0)
    status = read_status(reader, read_index(reader, "huge"), "here")
    reader.close()
    assert [(g.ranks, g.count, g.state) for g in status.groups] == [
        ("0-8999,9001-16383", 16383, "ok"),
        ("9000", 1, "missing"),
    ]
    hb = len(beat(1, now).model_dump_json())
    per_read = min(CHUNK, READ_BYTES // hb)
    reads = 1 + -(-(world - 1 - FIRST_READ) // per_read)  # FIRST_READ keys, then per_read a request
    # The index (2); 16 checks of 1,024 keys, the one holding rank 9000 split down to it (2 * 10 more);
    # the heartbeats' reads; the incident counter's check.
    assert status.requests == 2 + 16 + 2 * 10 + reads + 1 == 56
    assert per_read * hb <= reader.largest_read <= READ_BYTES


def test_healthy_then_an_open_incident_then_resolved(server, capsys):
    keys = fill(server, "inc", 4, time.time())
    code, out = status_json(server, "inc", capsys)
    assert (code, out["health"], out["reasons"], out["incident_count"]) == (0, "healthy", [], 0)
    doc = IncidentDoc(kind=IncidentKind.HANG, reason="rank 3 is elsewhere", id="20260101-000000-001", by=0, n=1)
    server.set(keys.incident(1), doc.model_dump_json())
    server.add(keys.count, 1)
    code, out = status_json(server, "inc", capsys)
    assert code == EXIT_CODES["incident"] == 4
    assert out["incidents"] == [
        {
            "n": 1,
            "id": "20260101-000000-001",
            "kind": "hang",
            "reason": "rank 3 is elsewhere",
            "by": 0,
            "created": 0.0,
            "open": True,
            "report": None,
            "ranks": None,
            "ranks_back": False,
            "suspects": [],
            "problem": None,
        }
    ]
    assert [(g["ranks"], g["incidents"]) for g in out["groups"]] == [("0", [1]), ("1-3", [])]
    server.set(keys.resolved(1), "1")
    code, out = status_json(server, "inc", capsys)
    assert (code, out["incidents"][0]["open"]) == (0, False)
    assert [(g["ranks"], g["incidents"]) for g in out["groups"]] == [("0-3", [])]
    now = time.time()
    server.set(keys.heartbeat(3), beat(3, now - 40.0).model_dump_json())  # rank 3 stopped beating 40 s ago
    lost = IncidentDoc(
        kind=IncidentKind.PEERS_LOST,
        reason="rank 3 stopped",
        id="20260101-000001-002",
        by=1,
        n=2,
        ranks=[3],
        created=now - 5.0,
    )
    server.set(keys.incident(2), lost.model_dump_json())
    server.add(keys.count, 1)
    code, out = status_json(server, "inc", capsys)
    assert (code, [(i["open"], i["ranks_back"]) for i in out["incidents"]]) == (4, [(False, False), (True, False)])
    assert [(g["ranks"], g["incidents"]) for g in out["groups"]] == [("0,2", []), ("1", [2]), ("3", [2])]
    # Rank 3 beats again (a pause, not a death): the lost incident is no longer open.
    server.set(keys.heartbeat(3), beat(3, time.time()).model_dump_json())
    code, out = status_json(server, "inc", capsys)
    assert (code, out["health"]) == (0, "healthy")
    assert [(i["open"], i["ranks_back"]) for i in out["incidents"]] == [(False, False), (False, True)]
    assert [(g["ranks"], g["incidents"]) for g in out["groups"]] == [("0-3", [])]
    # A heartbeat older than the incident is no sign of return, however fresh the clock says it is.
    server.set(keys.heartbeat(3), beat(3, now - 6.0).model_dump_json())
    code, out = status_json(server, "inc", capsys)
    assert (code, out["incidents"][1]["open"]) == (4, True)


def test_a_store_nobody_answers_is_a_clear_error_within_the_timeout(capsys):
    port = free_port()  # closed again: nobody listens there
    t0 = time.monotonic()
    code = main(["status", "--store", f"127.0.0.1:{port}", "--timeout", "2"])
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert code == EXIT_CODES["no-store"] == 5
    assert out.startswith(f"ncclguard status: nobody listens at 127.0.0.1:{port} (connection refused)")
    # A hang guard, not a speed: refused at once (the message says so, asserted above), so no bound
    # of the request's is waited out; 3x the default --timeout (10 s) leaves a loaded machine's stalls room.
    assert took < HANG_GUARD_S


def test_a_store_that_takes_the_connection_and_never_answers_is_an_error_within_the_timeout(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes connections; nothing ever reads or answers
        port = s.getsockname()[1]
        t0 = time.monotonic()
        code = main(["status", "--store", f"127.0.0.1:{port}", "--timeout", "2"])
        took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert code == EXIT_CODES["no-store"]
    assert out.startswith(f"ncclguard status: the store at 127.0.0.1:{port} did not answer within 2 s")
    # Waited for its bound (the message names the 2 s given, not the default 10 s: asserted above);
    # the upper bound is a hang guard.
    assert 1.5 < took < HANG_GUARD_S


def test_no_store_address_and_no_watchdog(server, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main(["status"]) == EXIT_CODES["usage"] == 2
    assert "give --store HOST:PORT" in capsys.readouterr().out
    assert main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "nobody"]) == 6
    assert "no ncclguard watchdog has named a session 'nobody'" in capsys.readouterr().out
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    assert main(["status", "--session", "nobody"]) == 6  # the default store: torchrun's variables
    capsys.readouterr()


def test_garbage_keys_and_values_crash_nothing(server, capsys):
    server.set(index_key("junk-index"), b"\x80\x81 not json")
    assert main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "junk-index"]) == 6
    assert "is not a watchdog index" in capsys.readouterr().out
    keys = fill(server, "junk", 6, time.time(), skip=range(6))
    server.set(keys.heartbeat(0), b"\x00\xff garbage")
    server.set(keys.heartbeat(1), json.dumps([1, 2, 3]))
    server.set(keys.heartbeat(2), beat(5, time.time()).model_dump_json())  # says rank 5
    server.set(keys.heartbeat(3), b'{"rank": 3, "time": NaN}' + b" " * 10)
    server.set(keys.heartbeat(4), b"x" * (300 * 1024))  # over the heartbeat bound
    server.set(keys.heartbeat(5), beat(5, time.time()).model_dump_json().replace('"time":', '"time":1e999, "x":'))
    server.set(keys.count, b"many")
    server.set(keys.incident(1), b"{}")
    code, out = status_json(server, "junk", capsys)
    assert code == EXIT_CODES["suspect"]
    assert [r["state"] for r in out["ranks"]] == ["bad"] * 6
    assert out["incident_count"] == 0
    assert out["reasons"] == ["unreadable heartbeat: ranks 0-5"]
    server.set(keys.count, b"1")
    code, out = status_json(server, "junk", capsys)
    assert out["incidents"][0]["n"] == 1 and out["incidents"][0]["problem"].startswith(keys.incident(1))
    assert code == EXIT_CODES["suspect"]  # an unreadable incident is shown, not counted as open


@pytest.fixture(scope="module")
def client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False)


@settings(max_examples=40)
@given(st.lists(st.binary(max_size=300), min_size=3, max_size=3), st.binary(max_size=64))
def test_any_bytes_under_the_keys_read_as_bad(server, client, blobs, index_blob):
    session = f"fuzz-{time.monotonic_ns()}"
    reader = StatusReader(client, 10.0)
    server.set(index_key(session), index_blob)
    assert isinstance(read_index(reader, session), str)  # no index model fits 64 random bytes
    idx = index(session, 3)
    for r, blob in enumerate(blobs):
        server.set(idx.keys.heartbeat(r), blob)
    server.set(idx.keys.count, blobs[0][:20])
    status = read_status(reader, idx, "here")
    reader.close()
    assert [r.state for r in status.ranks] == ["bad"] * 3
    assert status.health == "suspect"


def test_trace_has_one_track_per_rank_and_ordered_spans(tmp_path):
    incident, where, _ = load(FIXTURE)
    trace = chrome_trace(timeline(incident, where))
    out = tmp_path / "t.json"
    assert main(["report", str(FIXTURE), "--trace", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(trace))
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= e.keys()
        assert e["ph"] in ("M", "X", "i")
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2]
    assert all(names[r].startswith(f"rank {r} (") for r in names)
    spans = [e for e in events if e["ph"] == "X"]
    for r in (0, 1, 2):
        mine = [e["ts"] for e in spans if e["pid"] == r]
        assert len(mine) >= 5 and mine == sorted(mine)
        assert all(e["dur"] >= 0 and e["tid"] == 0 for e in spans if e["pid"] == r)
    # The hang: ranks 0 and 1 wait in all_reduce #15, drawn open up to the report; rank 2 the culprit.
    open_spans = sorted((e["pid"], e["name"], e["args"]["seq"]) for e in spans if e["args"]["open"])
    assert open_spans == [(0, "all_reduce(SUM)", 15), (1, "all_reduce(SUM)", 15)]
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["s"], e["pid"]) for e in instants] == [("p", 2), ("g", 0)]
    assert instants[1]["name"].startswith(
        "incident 20261122-090619-001 (hang): ranks 0-1 waiting in all_reduce(SUM) #15"
    )


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "deep" / "t.png"
    assert main(["report", str(FIXTURE), "--plot", str(out), "--seconds", "5"]) == 0
    assert out.read_bytes()[:8] == PNG
    assert [p.name for p in out.parent.iterdir()] == ["t.png"]  # written atomically, no leftover


def test_metrics_names_follow_prometheus_conventions(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from ncclguard.incidents.model import PeerView
    from ncclguard.watching.base.metrics import NAMES, WatchdogMetrics, count_commit

    m = WatchdogMetrics(3, tmp_path / "m-{rank}.prom")
    m.activate()
    try:
        count_commit(True)
        count_commit(False)
        m.update(
            3,
            0,
            [{"id": "a", "kind": "hang"}, {"id": "a", "kind": "hang"}, {"id": "b", "kind": "lost"}],
            {"4": PeerView(age_s=1.5, stale=False, seen=True)},
            {4: beat(4, time.time(), straggler_score=0.75)},
            [],
        )
    finally:
        m.deactivate()
    count_commit(True)  # no watchdog metrics: counts nowhere
    text = generate_latest(m.registry).decode()
    for name in NAMES:
        assert f"\n{name}{{" in text or f"\n{name} " in text, name
    assert 'ncclguard_incidents_total{kind="hang",rank="3"} 1.0' in text
    assert 'ncclguard_incidents_total{kind="lost",rank="3"} 1.0' in text
    assert 'ncclguard_peer_heartbeat_age_seconds{peer="4",rank="3"} 1.5' in text
    assert 'ncclguard_straggler_score{peer="4",rank="3"} 0.75' in text
    assert 'ncclguard_commits_total{rank="3",result="ok"} 1.0' in text
    assert 'ncclguard_commits_total{rank="3",result="failed"} 1.0' in text
    assert (tmp_path / "m-3.prom").read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-3.prom"]


def test_watch_reads_again_until_interrupted(server, capsys, monkeypatch):
    import ncclguard.cli.status as status_cli

    fill(server, "watch", 2, time.time())
    naps = []

    def nap(s: float) -> None:
        naps.append(s)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cli.time, "sleep", nap)
    code = main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "watch", "--watch", "0.5"])
    out = capsys.readouterr().out
    assert (code, naps) == (0, [0.5, 0.5])
    assert out.count("\033[H\033[2J") == 2 and out.count("HEALTHY  2 ranks in 1 group(s)") == 2


def test_rank_0_names_the_namespace_once_per_world(server, client):
    from types import SimpleNamespace

    from ncclguard.watching.base.settings import WatchdogConfig
    from ncclguard.watching.base.watchdog_store import WatchdogStore
    from ncclguard.watching.views import Views

    cfg = WatchdogConfig(heartbeat_s=0.5, hang_timeout_s=4.0, session="idx")
    key = index_key("idx")
    # Each call's bound (30 s) is a hang guard: an in-process TCPStore's answer has taken 2-4 s on a
    # loaded machine, and a call that timed out would leave the index unwritten.
    store = WatchdogStore(client, Keys("idx", "run-x", "2", 0), 30.0, 60.0)
    desk0 = SimpleNamespace(rank=0, world_size=4, world={"generation": 0}, store=store)
    desk1 = SimpleNamespace(rank=1, world_size=4, world={"generation": 0}, store=store)
    Views(cfg).beat(None, desk1)
    assert not server.check([key])  # rank 0 alone names it
    views = Views(cfg)
    views.beat(None, desk0)
    got = WatchIndex.model_validate_json(server.get(key))
    assert (got.run_id, got.restart, got.session, got.generation, got.world_size) == ("run-x", "2", "idx", 0, 4)
    assert (got.heartbeat_s, got.peer_timeout_s, got.hang_timeout_s) == (0.5, 3.0, 4.0)
    assert got.keys.heartbeat(3) == "ncclguard/wd/run-x/2/idx/g0/hb/3"
    server.delete_key(key)
    views.beat(None, desk0)
    assert not server.check([key])  # once per world
    store.keys = Keys("idx", "run-x", "2", 1)  # a rebuild: generation 1, three ranks
    desk0.world, desk0.world_size = {"generation": 1}, 3
    views.beat(None, desk0)
    got = WatchIndex.model_validate_json(server.get(key))
    assert (got.generation, got.world_size, got.keys.heartbeat(0)) == (1, 3, "ncclguard/wd/run-x/2/idx/g1/hb/0")


def test_metrics_count_waits_once_and_follow_a_rebuild():
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from ncclguard.incidents.model import PeerView
    from ncclguard.watching.base.metrics import WatchdogMetrics

    m = WatchdogMetrics(0)
    value = m.registry.get_sample_value
    now = time.time()
    recs = [SimpleNamespace(start=now - 3.0, end=now - 2.5), SimpleNamespace(start=now - 2.0, end=None)]
    peers = {"1": PeerView(age_s=0.4, stale=False, seen=True), "2": PeerView(age_s=9.0, stale=True, seen=True)}
    for _ in range(2):  # the same records seen on two beats are counted once
        m.update(0, 0, [], peers, {}, recs)
    assert value("ncclguard_collective_wait_seconds_total", {"rank": "0"}) == pytest.approx(0.5)
    assert value("ncclguard_collectives_total", {"rank": "0"}) == 1.0
    assert value("ncclguard_inflight_ops", {"rank": "0"}) == 1.0
    # The op opened 2 s before `now`: its age is at least that; the upper bound is a hang guard (30x).
    assert 2.0 <= value("ncclguard_oldest_inflight_seconds", {"rank": "0"}) < INFLIGHT_AGE_GUARD_S
    assert value("ncclguard_peer_stale", {"rank": "0", "peer": "2"}) == 1.0
    assert value("ncclguard_rebuilds_total", {"rank": "0"}) == 0.0
    m.update(1, 1, [], {"0": PeerView(age_s=0.1, stale=False, seen=True)}, {}, [])  # rebuilt: now rank 1
    assert value("ncclguard_rebuilds_total", {"rank": "1"}) == 1.0
    assert value("ncclguard_world_generation", {"rank": "1"}) == 1.0
    assert value("ncclguard_peer_stale", {"rank": "0", "peer": "2"}) is None  # the old world's peers are gone
    assert value("ncclguard_peer_heartbeat_age_seconds", {"rank": "1", "peer": "0"}) == 0.1


def test_without_the_extras_the_commands_say_what_to_install(tmp_path, capsys, monkeypatch, caplog):
    from types import SimpleNamespace

    from ncclguard.watching.base.settings import WatchdogConfig
    from ncclguard.watching.views import Views

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "prometheus_client"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import of it raises ImportError
    out = tmp_path / "t.png"
    assert main(["report", str(FIXTURE), "--plot", str(out)]) == 2
    assert "the timeline needs matplotlib: pip install 'ncclguard[plot]'" in capsys.readouterr().out
    assert not out.exists()
    views = Views(WatchdogConfig(metrics_textfile=tmp_path / "m.prom"))
    desk = SimpleNamespace(rank=1, world_size=2, world={"generation": 0}, store=None)
    with caplog.at_level("ERROR", logger="ncclguard"):
        views.beat(SimpleNamespace(incidents=[]), desk)
        views.beat(SimpleNamespace(incidents=[]), desk)
    assert [r.getMessage() for r in caplog.records] == [
        "[rank ?] watchdog: metrics are off: the watchdog's metrics need prometheus_client: pip install 'ncclguard[metrics]'"
    ]
    assert views.metrics is None and list(tmp_path.iterdir()) == []


def job_status() -> JobStatus:
    """A job of 1,024 ranks in a desync: long rank lists, phases, an op in flight, an open incident."""
    now = time.time()
    idx = index("main", 1024, run="3f9c2a7e-41b2-4d0e-9a55-0c1b2d3e4f50")
    group = {"state": "ok", "slow": False, "incidents": [], "inflight": None, "inflight_s": None}

    def g(**kw) -> RankGroup:
        return RankGroup.model_validate({**group, **kw})

    groups = [
        g(
            ranks="0-6,8-99,102-511,513-899,901-1023",
            count=1019,
            phase="train step=1201",
            step=1201,
            last_seq={"0": 56730, "1": 812},
            backend_seq={"0": 113460, "1": 812},
            inflight="all_reduce(SUM) #56731 on 0",
            inflight_s=312.4,
            age_s=(0.4, 4.9),
            score=(0.93, 1.0),
            incidents=[1],
        ),
        g(
            ranks="7",
            count=1,
            state="missing",
            phase="",
            step=None,
            last_seq={},
            backend_seq=None,
            age_s=None,
            score=None,
        ),
        g(
            ranks="100-101",
            count=2,
            phase="eval batch=37 > generate",
            step=1201,
            last_seq={"0": 56730},
            backend_seq={"0": 113459},
            age_s=(1.0, 1.2),
            score=(0.97, 0.99),
            incidents=[1],
        ),
    ]
    reason = "ranks 0-99,102-1023 waiting in all_reduce(SUM) #56731 for 312.4 s; ranks 100-101 in phase eval batch=37 > generate at eval.py:88"
    incident = IncidentRow(
        n=1,
        id="20261124-101500-001",
        kind="desync",
        reason=reason,
        by=0,
        created=now,
        report="node-000:/scratch/job/ncclguard-incidents/20261124-101500-001",
    )
    return JobStatus(
        store="10.0.0.1:29500",
        health="incident",
        reasons=["no heartbeat: ranks 7", "incident 1 open"],
        read_at=now,
        requests=33,
        index=idx,
        groups=groups,
        ranks=[],
        incident_count=1,
        incidents=[incident],
    )


@pytest.mark.parametrize("width", [80, 200])
def test_status_reads_at_80_and_at_200_columns(width: int, capsys) -> None:
    show(job_status(), 40, width=width)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    head = lines.index(next(line for line in lines if line.startswith("ranks ")))
    columns = lines[head].split("  ")
    columns = [c.strip() for c in columns if c.strip()]
    inc_head = lines.index("incidents (1 in this generation, newest shown)")
    table = lines[head + 1 : inc_head]
    if width == 80:  # the short table: fewer, shorter columns; the long rank list on two lines
        assert columns == ["ranks", "n", "state", "phase", "step", "in flight", "inc"]
        assert table == [
            "0-6,8-99,         1019  ok       train step=1201    1201  312s all_reduce…  #1",
            "102-511,513-899…",
            "7                 1     missing  -                  -     -                 -",
            "100-101           2     ok       eval batch=37 > …  1201  -                 #1",
        ]
        assert lines[1:3] == [
            "store 10.0.0.1:29500  session main",
            "run 3f9c2a7e-41b2-4d0e-9a55-0c1b2d3e4f50  restart 0",
        ]
        reason = lines[inc_head + 2 : inc_head + 4]  # two lines, no more
        assert reason[0].startswith("1  desync  open   0   ranks 0-99,102-1023 waiting in") and reason[1].endswith("…")
        assert lines[inc_head + 4] == "#1 report: node-000:/scratch/job/ncclguard-incidents/20261124-101500-001"
    else:  # every column, one line per group
        assert columns == list(_WIDE_COLUMNS)
        assert [line.split()[0] for line in table] == ["0-6,8-99,102-511,513-899,901-1023", "7", "100-101"]
        assert "all_reduce(SUM) #56731 on 0 (312.4 s)" in table[0] and "0:#56730 1:#812" in table[0]
        assert lines[1] == "store 10.0.0.1:29500  session main  run 3f9c2a7e-41b2-4d0e-9a55-0c1b2d3e4f50  restart 0"
        assert "20261124-101500-001  desync  open   0   ranks 0-99" in lines[inc_head + 2]
    assert lines[-1].startswith("read at ")


def test_the_status_command_fits_the_terminal(server, capsys, monkeypatch) -> None:
    fill(server, "narrow", 1024, time.time(), skip=(7,), r100={"phase": "eval", "step": 11})
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "narrow"]) == EXIT_CODES["suspect"]
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80 and len(lines) < 20, "\n".join(lines)
    (header,) = [line.split() for line in lines if line.startswith("ranks ")]
    assert header == ["ranks", "n", "state", "phase", "step", "in", "flight", "inc"]


def test_the_verdict_on_a_rank_waited_for_is_shown_with_its_evidence(server, capsys):
    """The recovery engine's judgment (busy or stuck, and why) rides in the waiting rank's
    heartbeat; status says it once per judged rank, and a judgment makes the job suspect."""
    judged = {"r0": {"judged": {"2": "stuck: nothing moved for 10.0 s (cpu, ops); at t.py:9, its peers waiting 12 s"}}}
    judged["r1"] = {"judged": {"2": "stuck: the process is stopped (SIGSTOP) or gone for 11.0 s; at t.py:9"}}
    judged["r3"] = {"judged": {"1": "moving: moved 0.9 s ago: main-thread cpu +0.93 s in 1.0 s; at t.py:4"}}
    fill(server, "judged", 4, time.time(), **judged)
    code, out = status_json(server, "judged", capsys)
    assert (code, out["health"]) == (EXIT_CODES["suspect"], "suspect")
    assert out["reasons"] == [
        "rank 1 is moving: moved 0.9 s ago: main-thread cpu +0.93 s in 1.0 s; at t.py:4 (judged by rank 3, "
        "which waits for it)",
        "rank 2 is stuck: nothing moved for 10.0 s (cpu, ops); at t.py:9, its peers waiting 12 s (judged by rank 0, "
        "which waits for it)",
    ]
    fill(server, "judged", 4, time.time())  # the step ended: no judgment left
    code, out = status_json(server, "judged", capsys)
    assert (code, out["reasons"]) == (0, [])


def test_takes_that_keep_failing_are_said_once_for_the_ranks_that_say_it(server, capsys):
    """The snapshot keeper's line rides in each rank's heartbeat from its third take lost in a row
    (ncclguard/recovery/snapshots/keeper.py); status says it once, with the ranks."""
    said = "3 takes in a row lost, the newest snapshot is of step 5; the last refused: rank 0: its tensors differ"
    fill(server, "lost", 3, time.time(), r0={"snapshots": said}, r1={"snapshots": said})
    code, out = status_json(server, "lost", capsys)
    assert (code, out["health"]) == (EXIT_CODES["suspect"], "suspect")
    assert out["reasons"] == [f"snapshots not committed: ranks 0-1: {said}"]
    fill(server, "lost", 3, time.time())  # a take committed: the keeper says nothing
    code, out = status_json(server, "lost", capsys)
    assert (code, out["reasons"]) == (0, [])


def test_a_suspect_device_a_handled_numerical_finding_named_keeps_the_job_suspect(server, capsys):
    keys = fill(server, "sdc", 4, time.time())
    finding = NonFiniteReport(step=206, ranks="2", finite="0-1,3", action="skip", suspects=[2])
    doc = IncidentDoc(
        kind=IncidentKind.NUMERICS, reason="step 206: rank 2's gradient held Inf", id="20260101-000002-001", by=0, n=1
    )
    doc.numerics = finding
    server.set(keys.incident(1), doc.model_dump_json())
    server.set(keys.resolved(1), "1")  # handled at the commit: not open
    server.add(keys.count, 1)
    code, out = status_json(server, "sdc", capsys)
    assert (code, out["health"]) == (EXIT_CODES["suspect"], "suspect")
    assert out["reasons"] == [
        "suspect device named by the numerical check: ranks 2 (incident 20260101-000002-001); "
        "consider taking it out of the job"
    ]
    assert [(i["open"], i["suspects"]) for i in out["incidents"]] == [(False, [2])]
    # A finding that named no suspect device is a past event: the job is healthy.
    doc.numerics = finding.model_copy(update={"suspects": []})
    server.set(keys.incident(1), doc.model_dump_json())
    code, out = status_json(server, "sdc", capsys)
    assert (code, out["health"], out["reasons"]) == (0, "healthy", [])
