"""Hostile and malformed store data (issue 12, point 3), against a REAL TCPStore.

Every key of the watchdog's schema (:class:`ncclguard.watching.base.watchdog_store.Keys`) gets malformed JSON,
values over their size bound, wrong types, non-finite numbers, values under the wrong rank's key
and path-traversal incident ids, while a real :class:`~ncclguard.watching.watchdog.Watchdog`
(rank 0 of a world of 2; the test plays rank 1) runs against the store. Afterwards the watchdog
still beats, nothing was written outside ``incident_dir``, and each bad key gave one log line
naming it. The round of :mod:`ncclguard.collectives.rendezvous` gets the same treatment for the
arrivals it reads.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
import torch.distributed as dist
from harness import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncclguard.collectives.groups import GroupInfo
from ncclguard.collectives.rendezvous import exchange
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreTimeout
from ncclguard.incidents.model import Heartbeat, IncidentDoc, IncidentKind, Statement
from ncclguard.recording.flight import recorder
from ncclguard.watching.base.watchdog_store import INCIDENT_ID, LIMITS, Keys, StoreRefused, WatchdogStore
from ncclguard.watching.desk.desk import incident_path
from ncclguard.watching.ladder.actions import Action, ActionContext, IncidentRef, Outcome
from ncclguard.watching.watchdog import Watchdog

T = TypeVar("T")
HB = 0.1
SESSION = "fuzz"
GROUP = "fuzz-group"  # the hang incidents' op group: numbered apart from any other test's records
BIG = 8 * 1024 * 1024 - 4096  # the libuv TCPStore server refuses a value over 8 MiB
# The bound of each store call, and how long a failing store may take before it counts as gone: hang
# guards. These tests are about what hostile values do, not about a slow store; on a loaded machine one
# answer of the in-process server once took over 2 s (the refused `add` of a counter that is not a number).
CALL_S, GONE_S = 10.0, 30.0
PATIENCE_S = 60.0  # how long `patient` retries a slow store


# ----------------------------------------------------------------------------- helpers


def heartbeat(rank: int, beat: int, **extra: object) -> Heartbeat:
    return Heartbeat(
        rank=rank,
        host="fuzz-host",
        pid=4242,
        beat=beat,
        time=time.time(),
        phase="train",
        site="/job/train.py:1",
        last_seq={},
        last_completed={},
        inflight=[],
        **extra,
    )


def statement_json(rank: int, **over: object) -> str:
    st_ = Statement(**dict(heartbeat(rank, 1)), world_size=2).model_dump(mode="json")
    return json.dumps({**st_, **over})


def patient(fn: Callable[[], T]) -> T:
    """``fn()``, tried again while the store is only slow (StoreTimeout, StoreRefused among them):
    after the server drops a connection, the new one may take 5 s to connect on this machine (c10d,
    torch 2.13). Anything else is raised at once."""
    end = time.monotonic() + PATIENCE_S
    while True:
        try:
            return fn()
        except StoreTimeout:
            assert time.monotonic() < end, f"the store stayed slow for {PATIENCE_S} s"
            time.sleep(0.05)


def serving(ws: WatchdogStore) -> None:
    """Waits until ``ws`` talks to the store again after a refused request."""
    patient(lambda: ws.read_heartbeats([10**6]))


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


class Lines(logging.Handler):
    """Every message of the ``ncclguard`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def about(self, key: str) -> list[str]:
        """The lines that name ``key`` itself (not a longer key it is a prefix of)."""
        pattern = re.compile(re.escape(key) + r"(?![/\w])")
        return [m for m in self.messages if pattern.search(m)]


@pytest.fixture
def lines():
    handler = Lines()
    logger = logging.getLogger("ncclguard")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def server():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master
    del master


def client(server) -> dist.TCPStore:
    # 10 s: a c10d client's connect now and then takes 5 s on this machine (torch 2.13)
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


@pytest.fixture
def clients(server):
    """Two clients of the server, made once per test (hypothesis runs its examples on them)."""
    return client(server), client(server)


class Noop(Action):
    """A second rung, so that the ladder asks whether the hang was resolved (``has_mark`` of its ``resolved`` key)."""

    name = "noop"

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        return Outcome(done=True)


# Hostile values per kind; every one of them is invalid by construction.
MALFORMED = [b"", b"{", b"not json", b"\xff\xfe\x00", b"[" * 5000 + b"]" * 5000, b"null", b"42", b'"str"', b"[]"]


def wrong_types(rank: int) -> list[bytes]:
    good = json.loads(heartbeat(rank, 7).model_dump_json())
    return [
        json.dumps({**good, "beat": "seven"}).encode(),
        json.dumps({**good, "inflight": {"a": 1}}).encode(),
        json.dumps({**good, "last_seq": [1, 2]}).encode(),
        json.dumps({**good, "rank": rank + 1}).encode(),  # under another rank's key
        json.dumps({**good, "time": float("nan")}).encode(),  # json.dumps writes NaN
        json.dumps({**good, "backend_seq": {"0": 3}, "backend_still": {"0": float("inf")}}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "host"}).encode(),
        *(json.dumps({**good, "window": {**WINDOW, "arrivals": bad}}).encode() for bad in HOSTILE_ARRIVALS),
    ]


# A straggler window (ncclguard/watching/sensors/straggler.py) and arrivals it must never carry: torch's
# flight-recorder times of a DDP-only loop, at most 32, each a backend number and a finite time.
WINDOW = {"n": 3, "end": 40.0, "length_s": 10.0, "compute_s": 10.0, "wait_s": 0.0, "backend_op": "gloo:all_reduce"}
HOSTILE_ARRIVALS = [
    [[k, 1.0] for k in range(33)],  # over the bound
    [[k, 1.0] for k in range(100_000)],  # far over it (about 1 MB): refused by size first
    [[-1, 1.0]],
    [[1, "NaN"]],
    [[1, None]],
    [["x", 1.0]],
    [[1, 2.0, 3.0]],
    [[1]],
    {"1": 2.0},
    "arrivals",
]


@st.composite
def hostile_arrivals(draw: st.DrawFn) -> object:
    """A window's ``arrivals`` that are never valid: too many, or one entry of the wrong shape."""
    if draw(st.booleans()):
        return [[k, float(k)] for k in range(draw(st.integers(33, 400)))]
    bad = draw(
        st.one_of(
            st.tuples(st.integers(max_value=-1), st.floats(allow_nan=False, allow_infinity=False)),
            st.tuples(st.integers(0), st.sampled_from([None, "x", [1.0], {"t": 1.0}])),
            st.lists(st.integers(0), min_size=3, max_size=5),
            st.text(max_size=5),
        )
    )
    good = [[k, 1.0 + k] for k in range(draw(st.integers(0, 31)))]
    return [*good, list(bad) if isinstance(bad, tuple) else bad]


@st.composite
def hostile_heartbeats(draw: st.DrawFn) -> bytes:
    """Bytes that are never a valid heartbeat of rank 1."""
    kind = draw(st.sampled_from(["bytes", "json", "field", "rank", "arrivals"]))
    if kind == "arrivals":
        good = json.loads(heartbeat(1, 3).model_dump_json())
        return json.dumps({**good, "window": {**WINDOW, "arrivals": draw(hostile_arrivals())}}).encode()
    if kind == "bytes":
        return b"\x00" + draw(st.binary(max_size=300))  # a NUL first: never JSON
    if kind == "json":
        value = draw(st.one_of(st.integers(), st.text(max_size=50), st.lists(st.integers(), max_size=5)))
        return json.dumps(value).encode()
    good = json.loads(heartbeat(1, 3).model_dump_json())
    if kind == "rank":
        good["rank"] = draw(st.integers().filter(lambda r: r != 1))
        return json.dumps(good).encode()
    field = draw(st.sampled_from(["beat", "time", "inflight", "last_seq", "pid", "host"]))
    good[field] = draw(st.sampled_from([None, "x", [1], {"a": "b"}, float("nan"), float("-inf")]))
    if field == "host" and isinstance(good[field], str):
        good[field] = 5
    return json.dumps(good).encode()


TRAVERSAL_IDS = ["../../etc/x", "..", ".", "a/b", "a\x00b", "x" * 300, "", " lead", "-dash/../../x", "a\\b"]


# ----------------------------------------------------------------------------- incident paths


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(ident=st.one_of(st.text(max_size=200), st.sampled_from(TRAVERSAL_IDS)))
def test_an_incident_directory_never_resolves_outside_the_incident_dir(tmp_path, ident):
    root = tmp_path / "incidents"
    try:
        where = incident_path(root, ident)
    except ValueError as exc:
        assert "nothing is written" in str(exc)
        assert not INCIDENT_ID.match(ident) or (root / ident).resolve().parent != root.resolve()
        return
    assert where.parent == root.resolve() and where.name == ident


def test_an_absolute_id_and_a_symbolic_link_out_are_refused(tmp_path):
    root, outside = tmp_path / "incidents", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    with pytest.raises(ValueError, match="not a plain directory name"):
        incident_path(root, str(outside))
    (root / "20250101-000000-001").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"resolves to .*outside.*, outside"):
        incident_path(root, "20250101-000000-001")
    assert incident_path(root, "20250101-000000-002") == root.resolve() / "20250101-000000-002"


# ----------------------------------------------------------------------------- the protocol's reads


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(blob=hostile_heartbeats())
def test_a_hostile_heartbeat_is_dropped_with_one_line_until_it_reads_well(clients, lines, blob):
    ws = WatchdogStore(clients[0], Keys("reads"), CALL_S, GONE_S)
    key = ws.keys.heartbeat(1)
    before = len(lines.about(key))
    ws.store.set(key, blob)
    assert ws.read_heartbeats([1]) == {} and ws.read_heartbeats([1]) == {}
    assert len(lines.about(key)) == before + 1, lines.about(key)[before:]
    ws.publish_heartbeat(heartbeat(1, 9))
    assert ws.read_heartbeats([1])[1].beat == 9  # reads well again: the next bad value is told again
    ws.store.set(key, blob)
    assert ws.read_heartbeats([1]) == {}
    assert len(lines.about(key)) == before + 2


def test_every_read_of_the_protocol_survives_every_hostile_value(server, lines):
    ws = WatchdogStore(client(server), Keys("reads"), CALL_S, GONE_S)
    k, evil = ws.keys, client(server)
    values = MALFORMED + wrong_types(1) + [b"x" * BIG]
    for i, v in enumerate(values):
        n = 100 + i
        evil.set(k.heartbeat(1), v)
        evil.set(k.statement(n, 1), v)
        evil.set(k.incident(n), v)
        # A round trip on the writer's connection: the server answers it after the sets before it,
        # so the reader (another connection) finds every value there, a 1.4 MB one included.
        assert evil.check([k.heartbeat(1), k.statement(n, 1), k.incident(n)])
        assert patient(lambda: ws.read_heartbeats([1])) == {}
        assert patient(lambda n=n: ws.read_statements(n, [1])) == {}
        assert patient(lambda n=n: ws.read_incident(n)) is None
        evil.set(k.resolved(n), v)
        assert patient(lambda n=n: ws.has_mark(ws.keys.resolved(n))) is False
        evil.set(k.dumped(n), v)
        try:  # a number-like prefix counts ("42"; the server's stoll reads "12abc" as 12); the rest is refused
            assert isinstance(ws.add_dumped(n, 0), int)
        except StoreTimeout:  # StoreRefused: the server dropped the connection; a new one is made
            serving(ws)
        evil.set(k.merger(n), v)
        assert patient(lambda n=n: ws.claim_merger(n, 0, world_size=2)) is True  # taken over: no rank of 2 wrote it
    # One line per bad statement and incident key (each its own key), however bad.
    for i in range(len(values)):
        assert len(lines.about(k.statement(100 + i, 1))) == 1
        assert len(lines.about(k.incident(100 + i))) == 1
    # The heartbeat key stayed bad all along: one line in all.
    assert len(lines.about(k.heartbeat(1))) == 1
    # The store still serves this client (a refused `add` cost a new connection, not the store).
    patient(lambda: ws.publish_heartbeat(heartbeat(1, 1)))
    assert patient(lambda: ws.read_heartbeats([1]))[1].beat == 1


@pytest.mark.parametrize(
    "raw, why",
    [
        (json.dumps({"kind": "hang", "reason": "r", "id": "../../etc/x", "n": 1}), "not a plain directory name"),
        (json.dumps({"kind": "hang", "reason": "r", "id": "/etc/passwd", "n": 1}), "not a plain directory name"),
        (json.dumps({"kind": "hang", "reason": "r", "id": "a\x00b", "n": 1}), "not a plain directory name"),
        (json.dumps({"kind": "hang", "reason": "r", "id": "x" * 129, "n": 1}), "not a plain directory name"),
        (json.dumps({"kind": "hang", "reason": "r", "id": "fine-id", "n": 7}), "describes incident 7, not 1"),
        (json.dumps({"kind": "nope", "reason": "r", "id": "fine-id", "n": 1}), "not a valid IncidentDoc"),
        ("x" * (LIMITS[IncidentDoc] + 1), "over the 65536-byte bound"),
    ],
)
def test_an_incident_description_is_checked_against_its_key(server, lines, raw, why):
    ws = WatchdogStore(client(server), Keys("docs"), CALL_S, GONE_S)
    ws.store.set(ws.keys.incident(1), raw)
    assert ws.read_incident(1) is None
    (line,) = lines.about(ws.keys.incident(1))
    assert why in line


def test_a_counter_that_is_not_a_number_is_refused_then_read_until_it_is_one(server, lines):
    ws = WatchdogStore(client(server), Keys("count"), CALL_S, GONE_S)
    first = ws.store
    ws.store.set(ws.keys.count, "abc")
    with pytest.raises(StoreRefused, match="the server still takes connections"):
        ws.incident_count()
    end = time.monotonic() + PATIENCE_S
    while ws.store is first:  # the server dropped the old connection; a new one is made (may take 5 s)
        assert time.monotonic() < end
        with pytest.raises(StoreRefused):
            ws.incident_count()
    for _ in range(5):  # read, not counted on: no further connection is lost
        with pytest.raises(StoreRefused, match="not a counter"):
            ws.incident_count()
    assert ws.store is ws.calls.store
    (line,) = lines.about(ws.keys.count)
    assert "is not a number that ncclguard counted" in line
    ws.store.set(ws.keys.count, "3")
    assert ws.incident_count() == 3 and ws.number_incident() == 4
    # StoreRefused is a StoreTimeout: the watchdog's loop treats it as one failed call, not a lost store.
    assert issubclass(StoreRefused, StoreTimeout)


def test_a_claim_that_no_rank_wrote_is_taken_over_once(server, lines):
    ws, other = (WatchdogStore(client(server), Keys("claim"), CALL_S, GONE_S) for _ in range(2))
    key = ws.keys.claim("hang/0/3")
    ws.store.set(key, b"\xff garbage")
    assert ws.claim("hang/0/3", "0:aaaa0000") is True
    assert other.claim("hang/0/3", "1:bbbb1111") is False  # a rank's claim is respected
    assert len(lines.about(key)) == 1


# ----------------------------------------------------------------------------- a live watchdog


def test_a_running_watchdog_survives_hostile_values_in_every_key(server, lines, tmp_path, monkeypatch):
    """Rank 0's real watchdog thread against hostile values in every key of the schema."""
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    recorder.clear()
    keys = Keys(SESSION)
    evil = client(server)
    root = tmp_path / "job"
    incident_dir = root / "incidents"
    incident_dir.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (incident_dir / "20990101-000000-777").symlink_to(outside, target_is_directory=True)  # a link out
    before = tree(tmp_path)

    # Rank 1, played by the test through the real protocol: beats while `healthy` is set.
    peer = WatchdogStore(client(server), keys, CALL_S, GONE_S)
    healthy, stop = threading.Event(), threading.Event()

    def beat() -> None:
        i = 0
        while not stop.is_set():
            if healthy.is_set():
                i += 1
                peer.publish_heartbeat(heartbeat(1, i))
            stop.wait(HB)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    wd = Watchdog(
        store=client(server),
        actions=["report", Noop()],
        heartbeat_s=HB,
        hang_timeout_s=0.6,
        peer_timeout_s=60,  # rank 1's unreadable beats must not read as a lost peer here
        startup_grace_s=60,
        escalate_after_s=0.4,
        merge_wait_s=0.3,
        store_timeout_s=CALL_S,
        incident_dir=str(incident_dir),
        instrument=False,
        session=SESSION,
    ).start()
    expected: dict[str, int] = {}  # key -> log lines that must name it
    try:
        own = lambda: patient(lambda: WatchdogStore(evil, keys, CALL_S, GONE_S).read_heartbeats([0]).get(0))  # noqa: E731
        wait_for(lambda: own() is not None, 20, "rank 0's first heartbeat")
        healthy.set()

        # 1. Heartbeats: hypothesis draws hostile values for rank 1's key, each held for a beat.
        healthy.clear()
        time.sleep(2 * HB)

        @settings(max_examples=25, deadline=None, database=None)
        @given(blob=hostile_heartbeats())
        def feed(blob: bytes) -> None:
            evil.set(keys.heartbeat(1), blob)
            time.sleep(1.5 * HB)

        feed()
        evil.set(keys.heartbeat(1), b"x" * BIG)  # over the bound, as large as the server takes
        time.sleep(2 * HB)
        expected[keys.heartbeat(1)] = 1  # one bad streak: one line
        healthy.set()
        time.sleep(2 * HB)

        # 2. Incident descriptions: ids that are paths, a link out, NULs, wrong numbers, bad JSON.
        base = int(evil.add(keys.count, 0))
        docs = [json.dumps({"kind": "hang", "reason": "evil", "id": i, "n": 0}) for i in TRAVERSAL_IDS]
        docs += [json.dumps({"kind": "hang", "reason": "evil", "id": str(outside), "n": 0})]
        docs += [d.decode(errors="replace") for d in MALFORMED]
        docs += ["x" * (LIMITS[IncidentDoc] + 10)]
        for i, raw in enumerate(docs):
            n = base + 1 + i
            raw = raw.replace('"n": 0', f'"n": {n}') if i < len(TRAVERSAL_IDS) + 1 else raw
            evil.set(keys.incident(n), raw)
            expected[keys.incident(n)] = 1
        link_n = base + len(docs) + 1  # a well-formed id whose directory is a link out of incident_dir
        evil.set(
            keys.incident(link_n),
            IncidentDoc(kind=IncidentKind.HANG, reason="evil", id="20990101-000000-777", n=link_n).model_dump_json(),
        )
        evil.add(keys.count, len(docs) + 1)
        wait_for(lambda: any("resolves to" in m for m in lines.messages), 20, "the link out to be refused")

        # 3. An incident this rank raises itself (a hang), with hostile values waiting for it:
        #    its claim, the dumped counter, rank 1's statement and the resolved mark.
        n1 = int(evil.add(keys.count, 0)) + 1
        rec = recorder.start("all_reduce(SUM)", GROUP, 4, "float32", site="/job/train.py:9")
        sig = f"hang/{GROUP}/{rec.seq}"
        evil.set(keys.claim(sig), b"\x00not-a-claim")
        evil.set(keys.dumped(n1), "many")
        evil.set(keys.statement(n1, 1), statement_json(0))  # rank 0's statement under rank 1's key
        evil.set(keys.resolved(n1), "yes")
        evil.set(keys.merged(n1), "{")  # written by the merger, never read
        evil.set(keys.fenced(1), b"\x00{")  # written by a fenced rank, read by `status` only (presence)
        expected[keys.fenced(1)] = 0
        for key in (keys.claim(sig), keys.dumped(n1), keys.statement(n1, 1), keys.resolved(n1)):
            expected[key] = 1
        expected[keys.merged(n1)] = 0
        wait_for(lambda: len(wd.incidents) >= 1 and wd.incidents[0]["settled"], 20, "the first hang to settle")
        recorder.finish(rec)
        first = wd.incidents[0]
        assert first["doc"]["n"] == n1 and [a["rung"] for a in first["actions"]] == ["report", "noop"]
        assert (Path(first["dir"]) / "incident.json").is_file()
        merged = json.loads((Path(first["dir"]) / "incident.json").read_text())
        assert merged["statements_from"] == [0] and merged["missing_statements"] == [1]

        # 4. A second hang: the merger's mark is taken by nobody that is a rank.
        n2 = int(evil.add(keys.count, 0)) + 1
        rec2 = recorder.start("all_reduce(SUM)", GROUP, 4, "float32", site="/job/train.py:9")
        evil.set(keys.merger(n2), "../../root")
        evil.set(keys.statement(n2, 1), "x" * (LIMITS[Statement] + 1))
        expected[keys.merger(n2)] = expected[keys.statement(n2, 1)] = 1
        wait_for(lambda: len(wd.incidents) >= 2 and wd.incidents[1]["merger"], 20, "the second hang to be merged")
        wait_for(lambda: (Path(wd.incidents[1]["dir"]) / "incident.json").is_file(), 20, "the second merge")
        recorder.finish(rec2)

        # 5. The incident counter: not a number (the server drops the connection on `add`), then a jump.
        count = int(evil.add(keys.count, 0))
        evil.set(keys.count, "NaN")
        wait_for(lambda: len(lines.about(keys.count)) >= 1, 20, "the counter to be refused")
        time.sleep(5 * HB)
        evil.set(keys.count, str(count))
        time.sleep(5 * HB)  # reads well again
        evil.set(keys.count, str(count + 10**9))
        wait_for(lambda: len(lines.about(keys.count)) >= 2, 20, "the jump to be told")
        expected[keys.count] = 2  # one per bad streak

        # 6. The job's end: a closing mark that is not the mark (read at each heartbeat: one line, and
        #    the store is not taken for closing), and an ending counter that is no number (counted at
        #    the stop below: refused, said once by the counter and once by the stop).
        evil.set(keys.closing, "yes")
        evil.set(keys.ending, "many")
        expected[keys.closing] = 1
        expected[keys.ending] = 2
        wait_for(lambda: len(lines.about(keys.closing)) >= 1, 20, "the closing mark to be refused")
        time.sleep(3 * HB)
        assert wd.watch is not None and wd.watch.desk.store_closing is False

        # Every key of the schema was given hostile values above; the node tier's (a watchdog of one
        # process has none) in tests/watching/test_node_tier.py::test_hostile_values_in_the_tiers_keys_are_refused_and_logged,
        # a statement's head (above 1,024 ranks only) in
        # tests/incidents/test_watching_desk.py::test_above_1024_ranks_the_merge_reads_heads_and_the_culprits_whole_statements.
        tier = {"digest", "member", "node_addr"}
        schema = (
            {name for name, _ in inspect.getmembers(Keys) if not name.startswith("_")} - {"from_env", "head"} - tier
        )
        assert schema == {
            "count",
            "heartbeat",
            "claim",
            "incident",
            "statement",
            "dumped",
            "merger",
            "merged",
            "resolved",
            "fenced",
            "ending",
            "closing",
        }

        # The watchdog thread lives and still beats; it never counted the store as gone.
        beat_now = own().beat
        wait_for(lambda: own().beat >= beat_now + 3, 20, "three more heartbeats of rank 0")
        assert wd._thread is not None and wd._thread.is_alive()
        assert [i["kind"] for i in wd.incidents] == ["hang", "hang"], wd.incidents
        assert not any("tick failed" in m or "stopped answering" in m for m in lines.messages)
    finally:
        stop.set()
        wd.stop()
        recorder.clear()
    beater.join(2)

    for key, n in expected.items():
        assert len(lines.about(key)) == n, (key, lines.about(key))
    # Nothing outside incident_dir: the new paths are the two incidents' directories and files.
    new = tree(tmp_path) - before
    assert new and all(p.startswith("job/incidents/") for p in new), sorted(new)
    assert sorted({p.split("/")[2] for p in new}) == sorted(Path(i["dir"]).name for i in wd.incidents)
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "etc").exists() and not Path("/etc/x").exists()


# ----------------------------------------------------------------------------- the rendezvous round


ARRIVALS = st.one_of(
    st.binary(max_size=200).map(lambda b: b"\x00" + b),  # never JSON
    st.sampled_from(MALFORMED),
    st.just(b"x" * (256 * 1024 + 1)),  # over MAX_ARRIVAL_BYTES
    st.fixed_dictionaries({"host": st.one_of(st.integers(), st.none(), st.text(min_size=256, max_size=300))}).map(
        lambda d: json.dumps(d).encode()
    ),
    st.fixed_dictionaries({"host": st.just("h"), "extra": st.integers()}).map(lambda d: json.dumps(d).encode()),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(blob=ARRIVALS)
def test_a_round_reads_a_hostile_arrival_as_missing(clients, lines, blob):
    """The arrivals of a round (``ncclguard/<round>/r<rank>``) are parsed by a size-bounded model."""
    name = f"fuzzround/{time.monotonic_ns()}"
    me, evil = clients
    info = GroupInfo(group=None, name="fuzz", rank=0, size=2, backend="gloo", store=me)
    evil.set(f"ncclguard/{name}/r1", blob)
    evil.add(f"ncclguard/{name}/n", 1)
    before = len(lines.messages)
    result = exchange(info, name, {"x": 1}, Deadline.within(CALL_S))  # both arrived: read at once
    assert result.missing == [1] and not result.ok and result.payloads == {0: {"x": 1}}
    (line,) = lines.messages[before:]
    assert f"round {name!r}: rank 1 wrote" in line
    assert math.isfinite(result.elapsed_s)
