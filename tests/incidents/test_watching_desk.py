"""Claim, statements and merge without processes: three ranks' incident desks in one process,
sharing one in-memory store (torch's HashStore), with synthetic statements. The real-rank
version is tests/watching/test_watchdog_multirank.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ncclguard.errors import StoreUnreachable
from ncclguard.incidents.model import Heartbeat, IncidentKind, OpRecord, Statement
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import Keys, WatchdogStore
from ncclguard.watching.desk import merging
from ncclguard.watching.desk.cases import op_resolved
from ncclguard.watching.desk.desk import IncidentDesk, blocked_in
from ncclguard.watching.ladder.actions import Ladder, build_ladder
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.liveness import Liveness, store_host_text
from ncclguard.watching.sensors.rank_state import RankState

WORLD = 3


class FakeState(RankState):
    """A rank's state without a live process behind it."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, WORLD)
        self.done_ops: set[tuple[str, int]] = set()
        self.seqs: dict[str, int] = {"0": 9}

    def threads(self) -> dict[str, list[str]]:
        return {"MainThread (1)": ["/job/train.py:1 in <module>"]}

    def records(self) -> list[OpRecord]:
        return []

    def completed(self, key: tuple[str, int]) -> bool:
        return key in self.done_ops

    def backend_seq(self) -> dict[str, int] | None:
        return dict(self.seqs)

    def blocked_in(self) -> OpRecord | None:
        return None


def statement(rank: int, *, waiting: bool) -> Statement:
    now = time.time()
    inflight = (
        [OpRecord(seq=5, op="all_reduce(SUM)", group="0", numel=4, dtype="float32", start=now - 10, site="/job/t.py:9")]
        if waiting
        else []
    )
    return Statement(
        rank=rank,
        host="node1",
        pid=100 + rank,
        beat=3,
        time=now,
        phase="train step=5" if waiting else "eval batch=2",
        site="/job/t.py:9" if waiting else "/job/eval.py:4",
        last_seq={"0": 5 if waiting else 4},
        last_completed={"0": 4},
        inflight=inflight,
        blocked_in=inflight[0] if inflight else None,
        world_size=WORLD,
        stack=["/job/main.py:1 in <module>"],
        groups={"0": list(range(WORLD))},
    )


HANG = Detection(IncidentKind.HANG, "rank 0 waited 10.0 s", "hang/0/5", group="0", seq=5, op="all_reduce(SUM)")


def desks(tmp_path, store=None, **cfg):
    store = store if store is not None else dist.HashStore()
    config = WatchdogConfig(heartbeat_s=0.1, hang_timeout_s=1, incident_dir=tmp_path, **cfg)
    out = []
    for r in range(WORLD):
        desk = IncidentDesk(
            config,
            FakeState(r),
            Liveness(r, WORLD, 16, config.peer_timeout, config.startup_grace_s),
            Ladder(build_ladder("report"), config.escalate_after_s),
            None,
            lambda r=r: statement(r, waiting=r != 2),
            threading.Condition(),
        )
        # Each call's bound (30 s) is a hang guard: a 1 s bound can pass on a loaded machine, and a
        # call that times out changes what a desk does (a poll skipped, a rank merging alone).
        desk.store = WatchdogStore(store, Keys("t"), 30.0, 60.0)
        out.append(desk)
    return out


def test_a_hang_seen_by_two_ranks_is_one_incident_that_every_rank_dumps_and_one_merges(tmp_path):
    d = desks(tmp_path)
    d[0].open(HANG)
    d[1].open(HANG)  # the same signature: claimed already
    assert d[0].store.incident_count() == 1
    for desk in d:
        desk.poll()
    ids = {desk.cases[0].doc.id for desk in d}
    (ident,) = ids
    assert ident.endswith("-001") and d[0].cases[0].doc.by == 0
    assert [desk.cases[0].merger for desk in d] == [True, False, False]  # the first to publish merges
    where = tmp_path / ident
    assert sorted(p.name for p in where.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]
    for desk in d:
        desk.progress()
    assert all(desk.cases[0].ladder.settled for desk in d)
    inc = json.loads((where / "incident.json").read_text())
    assert (inc["format_version"], inc["merged_by"], inc["statements_from"]) == (2, 0, [0, 1, 2])
    assert [(c["rank"], c["why"], c["phase"]) for c in inc["culprits"]] == [(2, "behind", "eval batch=2")]
    assert inc["victims"] == [0, 1]
    assert (where / "summary.txt").read_text().startswith(f"ncclguard incident {ident}: rank 0 waited 10.0 s\n")
    note = json.loads(d[0].store.store.get(Keys("t").merged(1)))
    assert (note["dir"], note["summary"]) == (str(where.resolve()), inc["summary"])
    dump = json.loads((where / "rank1.json").read_text())
    assert dump["statement"]["rank"] == 1 and [a["rung"] for a in dump["actions"]] == ["report"]
    assert d[1].cases[0].record()["kind"] == "hang"


