"""An incident's statements through the node tier (ncclguard/watching/base/near_filing.py): each rank
files its statement in its node's store and one carrier a node takes them to the job's store. Threads
as ranks, each with its own clients of real ``TCPStore``s: the job's and one a node (tests/tier_kit.py);
the watchdog's own store objects (``TieredWatchdogStore``) linked to their node's store as under
``ncclguard run``. The tier on real ranks in two hosts: tests/watching/test_node_tier_multirank.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from desk_kit import QuietState
from harness import wait_for
from tier_kit import JOIN_GUARD_S, Job

from ncclguard.incidents.model import IncidentDoc, IncidentKind, Statement
from ncclguard.store.keys import Keys
from ncclguard.watching.base import near_filing
from ncclguard.watching.base.near_filing import parse_filed
from ncclguard.watching.base.near_store import TieredWatchdogStore
from ncclguard.watching.base.node_layout import NodeLayout
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import WatchdogStore
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.ladder.actions import Ladder, build_ladder
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.liveness import Liveness

WAIT_S = 1.0  # carry_wait_s: a node's ranks wait this long for all of its statements
PER_NODE = 4


def statement(rank: int, world: int) -> Statement:
    return Statement(
        rank=rank,
        host=f"gpu-node-{rank // PER_NODE}",
        pid=4000 + rank,
        beat=9,
        time=time.time(),
        phase="train step=4821",
        site="/job/train.py:412",
        last_seq={"0": 55},
        last_completed={"0": 54},
        inflight=[],
        world_size=world,
        stack=[f"/job/train.py:{400 + i} in train_step: loss = model(batch)" for i in range(30)],
    )


@pytest.fixture(scope="module")
def job():
    # One job's servers and clients for the module, each test on incidents of its own: after clients
    # of a TCPStore server went, new ones' connects waited 5 s now and then here (torch 2.13).
    return Job(8, PER_NODE)


@pytest.fixture(scope="module")
def stores(job):
    made = {"linked": ranks_of(job), "alone": ranks_of(job, linked=False, only=(1,))}
    # Linked before any test counts: a connect that waited 5 s would have the rank file by itself.
    wait_for(lambda: all(s._look() or s.near is not None for s in made["linked"].values()), 60, "links")
    yield made
    for store in [*made["linked"].values(), *made["alone"].values()]:
        store.close()


@pytest.fixture
def ranks(stores):
    for store in stores["linked"].values():
        store.calls.store.calls.clear()
    return stores["linked"]


def ranks_of(job: Job, linked: bool = True, only: tuple[int, ...] = ()) -> dict[int, TieredWatchdogStore]:
    """Each rank's watchdog store (or ``only`` those), linked to its node's store (the launcher's,
    under ``ncclguard run``)."""
    out = {}
    for r in only or range(job.size):
        client, _ = job.clients(r, linked=False)
        layout = NodeLayout(r // PER_NODE, job.size // PER_NODE, r % PER_NODE, PER_NODE)
        port = job.nodes[job.node_of[r]].port
        launcher = f"127.0.0.1:{port}" if linked else ""  # "": none, and no agent names one
        out[r] = TieredWatchdogStore(client, Keys("main"), 5.0, 30.0, layout, 0.2, launcher, carry_wait_s=WAIT_S)
    return out


@pytest.fixture(scope="module")
def view(job):
    """The merger's view of the job's store, and a client of node 0's store."""
    client, near = job.clients(0)
    return WatchdogStore(client, Keys("main"), 5.0, 30.0), near


def requests(store: TieredWatchdogStore) -> dict[str, int]:
    return dict(store.calls.store.calls)


