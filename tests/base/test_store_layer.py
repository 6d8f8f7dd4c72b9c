"""The store layer (ncclguard/store/) on its own: the codec's bounds and errors, the settle-once round
(threads as ranks on torch's HashStore and on a TCPStore on 127.0.0.1), bounded calls on one helper
thread per store client and thread, and the key schema per generation."""

from __future__ import annotations

import ast
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import wait_for
from pydantic import BaseModel, ConfigDict, Field
from tier_kit import run_threads

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store import bounded
from ncclguard.store.bounded import bounded_store_call, helper_for
from ncclguard.store.clients import Connecting, store_for_this_thread
from ncclguard.store.codec import DecodeError, decode, encode
from ncclguard.store.keys import Keys, MeetingKeys, RoundKeys, round_keys, world_prefix
from ncclguard.store.rounds import Members, Peek, Rule, Settled, read_present, settle_round
from ncclguard.testing.launch import free_port

REPO = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------- codec


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    x: float
    label: str = Field(default="", max_length=8, alias="name")
    tags: list[float] = []


def test_decode_reads_a_valid_value_from_bytes_or_text():
    assert decode(Point, b'{"x": 1.5, "name": "a"}', "k", 100) == Point(x=1.5, label="a")
    assert decode(Point, '{"x": 2}', "k", 100) == Point(x=2.0)


def test_decode_refuses_a_value_over_its_bound_before_parsing():
    with pytest.raises(DecodeError, match=r"^k: 101 bytes, over the 100-byte bound of a Point$") as caught:
        decode(Point, b" " * 101, "k", 100)
    err = caught.value
    assert isinstance(err, ValueError)
    assert (err.what, err.model, err.reason, err.size, err.limit) == ("k", "Point", "size", 101, 100)
    # A str is measured in UTF-8 bytes ("é" is two), not in characters.
    text = '{"x": 1, "name": "' + "é" * 4 + '"}'
    assert decode(Point, text, "k", len(text.encode())) == Point(x=1, label="é" * 4)
    with pytest.raises(DecodeError, match="over the"):
        decode(Point, text, "k", len(text.encode()) - 1)


@pytest.mark.parametrize(
    "blob, where, detail",
    [
        (b"{not json", "value", "Invalid JSON"),
        (b"\x80\x04pickle", "value", "Invalid JSON"),
        (b'{"x": "one"}', "x", "Input should be a valid number"),
        (b'{"x": 1, "extra": 2}', "extra", "Extra inputs are not permitted"),
        (b'{"x": 1, "name": "ninechars"}', "name", "String should have at most 8 characters"),
        (b"null", "value", "Input should be an object"),
    ],
)
def test_decode_refuses_a_value_not_valid_for_the_model(blob, where, detail):
    with pytest.raises(DecodeError) as caught:
        decode(Point, blob, "round 'r': rank 1's arrival", 1000)
    err = caught.value
    assert err.reason == "invalid" and err.detail.startswith(detail), err.detail
    assert str(err).startswith(f"round 'r': rank 1's arrival: not a valid Point ({where}: {detail}")
    assert str(err).endswith("1 error(s))")


@pytest.mark.parametrize("blob", [b'{"x": NaN}', b'{"x": 1, "tags": [1.0, Infinity]}', b'{"x": -Infinity}'])
def test_decode_refuses_non_finite_numbers_unless_told_not_to(blob):
    with pytest.raises(DecodeError, match="^k: holds .* where a finite number belongs$") as caught:
        decode(Point, blob, "k", 1000)
    assert caught.value.reason == "non-finite" and caught.value.size == len(blob)
    assert decode(Point, blob, "k", 1000, finite=False).model_dump() is not None


def test_encode_writes_models_by_alias_and_plain_data_as_json_dumps():
    assert encode(Point(x=1, label="a")) == '{"x":1.0,"name":"a","tags":[]}'
    assert decode(Point, encode(Point(x=1, label="a")), "k", 100) == Point(x=1, label="a")
    assert encode({"host": "h", "payload": [1, (2, 3)]}) == '{"host": "h", "payload": [1, [2, 3]]}'
    with pytest.raises(TypeError):
        encode({"payload": object()})