def test_the_merger_waits_for_statements_then_merges_what_came(tmp_path, monkeypatch):
    # merge_wait is long enough that no loaded machine outlasts it between two lines; the merger's
    # clock then jumps past it instead of the test sleeping through it.
    d = desks(tmp_path, merge_wait_s=30)
    d[2].store.publish_heartbeat(Heartbeat.model_validate(dict(statement(2, waiting=False))))
    d[0].open(HANG)
    d[0].poll()
    d[1].poll()  # rank 2's watchdog never answers
    d[0].progress()
    assert not d[0].cases[0].merged  # 2 of 3 statements, within merge_wait
    monkeypatch.setattr(merging, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + 30.05))
    d[0].progress()
    assert d[0].cases[0].merged
    inc = json.loads((tmp_path / d[0].cases[0].doc.id / "incident.json").read_text())
    assert (inc["statements_from"], inc["missing_statements"], inc["silent"]) == ([0, 1], [2], [2])
    assert [(c["rank"], c["why"]) for c in inc["culprits"]] == [(2, "behind")]  # from its last heartbeat
    assert inc["ranks"]["2"]["source"] == "heartbeat"


def test_a_resolved_hang_is_seen_by_the_other_ranks(tmp_path):
    d = desks(tmp_path)
    d[0].open(HANG)
    for desk in d:
        desk.poll()
    assert not op_resolved(d[1].cases[0], d[1].state, d[1].store)
    d[0].state.done_ops.add(("0", 5))  # type: ignore[attr-defined]
    assert op_resolved(d[0].cases[0], d[0].state, d[0].store)
    assert op_resolved(d[1].cases[0], d[1].state, d[1].store)  # through the store
    lost = Detection(IncidentKind.PEERS_LOST, "no heartbeat from rank 2", "lost/2", ranks=(2,))
    d[0].open(lost)
    d[0].poll()
    assert not op_resolved(d[0].cases[1], d[0].state, d[0].store)  # a lost rank never resolves


class GoneStore:
    """A store whose server is gone: every call is refused, as torch reports it."""

    def __getattr__(self, name):
        def refuse(*args):
            raise dist.DistNetworkError("Connection reset by peer")

        return refuse


def test_a_store_that_is_gone_turns_into_a_local_store_incident(tmp_path):
    (desk, *_) = desks(tmp_path, store=GoneStore())
    desk.store_addr = "10.0.0.1:29500"
    with pytest.raises(StoreUnreachable) as info:
        desk.poll()
    desk.store_gone(info.value)
    desk.store_gone(info.value)  # once only
    assert desk.store is None and len(desk.cases) == 1
    case = desk.cases[0]
    assert (case.doc.kind, case.doc.n, case.local, case.merger) == (IncidentKind.STORE_GONE, -1, True, True)
    assert case.doc.id.endswith("-r0-store-1")
    desk.progress()
    inc = json.loads((case.dir / "incident.json").read_text())
    assert [f["kind"] for f in inc["findings"]] == ["store"] and inc["culprits"] == []
    assert inc["summary"].startswith(
        "the rendezvous store at 10.0.0.1:29500 stopped answering (DistNetworkError: Connection reset by peer); "
        "the store's host is 10.0.0.1: it lives in rank 0's process"
    )
    # timeline.png (with matplotlib) comes from a thread of its own: not part of what is checked here.
    written = sorted(p.name for p in case.dir.iterdir() if not p.name.startswith(".") and p.name != "timeline.png")
    assert written == ["incident.json", "rank0.json", "summary.txt"]
    # Without a store, a new hang is handled on this rank alone, at once.
    desk.open(HANG)
    assert desk.cases[1].local and desk.cases[1].doc.id.endswith("-r0-hang-2")
    desk.close()