def test_one_carrier_a_node_takes_its_statements_to_the_jobs_store_in_one_request(ranks, view):
    N = 1  # the incident's number
    filed = {r: ranks[r].file_statement(N, statement(r, 8)) for r in range(8)}
    # The rank whose count completes its node carries it; the first carrier merges.
    assert filed == {0: None, 1: None, 2: None, 3: True, 4: None, 5: None, 6: None, 7: False}, filed
    # The job's store: each carrier's one multi_set, its count and its claim; nothing from the others.
    for r in (3, 7):
        assert requests(ranks[r]) == {"multi_set": 1, "add": 1, "compare_set": 1}, requests(ranks[r])
    assert all(requests(ranks[r]) == {} for r in (0, 1, 2, 4, 5, 6))
    # The others learn they were carried (one read of the node's list each), and merge nothing.
    assert [ranks[r].file_later(N) for r in (0, 1, 2, 4, 5, 6)] == [False] * 6
    assert all(not ranks[r].filing.pending for r in range(8))
    assert all(requests(ranks[r]) == {} for r in (0, 1, 2, 4, 5, 6))
    # The merge reads the job's store as flat: every statement, as its rank made it, counted once.
    read = view[0].read_statements(N, range(8))
    made = {r: statement(r, 8).model_dump(exclude={"time"}) for r in range(8)}
    assert {r: st.model_dump(exclude={"time"}) for r, st in read.items()} == made
    assert view[0].add_dumped(N, 0) == 8
    assert (ranks[3].filing.carried, ranks[7].filing.carried) == (4, 4)


def test_a_node_with_a_rank_that_never_files_is_carried_after_its_wait_and_a_late_rank_files_by_itself(ranks, view):
    N = 2  # the incident's number
    # Rank 2 is frozen: it files nothing for now. Node 1 files whole.
    t0 = time.monotonic()
    early = {r: ranks[r].file_statement(N, statement(r, 8)) for r in (0, 1, 3, 4, 5, 6, 7)}
    assert early == {0: None, 1: None, 3: None, 4: None, 5: None, 6: None, 7: True}, early
    waiting = [ranks[r].file_later(N) for r in (0, 1, 3)]
    if time.monotonic() - t0 < WAIT_S:  # within the wait (a machine that stalled this thread skips it)
        assert waiting == [None, None, None]
    time.sleep(WAIT_S + 0.1)
    # The first of node 0 whose wait is over carries the three statements; the others were carried.
    assert ranks[0].file_later(N) is False  # carried, but node 1's carrier already merges
    assert ranks[0].filing.carried == 3
    assert [ranks[r].file_later(N) for r in (1, 3)] == [False, False]
    assert view[0].add_dumped(N, 0) == 7
    # Rank 2 comes back: its count completes the node, the claim is taken, the list lacks it: it
    # files by itself in the job's store. Counted once.
    assert ranks[2].file_statement(N, statement(2, 8)) is None
    assert ranks[2].file_later(N) is False
    assert requests(ranks[2]) == {"set": 1, "add": 1, "compare_set": 1}, requests(ranks[2])
    assert view[0].add_dumped(N, 0) == 8 and sorted(view[0].read_statements(N, range(8))) == list(range(8))


def test_a_rank_without_its_nodes_store_files_by_itself_and_the_node_is_carried_without_it(ranks, stores, view):
    N = 3  # the incident's number
    alone = stores["alone"][1]  # rank 1 has no node's store (none named to it)
    assert alone.file_statement(N, statement(1, 8)) is True  # the first in the job's store: it merges
    # Its filing: one set, its count, its claim (beside its look for a node's store's address: checks).
    assert {k: v for k, v in requests(alone).items() if k != "check"} == {"set": 1, "add": 1, "compare_set": 1}
    assert [ranks[r].file_statement(N, statement(r, 8)) for r in (0, 2, 3)] == [None, None, None]
    time.sleep(WAIT_S + 0.1)
    assert [ranks[r].file_later(N) for r in (0, 2, 3)] == [False, False, False]
    assert view[0].add_dumped(N, 0) == 4


