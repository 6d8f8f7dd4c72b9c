"""The death notices through the node tier (store/deaths.py ``relay_deaths``): a take's waits look
at the notices every 0.5 s on every rank; through its node's store, one rank of a node a window reads
the job's store and the others read its copy. Real ``TCPStore``s: the job's and one a node
(tests/tier_kit.py), a client each per rank."""

from __future__ import annotations

import json
import logging
import threading
import time

from tier_kit import Job

from ncclguard.deadlines import Deadline
from ncclguard.store import node_store
from ncclguard.store.deaths import (
    MAX_NOTICE_BYTES,
    RELAY_S,
    DeathNotice,
    DeathWatch,
    post_death,
    read_deaths,
    relay_deaths,
    relay_slot,
)

RESTART = "relay"
PREFIX = f"ncclguard/dead/{RESTART}"


def notice(origin: int) -> DeathNotice:
    return DeathNotice(origin=origin, pid=4000 + origin, returncode=-9, life=0, host="node-b", at=1.0)


def test_one_rank_a_node_reads_the_jobs_notices_a_window_and_the_others_read_its_copy(caplog):
    job = Job(8, 4)  # 2 nodes of 4
    clients = {r: job.clients(r) for r in range(8)}
    poster = job.clients(0)[0]
    for origin in (5, 6):
        post_death(poster, notice(origin), RESTART)

    def window(slot: int, seen: int) -> tuple[list[bool], dict[int, tuple[int, list[DeathNotice]]]]:
        copied, read = [], {}
        for r in range(8):
            store, near = clients[r]
            copied.append(relay_deaths(near, store, slot, RESTART))
            read[r] = read_deaths(near, seen, RESTART)
        return copied, read

    copied, read = window(100, 0)
    assert copied == [True, False, False, False, True, False, False, False]  # the first of each node
    assert all(read[r] == (2, [notice(5), notice(6)]) for r in range(8)), read
    # The job's store: each node's first rank's check, count and one multi_get; nobody else's.
    calls = {r: dict(clients[r][0].calls) for r in range(8)}
    assert calls[0] == calls[4] == {"check": 1, "add": 1, "multi_get": 1}, calls
    assert all(not calls[r] for r in (1, 2, 3, 5, 6, 7)), calls
    # A death posted inside the window is read at the next one: the window is the relay's price.
    post_death(poster, notice(7), RESTART)
    assert window(100, 2)[1][3] == (2, [])
    copied, read = window(101, 2)
    assert copied == [True, False, False, False, True, False, False, False]
    assert all(read[r] == (3, [notice(7)]) for r in range(8)), read
    # One window's key is left in a node's store; its count moves only over the notices copied.
    near = clients[0][1]
    assert near.check([f"{PREFIX}/relay/101"]) and not near.check([f"{PREFIX}/relay/100"])
    # A hostile notice in the job's store is copied empty (over the bound) or as it is, and refused
    # by each reader: nobody is named dead by it.
    poster.set(f"{PREFIX}/4", "x" * (MAX_NOTICE_BYTES + 1))
    poster.add(f"{PREFIX}/n", 1)
    poster.set(f"{PREFIX}/5", json.dumps({**notice(1).model_dump(), "pid": -1}))
    poster.add(f"{PREFIX}/n", 1)
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        copied, read = window(102, 3)
    assert all(read[r] == (5, []) for r in range(8)), read
    refused = [m for m in caplog.messages if "nobody is named dead by it" in m]
    assert len(refused) == 2 and f"{PREFIX}/4" in refused[0] and f"{PREFIX}/5" in refused[1], refused
    assert int(near.add(f"{PREFIX}/n", 0)) == 5


def test_a_watch_reads_through_its_nodes_store_and_the_jobs_when_that_store_is_gone(caplog, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", RESTART)
    job = Job(4, 2)
    (store, near), poster = job.clients(0), job.clients(2)[0]
    origins = {r: 10 + r for r in range(4)}  # launch ranks of their own: the notices name those
    watch = DeathWatch(store, 0, origins, 0, near=lambda: near)
    assert watch.look_within(Deadline.within(30)) == {}
    post_death(poster, notice(13), RESTART)
    time.sleep(RELAY_S)  # the next window: this rank copies again
    dead = watch.look_within(Deadline.within(30))
    assert list(dead) == [3] and "launch rank 13 on node-b" in dead[3]
    assert near.check([f"{PREFIX}/1"])  # read through the node's store's copy
    # The node's store goes (its process died): the next look reads the job's store, once said.
    job.nodes[0] = None  # the last reference: the server stops
    post_death(poster, notice(12), RESTART)
    with caplog.at_level(logging.INFO, logger="ncclguard"):
        dead = watch.look_within(Deadline.within(30))
        assert sorted(dead) == [2, 3]
        assert sorted(watch.look_within(Deadline.within(30))) == [2, 3]
    said = [m for m in caplog.messages if "the node's store failed" in m]
    assert len(said) == 1, caplog.messages


def test_the_relays_window_is_half_a_second():
    assert relay_slot(10.0) == 20 and relay_slot(10.49) == 20 and relay_slot(10.5) == 21


def test_a_watch_reads_through_the_linked_node_store_by_default_and_the_jobs_where_none_is_linked(monkeypatch):
    # A commit's, a take's and the verdict's watches read through node_store.near_getter by default:
    # the calling thread's client of the node's store the watchdog linked to, looked up at each look.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", RESTART)
    monkeypatch.setattr(node_store._linked, "addr", "")
    get = node_store.near_getter()
    assert get() is None  # no node tier: the watch reads the job's store
    job = Job(2, 2)
    monkeypatch.setattr(node_store._linked, "addr", f"127.0.0.1:{job.nodes[0].port}")
    monkeypatch.setattr(node_store._linked, "local", threading.local())
    near = get()
    assert near is not None and get() is near  # one client a thread, connected once
    store, poster = job.clients(0)[0], job.clients(1)[0]
    post_death(poster, notice(11), RESTART)
    watch = DeathWatch(store, 0, {0: 10, 1: 11}, 0)  # the default: the linked node's store, as near_getter gives it
    assert list(watch.look_within(Deadline.within(30))) == [1]
    assert job.nodes[0].check([f"{PREFIX}/1"])  # read through the node's store's copy