class StallingStore:
    """A store whose server stops answering, then answers again: torch's refusal while ``gone``."""

    def __init__(self) -> None:
        self.gone, self.inner = False, dist.HashStore()

    def __getattr__(self, name):
        def call(*args):
            if self.gone:
                raise dist.DistNetworkError("Connection reset by peer")
            return getattr(self.inner, name)(*args)

        return call


def test_a_store_that_answers_again_is_the_desks_store_again(tmp_path, caplog, monkeypatch):
    """Seen in CI: the torchrun agent's store silent for 3 s, every rank's watchdog at once; the
    ranks went on, and one the others had left behind could never be told: its store was dropped
    for good. Now the store is asked again every second, and taken back once it answers."""
    monkeypatch.setattr("ncclguard.watching.desk.desk.STORE_ASK_EVERY_S", 0.0)
    stalling = StallingStore()
    (desk, *_) = desks(tmp_path, store=stalling)
    stalling.gone = True
    with pytest.raises(StoreUnreachable) as info:
        desk.poll()
    desk.store_gone(info.value)
    assert desk.store is None and desk.store_lost and [c.doc.kind for c in desk.cases] == [IncidentKind.STORE_GONE]
    assert desk.store_back() is False and desk.store is None  # still silent
    stalling.gone = False
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert desk.store_back() is True
    assert desk.store is not None and not desk.store_lost and desk.lost_store is None
    assert any("the store answers again after" in r.getMessage() for r in caplog.records)
    desk.poll()  # incidents are read through it again
    # Lost again, it is said again: a second local incident.
    stalling.gone = True
    with pytest.raises(StoreUnreachable) as info:
        desk.poll()
    desk.store_gone(info.value)
    assert [c.doc.kind for c in desk.cases] == [IncidentKind.STORE_GONE] * 2
    desk.close()


def test_incident_values_that_cannot_be_read_are_skipped(tmp_path, caplog):
    raw = dist.HashStore()
    d = desks(tmp_path, store=raw, peer_timeout_s=0.2)
    keys = Keys("t")
    raw.add(keys.count, 2)
    raw.set(keys.incident(1), '{"kind": "hang"}')  # described, badly
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        d[0].poll()
        assert d[0].seen_count == 1 and d[0].cases == []  # #2: counted, not described yet: wait
        time.sleep(0.25)
        d[0].poll()
    assert d[0].seen_count == 2 and d[0].cases == []
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "not a valid IncidentDoc" in text and "incident 1 has no readable description; skipping it" in text
    assert "incident 2 was counted but never described; skipping it" in text


def test_a_backend_desync_resolves_once_the_rank_moves_past_its_number(tmp_path):
    d = desks(tmp_path)
    desync = Detection(
        IncidentKind.BACKEND_DESYNC, "rank 0 stood", "desync/0/9", group="0", seq=9, op="gloo:all_reduce"
    )
    d[0].open(desync)
    for desk in d:
        desk.poll()
    case = d[0].cases[0]
    assert case.doc.op_key is None and not op_resolved(case, d[0].state, d[0].store)
    # Waiting at #9, with nothing recorded in Python: the raise rung sees the C++ op.
    assert blocked_in(case.doc, d[0].state) == OpRecord(seq=9, op="gloo:all_reduce", group="0", start=case.doc.created)
    d[1].state.seqs["0"] = 8  # type: ignore[attr-defined]
    assert blocked_in(d[1].cases[0].doc, d[1].state) is None  # behind: not in the op
    d[0].state.seqs["0"] = 10  # type: ignore[attr-defined]
    assert op_resolved(case, d[0].state, d[0].store)
    assert op_resolved(d[2].cases[0], d[2].state, d[2].store)  # the other ranks learn it through the store


def test_the_stores_host_is_named_with_the_ranks_last_seen_there():
    liveness = Liveness(3, 4, 3, 6.0, 6.0)
    beats = {
        r: Heartbeat(
            rank=r,
            host=host,
            address=addr,
            pid=1,
            beat=1,
            time=0.0,
            phase="",
            site="",
            last_seq={},
            last_completed={},
            inflight=[],
        )
        for r, host, addr in ((0, "node0", "10.0.0.1"), (1, "node0", "10.0.0.1"), (2, "node1", "10.0.0.2"))
    }
    liveness.observe(beats, 0.0)
    assert store_host_text("10.0.0.1:29500", liveness) == "the store's host is 10.0.0.1 (node0, ranks 0-1 as last seen)"
    assert store_host_text("[fd00::9]:29500", liveness) == "the store's host is fd00::9"