def test_ranks_filing_at_once_are_each_counted_once(ranks, view):
    # Eight threads at once, two nodes: whoever completes a node or outwaits it carries; each statement
    # reaches the job's store and the count is the ranks'. Rounds of it, to meet the races.
    for N in range(10, 15):
        merged: dict[int, bool] = {}

        def rank(r: int, n: int = N, merged: dict[int, bool] = merged) -> None:
            got = ranks[r].file_statement(n, statement(r, 8))
            while got is None:
                time.sleep(0.02)
                got = ranks[r].file_later(n)
            merged[r] = got

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_GUARD_S)
        assert sorted(merged) == list(range(8)) and sum(merged.values()) == 1, merged
        assert view[0].add_dumped(N, 0) == 8 and sorted(view[0].read_statements(N, range(8))) == list(range(8))


def test_a_list_that_names_no_rank_is_refused_and_only_the_ranks_statements_are_carried(ranks, view, caplog):
    N = 4  # the incident's number
    count = Keys("main").dumped(N)
    near = view[1]
    near.append(f"{count}/filed", "x,99999,5,")  # not a number, a rank past the world, a rank with no statement
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        got = [ranks[r].file_statement(N, statement(r, 8)) for r in range(4)]
    assert got == [None, None, None, True]
    said = [m for m in caplog.messages if "more than the ranks' names" in m]
    assert len(said) == 1, caplog.messages
    assert view[0].add_dumped(N, 0) == 4  # rank 5's name carried no statement: not counted
    assert parse_filed(b"1,2,3", 8) == ([1, 2], True)  # an entry cut at the end is dropped, and said
    assert parse_filed(b"1,2,2,", 8) == ([1, 2], False) and parse_filed(b"", 8) == ([], False)


def test_a_carrier_sets_its_nodes_statements_in_requests_of_at_most_carry_bytes(ranks, view, monkeypatch):
    # Statements of up to 1 MB each: a node's are set in requests under CARRY_BYTES (here one a request).
    N = 5  # the incident's number
    size = len(ranks[0].statement_items(N, statement(0, 8))[0][1])
    monkeypatch.setattr(near_filing, "CARRY_BYTES", size + 10)
    got = [ranks[r].file_statement(N, statement(r, 8)) for r in range(4)]
    assert got == [None, None, None, True]
    assert requests(ranks[3]) == {"set": 4, "add": 1, "compare_set": 1}, requests(ranks[3])
    assert sorted(view[0].read_statements(N, range(4))) == [0, 1, 2, 3] and view[0].add_dumped(N, 0) == 4