# ----------------------------------------------------------------- keys


def test_watchdog_keys_are_per_run_restart_session_and_generation(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert Keys.from_env("main").ns == "ncclguard/wd/job7/2/main/g0"
    g3 = Keys.from_env("main", generation=3)
    assert g3.ns == "ncclguard/wd/job7/2/main/g3" and g3.generation == 3
    assert g3.heartbeat(1) == "ncclguard/wd/job7/2/main/g3/hb/1"
    assert g3 == Keys("main", "job7", "2", 3) and g3 != Keys.from_env("main", generation=4)
    assert Keys("s").ns == "ncclguard/wd/run/0/s/g0"
    # No key of one generation is a key of another.
    one, two = Keys("s", generation=1), Keys("s", generation=2)
    assert not {one.count, one.heartbeat(0), one.incident(1)} & {two.count, two.heartbeat(0), two.incident(1)}


def test_round_and_meeting_keys():
    k = round_keys("barrier/g/3")
    assert (k.arrival(1), k.count, k.outcome, k.gone) == (
        "ncclguard/barrier/g/3/r1",
        "ncclguard/barrier/g/3/n",
        "ncclguard/barrier/g/3/o",
        "ncclguard/barrier/g/3/gone",
    )
    assert k.rank_of("ncclguard/barrier/g/3/r12") == 12
    for bad in ("ncclguard/barrier/g/3/n", "ncclguard/barrier/g/3/r", "ncclguard/other/r1"):
        with pytest.raises(ValueError, match="is not an arrival key"):
            k.rank_of(bad)
    assert k.every(2) == [*k.transient(2), k.outcome] and len(k.transient(2)) == 4
    m = MeetingKeys(2, 1)
    assert (m.arrival(0), m.outcome, m.count, m.gone) == (
        "ncclguard/rebuild/g2/t1/a0",
        "ncclguard/rebuild/g2/t1/v",
        "ncclguard/rebuild/g2/t1/n",
        "ncclguard/rebuild/g2/t1/gone",
    )
    assert (m.generation, m.attempt) == (2, 1) and m == MeetingKeys(2, 1) and m != MeetingKeys(2, 2)
    assert world_prefix(2) == "ncclguard/world/g2"


def test_a_watchdog_store_moved_to_a_new_generation_reads_only_that_generation():
    from ncclguard.incidents.model import Heartbeat
    from ncclguard.watching.base.watchdog_store import Keys as OldName
    from ncclguard.watching.base.watchdog_store import WatchdogStore

    assert OldName is Keys  # re-exported where it used to live
    # Each call's bound (30 s) is a hang guard: a 1 s bound can pass on a loaded machine.
    ws = WatchdogStore(dist.HashStore(), Keys("t"), 30.0, 60.0)
    hb = Heartbeat(
        rank=0, host="h", pid=1, beat=1, time=1.0, phase="", site="", last_seq={}, last_completed={}, inflight=[]
    )
    ws.publish_heartbeat(hb)
    assert ws.read_heartbeats([0]) == {0: hb}
    ws.keys = Keys("t", generation=1)
    assert ws.keys.ns.endswith("/g1") and ws.read_heartbeats([0]) == {}
    ws.publish_heartbeat(hb)
    assert ws.read_heartbeats([0]) == {0: hb}
    ws.close()


def test_a_heartbeat_whose_sensor_readings_pass_its_bound_is_sent_without_them(caplog):
    """Readings that would make the heartbeat too big for its readers (who would then see the rank
    as lost) are left out, said once; the heartbeat itself still goes."""
    from ncclguard.incidents.model import Heartbeat
    from ncclguard.watching.base.watchdog_store import LIMITS, WatchdogStore

    ws = WatchdogStore(dist.HashStore(), Keys("t"), 30.0, 60.0)
    big = {f"s{i}": {f"f{j}": "x" * 300 for j in range(64)} for i in range(16)}  # 16 x 64 x 300 B
    hb = Heartbeat(
        rank=0, host="h", pid=1, beat=1, time=1.0, phase="", site="", last_seq={}, last_completed={}, inflight=[],
        readings=big,
    )  # fmt: skip
    assert len(hb.model_dump_json()) > LIMITS[Heartbeat]
    with caplog.at_level("WARNING", logger="ncclguard"):
        ws.publish_heartbeat(hb)
        ws.publish_heartbeat(hb.model_copy(update={"beat": 2}))
    assert ws.read_heartbeats([0]) == {0: hb.model_copy(update={"beat": 2, "readings": None})}
    assert sum("readings make a heartbeat" in r.getMessage() for r in caplog.records) == 1
    small = hb.model_copy(update={"beat": 3, "readings": {"queue": {"depth": 4}}})
    ws.publish_heartbeat(small)
    assert ws.read_heartbeats([0]) == {0: small}
    ws.close()


# ----------------------------------------------------------------- rounds


def majority_rule(size: int, tag: str = "") -> Rule[str]:
    """Every rank is a member; the outcome says who gave up and how many had arrived then."""
    return Rule(
        everyone=lambda: "ok",
        given_up=lambda peek: f"timeout {peek.count()} {tag}".strip(),
        read=lambda raw: raw.decode(),
        members=lambda outcome: Members(range(size), complete=outcome == "ok"),
    )


def test_a_round_of_everyone_settles_ok_and_leaves_no_keys():
    store = dist.HashStore()
    keys = RoundKeys("test/all")

    def rank(r: int) -> Settled[str]:
        # A hang guard: every rank arrives long before (a loaded machine may start a thread seconds late).
        return settle_round(store, keys, r, 3, f"from {r}", Deadline.within(30), majority_rule(3), "round 'all'")

    out = run_threads(rank, {0: 0.0, 1: 0.05, 2: 0.1})
    for r in range(3):
        s = out[r]
        assert isinstance(s, Settled), s
        assert s.outcome == "ok" and s.arrivals == {0: b"from 0", 1: b"from 1", 2: b"from 2"}
    assert sorted(out[r].number for r in range(3)) == [1, 2, 3]
    assert store.num_keys() == 0


def test_a_late_rank_reads_the_same_outcome_and_learns_it_was_late():
    store = dist.HashStore()
    keys = RoundKeys("test/late")
    rule = majority_rule(3)

    def rank(r: int, seconds: float) -> Settled[str]:
        # grace_s: a hang guard, so that a stall past the deadline cannot turn the round into StoreUnreachable.
        deadline = Deadline.within(seconds)
        return settle_round(store, keys, r, 3, f"from {r}", deadline, rule, "round 'late'", grace_s=30)

    def first_round(r: int) -> Settled[str]:
        # Not by speed: rank 1 (a 30 s deadline) arrives first; rank 0 enters once rank 1 has counted
        # itself in, and its 0.3 s deadline settles the round with both there.
        if r == 1:
            return rank(1, 30)
        wait_for(lambda: store.check([keys.count]), 30, "rank 1 counted in")
        return rank(0, 0.3)

    t0 = time.monotonic()
    first = run_threads(first_round, {0: 0.0, 1: 0.0})
    # Rank 0's deadline waited; the hang guard is well below rank 1's 30 s (it would settle then).
    assert 0.29 <= time.monotonic() - t0 < 20.0
    assert first[0].outcome == first[1].outcome == "timeout 2"
    assert first[0].arrivals == first[1].arrivals == {0: b"from 0", 1: b"from 1"}
    assert store.check([keys.outcome])  # rank 2 has not left yet: the keys stay
    t0 = time.monotonic()
    late = rank(2, 30)
    assert time.monotonic() - t0 < 10.0  # settled already: no wait for the deadline (30 s; a hang guard)
    # The same outcome; its arrival number (3) is above the count the outcome records (2).
    assert late.outcome == "timeout 2" and late.number == 3
    assert late.arrivals == {0: b"from 0", 1: b"from 1", 2: b"from 2"}
    assert store.num_keys() == 0  # the last rank out cleaned up


def test_the_outcome_is_settled_once_when_several_ranks_give_up():
    store = dist.HashStore()
    keys = RoundKeys("test/once")

    gave_up = {1: threading.Event(), 2: threading.Event()}

    def rank(r: int) -> Settled[str]:
        # Each rank would settle its own words; compare-and-set keeps the first.
        words = majority_rule(4, tag=f"by {r}").given_up
        # The order is made, not left to a loaded machine's speed: rank 0 enters once ranks 1 and 2
        # have counted themselves in, and settles once both have given up too; they try to settle
        # their words only after rank 0 has settled its own.
        if r == 0:
            wait_for(
                lambda: store.check([keys.count]) and store.add(keys.count, 0) == 2, 30, "ranks 1 and 2 counted in"
            )

        def given_up(peek: Peek) -> str:
            if r == 0:
                assert all(e.wait(30) for e in gave_up.values())  # a hang guard
            else:
                gave_up[r].set()
                store.wait([keys.outcome], timedelta(seconds=30))
            return words(peek)

        rule = replace(majority_rule(4, tag=f"by {r}"), given_up=given_up)
        deadline = Deadline.within(0.2 + 0.1 * r)
        return settle_round(store, keys, r, 4, "x", deadline, rule, "round 'once'", grace_s=30)  # grace: a hang guard

    out = run_threads(rank, {0: 0.0, 1: 0.0, 2: 0.0})
    outcomes = {out[r].outcome for r in range(3)}
    assert len(outcomes) == 1, outcomes
    (outcome,) = outcomes
    assert outcome == "timeout 3 by 0"  # rank 0 settles first


def test_an_early_rule_settles_before_the_deadline_and_every_rank_reads_it():
    """Ranks 0-1 of 3 wait; once a death notice names rank 2 dead, a waiting rank settles the round
    at once (its outcome names who died), though the deadline is 60 s off; the late rank reads it."""
    from ncclguard.store.deaths import DeathNotice, post_death, read_deaths

    store = dist.HashStore()
    keys = RoundKeys("test/early")

    def early(peek: Peek) -> str | None:
        _, notices = read_deaths(store, 0, restart="t")
        dead = sorted(n.origin for n in notices)
        return f"dead {dead} with {peek.present()}" if dead == [2] and peek.count() == 2 else None

    rule = Rule(
        everyone=lambda: "ok",
        given_up=lambda peek: "timeout",
        read=lambda raw: raw.decode(),
        members=lambda outcome: Members(range(3), complete=False),
        early=early,
        poll_s=0.05,
    )

    def rank(r: int) -> Settled[str]:
        return settle_round(store, keys, r, 3, f"from {r}", Deadline.within(60), rule, "round 'early'")

    def die() -> None:
        time.sleep(0.3)
        post_death(store, DeathNotice(origin=2, pid=7, returncode=-9, life=0, host="h", at=0.0), restart="t")

    killer = threading.Thread(target=die)
    killer.start()
    t0 = time.monotonic()
    out = run_threads(rank, {0: 0.0, 1: 0.0})
    killer.join(5)
    assert time.monotonic() - t0 < 20  # a hang guard: the round's deadline is 60 s
    assert out[0].outcome == out[1].outcome == "dead [2] with [0, 1]"
    late = rank(2)  # a rank that was not dead after all reads the same outcome
    assert late.outcome == "dead [2] with [0, 1]" and late.number == 3


def test_death_notices_are_counted_read_once_and_never_trusted_blindly():
    from ncclguard.store.deaths import DeathNotice, death_count, post_death, read_deaths

    store = dist.HashStore()
    assert death_count(store, "0") == 0 and read_deaths(store, 0, "0") == (0, [])
    notices = [DeathNotice(origin=r, pid=100 + r, returncode=-9, life=0, host="h", at=1.0) for r in (1, 3)]
    assert [post_death(store, n, "0") for n in notices] == [1, 2]
    assert read_deaths(store, 0, "0") == (2, notices)
    assert read_deaths(store, 1, "0") == (2, notices[1:])  # only what the reader has not seen
    assert read_deaths(store, 0, "1") == (0, [])  # another run of the job (torchrun restarted it) sees none
    # A hostile value under a notice's key is skipped: nobody is named dead by it.
    store.set("ncclguard/dead/0/3", b'{"origin": 5, "pid": -1}')
    store.add("ncclguard/dead/0/n", 1)
    assert read_deaths(store, 2, "0") == (3, [])


def test_a_death_notice_out_of_its_bounds_is_refused_and_logged_once_however_often_it_is_read(caplog):
    import json

    from ncclguard.store.deaths import DeathNotice, post_death, read_deaths

    store = dist.HashStore()
    good = DeathNotice(origin=1, pid=100, returncode=-9, life=0, host="h", at=1.0)
    assert post_death(store, good, "bounds") == 1
    fields = good.model_dump()
    bad = [
        {**fields, "returncode": 10**6},  # no exit status or signal
        {**fields, "pid": 1 << 40},  # past Linux's pid limit
        {**fields, "life": 10**9},
        {**fields, "at": -5.0},
        {**fields, "extra": 1},
    ]
    for i, value in enumerate(bad, start=2):
        store.set(f"ncclguard/dead/bounds/{i}", json.dumps(value))
        store.add("ncclguard/dead/bounds/n", 1)
    with caplog.at_level("WARNING", logger="ncclguard"):
        for _ in range(3):  # readers re-read from a world's start: one line per notice, not per read
            assert read_deaths(store, 0, "bounds") == (6, [good])
    refused = [r.getMessage() for r in caplog.records if "refused: nobody is named dead by it" in r.getMessage()]
    assert len(refused) == 5 and all("not a valid DeathNotice" in m for m in refused), refused
    assert "ncclguard/dead/bounds/2" in refused[0] and "returncode" in refused[0]


def test_an_outcome_that_names_its_members_keeps_the_outcome_for_late_ranks():
    store = dist.HashStore()
    keys = RoundKeys("test/members", arrival="a", outcome="v")
    rule: Rule[list[int]] = Rule(
        everyone=lambda: "[0, 1, 2]",
        given_up=lambda peek: str(peek.present()),
        read=lambda raw: [int(x) for x in raw.decode().strip("[]").split(",") if x.strip()],
        members=lambda ranks: Members(ranks, complete=True),
        keep_outcome=True,
    )

    def rank(r: int, seconds: float) -> Settled[list[int]]:
        # grace_s: a hang guard, so that a stall past the deadline cannot turn the round into StoreUnreachable.
        return settle_round(store, keys, r, 3, f"{r}", Deadline.within(seconds), rule, "meeting", grace_s=30)

    def first_round(r: int) -> Settled[list[int]]:
        # Not by speed: rank 2 (a 30 s deadline) arrives first; rank 0 enters once rank 2 has counted
        # itself in, and its 0.3 s deadline settles the round with both there.
        if r == 2:
            return rank(2, 30)
        wait_for(lambda: store.check([keys.count]), 30, "rank 2 counted in")
        return rank(0, 0.3)

    out = run_threads(first_round, {0: 0.0, 2: 0.0})
    assert out[0].outcome == out[2].outcome == [0, 2]
    assert out[0].arrivals == out[2].arrivals == {0: b"0", 2: b"2"}
    assert store.list_keys() == [keys.outcome]  # the members left; only the outcome stays
    late = rank(1, 30)
    assert late.outcome == [0, 2] and late.arrivals is None  # not a member: reads nothing
    assert sorted(store.list_keys()) == sorted([keys.outcome, keys.arrival(1), keys.count])


def test_a_round_over_tcp_with_a_client_per_thread():
    # 30 s: hang guards (a client's connect, as a clone makes one, now and then takes 5 s under load).
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
    keys = RoundKeys("test/tcp")

    def rank(r: int) -> tuple[Settled[str], bool]:
        deadline = Deadline.within(30)
        mine = store_for_this_thread(client, deadline)
        assert store_for_this_thread(client, deadline) is mine  # made once per thread
        return settle_round(mine, keys, r, 2, f"{r}", deadline, majority_rule(2), "round 'tcp'"), mine is client

    out = run_threads(rank, {0: 0.0, 1: 0.0})
    for r in range(2):
        settled, shared = out[r]
        assert settled.outcome == "ok" and settled.arrivals == {0: b"0", 1: b"1"} and not shared
    assert not server.check([keys.count, keys.outcome])
    assert store_for_this_thread(client, Deadline.within(1)) is client  # the main thread's is the store


def test_a_rule_that_raises_ends_the_round_with_its_error():
    store = dist.HashStore()
    store.set("test/bad/o", "garbage")

    def read(raw: bytes) -> str:
        raise StoreUnreachable(f"cannot read {raw!r}")

    rule = Rule(everyone=lambda: "ok", given_up=lambda p: "t", read=read, members=lambda o: Members([0], True))
    with pytest.raises(StoreUnreachable, match="cannot read b'garbage'"):
        # 30 s: a hang guard (the outcome is there: the round reads it at once).
        settle_round(store, RoundKeys("test/bad"), 0, 2, "x", Deadline.within(30), rule, "round 'bad'")


# ----------------------------------------------------------------- bounded calls


class FrozenStore:
    """A store whose host stopped answering: ``add`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def set(self, key: str, value: str) -> None:
        self.calls += 1
        self.release.wait(20)

    def add(self, key: str, n: int) -> int:
        self.calls += 1
        self.release.wait(20)
        return n


def test_a_round_on_a_frozen_store_ends_by_its_deadline_and_the_store_is_refused_on_every_thread():
    store = FrozenStore()
    rule = majority_rule(2)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="^round 'frozen': the store did not answer within"):
        settle_round(store, RoundKeys("f"), 0, 2, "x", Deadline.within(0.2), rule, "round 'frozen'", grace_s=0.2)  # type: ignore[arg-type]
    # Not before the deadline and its grace; a hang guard, well below the 20 s the frozen calls block.
    assert 0.4 <= time.monotonic() - t0 < 10.0
    # While that call is stuck, a call on the same store fails at once, from this thread or another.
    errors = run_threads(lambda r: bounded_store_call(store, lambda: store.add("k", 1), Deadline.within(5.0)), {0: 0.0})
    assert isinstance(errors[0], StoreUnreachable) and "has not returned" in str(errors[0])
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="earlier call to the store has not returned"):
        bounded_store_call(store, lambda: store.add("k", 1), Deadline.within(30.0))
    assert time.monotonic() - t0 < 10.0 and store.calls == 1  # at once, not the 30 s it was given
    store.release.set()
    deadline = Deadline.within(30)  # a hang guard: a loaded machine may run the released call late
    while True:  # until the stuck call has returned
        try:
            assert bounded_store_call(store, lambda: store.add("k", 7), Deadline.within(30.0)) == 7
            break
        except StoreUnreachable:
            assert not deadline.passed()
            time.sleep(0.01)


def test_calls_on_one_store_share_one_helper_thread_per_calling_thread():
    store = dist.HashStore()
    # 30 s: hang guards (a store answer on a loaded machine has taken over 4 s).
    here = {bounded_store_call(store, threading.get_ident, Deadline.within(30.0)) for _ in range(5)}
    assert len(here) == 1 and threading.get_ident() not in here
    assert helper_for(store) is helper_for(store)
    there = run_threads(
        lambda r: (bounded_store_call(store, threading.get_ident, Deadline.within(30.0)), helper_for(store)), {0: 0.0}
    )
    assert there[0][0] not in here and there[0][1] is not helper_for(store)
    assert bounded.IDLE_EXIT_S > 0


def test_peek_counts_and_lists_the_arrivals_present():
    store = dist.HashStore()
    keys = RoundKeys("p")
    store.set(keys.arrival(2), "x")
    store.set(keys.arrival(0), "y")
    store.add(keys.count, 2)
    peek = Peek(store, keys, 4)
    assert peek.count() == 2 and peek.present() == [0, 2]
    assert read_present(store, [keys.arrival(r) for r in range(4)]) == {keys.arrival(0): b"y", keys.arrival(2): b"x"}


# ----------------------------------------------------------------- one store service, one deadline

STORE_METHODS = {
    "set",
    "get",
    "add",
    "wait",
    "check",
    "multi_get",
    "multi_set",
    "compare_set",
    "delete_key",
    "list_keys",
    "num_keys",
    "clone",
}


def store_traffic_outside_the_store_layer(root: Path) -> list[str]:
    """Every call of a store method on something named ``*store*``, and every ``TCPStore(...)``, in
    the library outside ``ncclguard/store/`` (``file:line: code``)."""
    found = []
    for path in sorted([*(root / "ncclguard").rglob("*.py"), *(root / "integrations").rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("ncclguard/store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            receiver = ast.unparse(node.func.value)
            if (node.func.attr in STORE_METHODS and "store" in receiver.lower()) or node.func.attr == "TCPStore":
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_every_store_exchange_goes_through_the_store_layer(tmp_path: Path) -> None:
    assert store_traffic_outside_the_store_layer(REPO) == []
    # The check can fail: a planted offender is found.
    planted = tmp_path / "ncclguard" / "recovery"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text("def f(world):\n    return world.store.get('k')\n")
    (tmp_path / "integrations").mkdir()
    assert store_traffic_outside_the_store_layer(tmp_path) == ["ncclguard/recovery/bad.py:2: world.store.get('k')"]


def test_a_deadline_is_one_instant_that_every_wait_shares() -> None:
    before = time.monotonic()
    d = Deadline.after(timedelta(seconds=30))
    after = time.monotonic()
    assert Deadline.after(d) is d  # passed through, never restarted
    # Bracketed by the clock, not by how fast the next line runs on a loaded machine.
    assert before + 30 <= d.at <= after + 30 and d.left() <= 30 and not d.passed()
    assert d.sooner(1.0).left() <= 1.0 and d.sooner(60).at == d.at
    assert d.plus(2.0).at == d.at + 2.0
    assert d.as_timedelta() <= timedelta(seconds=30)
    gone = Deadline.within(-5)
    assert gone.passed() and gone.left() == 0.0 and gone.as_timedelta() == timedelta(milliseconds=1)
    t0 = time.monotonic()
    assert gone.sleep(60) is False and time.monotonic() - t0 < 20  # no sleep past the deadline (hang guard)
    for bad in (0, -1, float("nan"), "3"):
        with pytest.raises((TypeError, ValueError)):
            Deadline.after(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        Deadline(float("inf"))


def test_a_poll_whose_last_read_answers_just_past_the_deadline_ends_with_none() -> None:
    from ncclguard.store.values import poll_value

    inner = dist.HashStore()
    deadline = Deadline.within(0.2)

    class SlowAtTheDeadline:
        """Answers at once, but a read begun in the deadline's last 0.1 s answers 0.05 s after it."""

        def check(self, keys: list[str]) -> bool:
            if deadline.left() < 0.1:
                time.sleep(deadline.left() + 0.05)
            return inner.check(keys)

        def get(self, key: str) -> bytes:
            return inner.get(key)

    t0 = time.monotonic()
    # Not there by the deadline: None, not StoreUnreachable (the read is given GRACE_S past it, as a
    # round's last reads are).
    assert poll_value(SlowAtTheDeadline(), "v", Point, 100, deadline, "a point") is None  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - t0 < 10.0  # the deadline was waited; the upper bound is a hang guard


def test_values_poll_and_delete_on_a_real_store() -> None:
    from ncclguard.store.values import delete_keys, delete_prefix, poll_value, read_value, write_value

    store = dist.HashStore()
    deadline = Deadline.within(30)
    assert read_value(store, "v", Point, 100, deadline, "a point") is None
    write_value(store, "v", Point(x=1.0), deadline, "a point")
    assert read_value(store, "v", Point, 100, deadline, "a point") == Point(x=1.0)
    # A poll waits for the value it accepts: written by another thread a moment later.
    later = threading.Timer(0.2, lambda: write_value(store, "v", Point(x=2.0), Deadline.within(30), "a point"))
    later.start()
    assert poll_value(store, "v", Point, 100, deadline, "a point", accept=lambda p: p.x == 2.0) == Point(x=2.0)
    later.join()
    assert poll_value(store, "v", Point, 100, Deadline.within(0.1), "a point", accept=lambda p: p.x > 9) is None
    store.set("x/1", "a")
    store.set("x/2", "b")
    assert delete_prefix(store, "x/", deadline, "x") == 2 and not store.check(["x/1"])
    delete_keys(store, ["v", "missing"], deadline, "v")
    assert not store.check(["v"])
    store.set("v", "{not json")
    with pytest.raises(DecodeError):
        read_value(store, "v", Point, 100, deadline, "a point")


# ----------------------------------------------------------------- clients


def test_a_store_that_answers_late_is_connected_to_and_one_that_never_does_ends_the_tries() -> None:
    # Nothing listens yet: the tries go on in the background (the watchdog's first connect, which a
    # loaded host once missed by its 0.3 s bound, ends here when it misses: watching/worlds.py).
    port = free_port()
    link = Connecting("127.0.0.1", port, within_s=60.0, timeout_s=0.3)
    try:
        assert link.wait(0.5) is None and link.trying
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        server.set("k", "v")
        client = wait_for(link.client, 60, "a client once the store is up")
        assert client.get("k") == b"v"
        assert client.timeout == timedelta(seconds=0.3)  # the caller's bound once connected, not one try's
        assert not link.trying
    finally:
        link.close()
    # Nothing ever listens there: the tries end at ``within_s`` with the last failure said.
    gone = Connecting("127.0.0.1", free_port(), within_s=1.0, timeout_s=0.3)
    assert gone.wait(60) is None and not gone.trying and gone.why
    # Closed while trying: a client made after the close is dropped.
    port = free_port()
    closed = Connecting("127.0.0.1", port, within_s=60.0, timeout_s=0.3)
    closed.close()
    late = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    assert closed.wait(60) is None and not closed.trying
    # A client the caller already has: done at once, no thread.
    given = dist.HashStore()
    assert Connecting.made(given).client() is given and not Connecting.made(given).trying
    del server, late


def test_a_value_under_an_ask_key_that_is_no_ask_is_read_as_none_and_said_once(caplog) -> None:
    """What the supervisor polls every second: a torn or hostile value is no ask, and it is said once,
    not once per poll; another bad value is said again."""
    import logging

    from ncclguard.store.asks import read_ask

    store = dist.HashStore()
    store.set("ncclguard/ask/0/3", "{not json")
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert [read_ask(store, 3, "0") for _ in range(3)] == [None, None, None]
        store.set("ncclguard/ask/0/3", '{"origin": 3}')
        assert read_ask(store, 3, "0") is None
    refused = [r for r in caplog.records if "refused: nothing is done on it" in r.getMessage()]
    assert len(refused) == 2, [r.getMessage() for r in refused]


def test_a_rounds_values_each_read_or_refused_and_an_unreadable_outcome_is_an_untrusted_store(caplog) -> None:
    """The arrivals of a round: one that cannot be read is None (its sender counts as failed), said
    once in the log; the outcome every rank reads: one that cannot be read is StoreUnreachable."""
    from pydantic import BaseModel

    from ncclguard.store.codec import decode_each, decode_outcome

    class Said(BaseModel):
        n: int

    with caplog.at_level("ERROR", logger="ncclguard"):
        got = decode_each(Said, {0: b'{"n": 1}', 1: b"\x80 not json", 2: b'{"n": 3}'}, "statement", 64, "tester")
    assert got == {0: Said(n=1), 1: None, 2: Said(n=3)}
    assert ["tester: rank 1's statement: not a valid Said" in r.getMessage() for r in caplog.records] == [True]
    assert decode_outcome(Said, b'{"n": 4}', "the outcome", "k/o", 64) == Said(n=4)
    with pytest.raises(StoreUnreachable, match=r"^the outcome under 'k/o' cannot be read: "):
        decode_outcome(Said, b'{"n": 4}' + b" " * 100, "the outcome", "k/o", 64)  # over its bound