def test_a_numerical_finding_told_by_each_rank_is_one_incident_resolved_at_once_and_reported_in_its_words(tmp_path):
    # Every rank's engine tells the same finding (its commit's outcome); the watchdog's thread opens
    # what it was told at its next tick (Told), and the store's claim makes it one incident.
    from ncclguard.incidents.model import FlaggedBucket, NamedRank, NonFiniteReport
    from ncclguard.watching.desk.casebook import Casebook
    from ncclguard.watching.desk.told import Told

    report = NonFiniteReport(
        step=5,
        ranks="1",
        named=[NamedRank(rank=1, buckets=[FlaggedBucket(index=0, kind="NaN", params=["fc.weight"])])],
        finite="0,2",
        action="redo",
    )
    found = Detection(IncidentKind.NUMERICS, "step 5: ...", "numerics/nonfinite/5/1", ranks=(1,), numerics=report)
    d = desks(tmp_path)
    told = [Told() for _ in d]
    book = Casebook()
    book.follow(d[0])
    assert not book.wait_handled(found, 0.0)
    for desk, mine in zip(d, told, strict=True):
        mine.put(found)
        mine.open_in(desk)
        mine.open_in(desk)  # opened once: nothing waits any more
    assert d[0].store.incident_count() == 1
    for desk in d:
        desk.poll()
    case = d[0].cases[0]
    # A past event (the engine acted at its commit): resolved in the store as it is handled, so that
    # `ncclguard status` does not read it open; nothing for the ladder to clear.
    assert d[0].store.has_mark(d[0].store.keys.resolved(case.doc.n))
    assert not book.wait_handled(found, 0.0)  # rank 0 merges it: not merged yet
    for desk in d:
        desk.progress()
    assert (case.doc.kind, case.doc.numerics, case.doc.ranks) == (IncidentKind.NUMERICS, report, [1])
    assert book.wait_handled(found, 0.0)  # handled here, and merged
    assert [s.rung for s in case.ladder.steps] == ["report"] and case.ladder.settled
    inc = json.loads((tmp_path / case.doc.id / "incident.json").read_text())
    assert (inc["culprits"], inc["victims"], inc["findings"]) == ([], [], [])  # the statements are not analysed
    assert (
        inc["summary"]
        == "step 5: rank 1's gradient held NaN in bucket 0 (fc.weight); ranks 0,2 finite; the step was redone"
    )
    assert (
        "  rank 1: NaN in bucket 0 (fc.weight)\n  ranks 0,2: finite\n"
        in (tmp_path / case.doc.id / "summary.txt").read_text()
    )


def test_the_incident_counter_is_read_each_half_beat_and_at_each_tick_while_something_happens(tmp_path):
    """Read at every tick, the counter was 10 of a healthy rank's 13 store requests a beat. Now half a
    beat apart (0.05 s here), and at once after a raise, a lost claim, and while an incident is open."""
    d = desks(tmp_path)  # heartbeat_s 0.1: every half beat is 0.05 s
    assert d[0].poll_due(100.0) and not d[0].poll_due(100.01) and not d[0].poll_due(100.04)
    assert d[0].poll_due(100.06)  # half a beat later
    assert d[1].poll_due(100.0) and not d[1].poll_due(100.01)
    d[1].open(HANG)  # raised by rank 1: read back (handled) at this tick
    assert d[1].poll_due(100.02)
    d[1].poll()
    assert [c.doc.kind for c in d[1].cases] == [IncidentKind.HANG]
    assert d[1].poll_due(100.03) and d[1].poll_due(100.031)  # open: every tick
    assert not d[0].poll_due(100.07)
    d[0].open(HANG)  # the same hang, claimed by rank 1 already: read it now, not half a beat later
    assert d[0].poll_due(100.071)
    d[0].poll()
    assert [c.doc.n for c in d[0].cases] == [1]
    for desk in d:
        desk.close()