class Clock:
    """``near_filing``'s clock in the counter's tests: the windows move when the test says."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.monotonic = time.monotonic

    def time(self) -> float:
        return self.now


def test_one_rank_a_node_a_window_reads_the_incident_counter_and_descriptions_and_the_others_read_its_copy(
    ranks, view, monkeypatch
):
    clock = Clock()
    monkeypatch.setattr(near_filing, "time", clock)
    counters = {r: near_filing.RelayedCount(ranks[r], 1.0) for r in range(8)}
    base = view[0].job_incident_count()

    def read_all() -> list[int]:
        for store in ranks.values():
            store.calls.store.calls.clear()
        return [counters[r].read() for r in range(8)]

    assert read_all() == [base] * 8
    # The job's store: one read a node (its window's first rank), none from the others.
    used = {r: requests(ranks[r]) for r in range(8)}
    assert used[0] == used[4] == {"add": 1} and all(used[r] == {} for r in (1, 2, 3, 5, 6, 7)), used
    # An incident numbered inside the window: read at the next one, everywhere (the window's price).
    n = view[0].number_incident()
    doc = IncidentDoc(kind=IncidentKind.HANG, reason="all_reduce in flight 30 s", id=f"20261130-000000-{n:03d}", n=n)
    view[0].put_incident(doc)
    assert read_all() == [base] * 8
    clock.now += 1.0
    assert read_all() == [base + 1] * 8
    assert (counters[0].relayed, counters[4].relayed) == (2, 2)
    # Its description came with the count: every rank reads it in its node's store.
    for store in ranks.values():
        store.calls.store.calls.clear()
    assert all(ranks[r].has_incident(n) and ranks[r].read_incident(n) == doc for r in range(8))
    assert all(requests(ranks[r]) == {} for r in range(8))
    # A node's copy that does not read (not what its creator wrote): the job's description is read.
    ranks[1].near.store.set(ranks[1].keys.incident(n), "not json")
    monkeypatch.setattr(ranks[1], "warn_once", lambda key, text: None)
    assert ranks[1].has_incident(n) and ranks[1].read_incident(n) == doc and requests(ranks[1]) == {"get": 1}
    # One numbered, not yet described: the job's store says so; its description is copied once set.
    late = view[0].number_incident()
    clock.now += 1.0
    assert read_all() == [base + 2] * 8 and not ranks[1].has_incident(late)
    view[0].put_incident(doc.model_copy(update={"n": late, "id": f"20261130-000000-{late:03d}"}))
    clock.now += 1.0
    read_all()
    assert ranks[1].has_incident(late) and requests(ranks[1]) == {} and ranks[1].read_incident(late).n == late
    base += 2
    # A copy older than STALE_WINDOWS windows (its relay stopped, the job's store gone): each rank
    # reads the job's store itself, and copies what it read.
    clock.now += 0.5  # the same window: ranks 0 and 4 claimed it
    stale = f"{base} {clock.now - 10:.3f}"
    for r in (0, 4):
        ranks[r].near.store.set(f"{ranks[r].keys.count}/copy", stale)
    assert counters[1].read() == base and requests(ranks[1]) == {"add": 1}
    assert counters[2].read() == base and requests(ranks[2]) == {}  # rank 1's fresh copy
    # A copy that is not what a rank writes: said once, the job's store read.
    ranks[0].near.store.set(f"{ranks[0].keys.count}/copy", "x")
    with_log = []
    monkeypatch.setattr(ranks[3], "warn_once", lambda key, text: with_log.append(text))
    assert counters[3].read() == base and len(with_log) == 1 and "not '<count> <time>'" in with_log[0]
    # One window's key is left in a node's store.
    node = ranks[0].near.store
    assert node.check([f"{ranks[0].keys.count}/relay/{int(clock.now)}"])
    assert not node.check([f"{ranks[0].keys.count}/relay/{int(clock.now) - 1}"])


def test_a_desk_whose_statement_waits_to_be_carried_merges_when_its_carry_makes_it_the_merger(ranks, tmp_path):
    # Rank 3 alone states (its node's other ranks are frozen): it carries its node after the wait,
    # and so claims the merge. Its ladder (report only) waits until it knows: a ladder that climbed
    # while the statement waited settled before the claim, and the merge never came (seen on two hosts).
    config = WatchdogConfig(heartbeat_s=0.1, hang_timeout_s=1, incident_dir=tmp_path)
    desk = IncidentDesk(
        config,
        QuietState(3, 8),
        Liveness(3, 8, 16, config.peer_timeout, config.startup_grace_s),
        Ladder(build_ladder("report"), config.escalate_after_s),
        None,
        lambda: statement(3, 8),
        threading.Condition(),
    )
    store = desk.store = ranks[3]
    store.keys = Keys("desk")  # incidents of its own, numbered from 1 (the other tests' are in "main")
    try:
        desk.seen_count = store.job_incident_count()
        detection = Detection(IncidentKind.HANG, "rank 3 waited 30 s", "hang/3/55", group="0", seq=55, op="all_reduce")
        desk.open(detection)
        deadline = time.monotonic() + 30.0  # hang guard: the carry comes after WAIT_S, the merge after merge_wait
        while time.monotonic() < deadline and not (
            desk.cases and desk.cases[0].merged and desk.cases[0].ladder.settled
        ):
            desk.poll()
            desk.progress()
            time.sleep(0.05)
    finally:
        store.keys = Keys("main")
    (case,) = desk.cases
    assert case.merger and case.merged and not case.filing and case.ladder.settled
    assert (case.dir / "incident.json").is_file()
    assert [s.rung for s in case.ladder.steps] == ["report"]
    assert ranks[3].filing.carried >= 1