class CountedStore:
    """A HashStore whose checks and multi_gets are counted (the merger's reads)."""

    def __init__(self) -> None:
        self.inner, self.calls = dist.HashStore(), {"check": 0, "multi_get": 0}

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)
        if name not in self.calls:
            return method

        def call(*args):
            self.calls[name] += 1
            return method(*args)

        return call


def test_the_merger_reads_every_statement_in_bounded_chunks_of_read_chunk_keys(tmp_path):
    """benchmarks/desk_scale.py: 4,096 statements in one multi_get outran the 5 s bound of a store
    call; each call now reads READ_CHUNK keys (128), under its own bound."""
    from ncclguard.watching.base.watchdog_store import READ_CHUNK

    counted = CountedStore()
    store = WatchdogStore(counted, Keys("t"), 30.0, 60.0)
    n = 2 * READ_CHUNK + 44
    for r in range(n):
        st = statement(r, waiting=True).model_copy(update={"rank": r})
        store.put_statement(7, st)
    got = store.read_statements(7, list(range(n)) + [n + 5])  # one rank that said nothing
    assert sorted(got) == list(range(n)) and got[n - 1].rank == n - 1
    # 3 chunks: each a check of its keys and a multi_get; the chunk with the missing key checks
    # each of its keys once more (multi_get would wait for a missing one).
    assert counted.calls == {"check": 3 + 45, "multi_get": 3}, counted.calls


def test_a_follower_on_another_host_copies_the_report_only_up_to_copy_max_ranks(tmp_path, monkeypatch, caplog):
    """Merging.follow: above COPY_MAX_RANKS a node's first rank on another host does not read every
    statement again (each node doing so costs the store nodes x the merge: benchmarks/desk_scale.py);
    it logs where the report is, as below it, where it also copies the report."""
    d = desks(tmp_path)
    d[0].open(HANG)
    for desk in d:
        desk.poll()
    for desk in d:
        desk.progress()
    where = tmp_path / d[0].cases[0].doc.id
    (where / "incident.json").unlink()  # rank 1 on a host whose incident directory is its own
    monkeypatch.setattr(merging, "HOSTNAME", "another-host")
    monkeypatch.setattr(merging, "COPY_MAX_RANKS", WORLD - 1)
    with caplog.at_level(logging.ERROR, logger="ncclguard"):
        assert d[1].merger.follow(d[1].cases[0])
    assert not (where / "incident.json").exists()
    assert f"not copied here: over {WORLD - 1} ranks only the merger reads every statement" in caplog.text
    monkeypatch.setattr(merging, "COPY_MAX_RANKS", WORLD)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ncclguard"):
        assert d[1].merger.follow(d[1].cases[0])
    assert json.loads((where / "incident.json").read_text())["culprits"][0]["rank"] == 2
    assert "the same report here" in caplog.text


def test_above_1024_ranks_a_statement_keeps_its_newest_ops_and_innermost_frames():
    """benchmarks/desk_scale.py: at 16,384 ranks the merging rank took 7.4 s to parse 20 ops and
    30 frames of every rank; above BRIEF_FROM ranks a statement keeps its newest 4 ops and its
    innermost 12 frames, and up to it every one."""
    from ncclguard.watching.base.watchdog_store import BRIEF_FRAMES, BRIEF_FROM, BRIEF_RECENT

    store = WatchdogStore(dist.HashStore(), Keys("t"), 30.0, 60.0)
    base = statement(0, waiting=True)
    recent = [base.inflight[0].model_copy(update={"seq": s, "state": "completed"}) for s in range(1, 21)]
    stack = [f"/job/lib.py:{i} in f{i}" for i in range(30)]
    for world, ops, frames in ((BRIEF_FROM, 20, 30), (BRIEF_FROM + 1, BRIEF_RECENT, BRIEF_FRAMES)):
        st = base.model_copy(update={"world_size": world, "recent": recent, "stack": stack})
        store.put_statement(world, st)
        (said,) = store.read_statements(world, [0]).values()
        assert [r.seq for r in said.recent] == list(range(21 - ops, 21)), world
        assert said.stack == stack[-frames:] and said.stack[-1] == "/job/lib.py:29 in f29", world
        assert (said.site, said.phase, said.inflight) == (base.site, base.phase, base.inflight)
