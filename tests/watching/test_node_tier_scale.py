"""The node tier's job-store requests at 64 simulated ranks, exactly (issue 63): the pieces of
``benchmarks/node_tier_scale.py`` (its ``SimNode``: a real ``NodeAgent`` over a ``HashStore`` as the
node's store, 8 simulated ranks publishing there) in 8 nodes, with one real ``TCPStore`` job server in
this process and a client that counts its requests. The harness measures the rates at 64 to 16,384
ranks; this pins the counts it rests on. No timing is asserted.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from harness import load_benchmark

from ncclguard.incidents.model import Heartbeat
from ncclguard.store.codec import decode
from ncclguard.store.keys import Keys
from ncclguard.watching.base.node_layout import DIGEST_LIMIT, Digest, watched_nodes
from ncclguard.watching.base.watchdog_store import WatchdogStore, parse_value
from ncclguard.watching.sensors.liveness import watched_peers

REPO = Path(__file__).parents[2]
NODES = 8
# Hang guard of every store call: an in-process server answers in milliseconds; a loaded machine
# took 5 s for a c10d connect now and then (store/bounded_calls.py): 30 s is over 3x that.
STORE_TIMEOUT_S = 30.0


def harness() -> ModuleType:
    return load_benchmark("node_tier_scale")


@pytest.fixture
def tier():
    """8 nodes of 8 ranks whose agents share one counted job-store client (as a harness thread's do)."""
    bench = harness()
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    count = [0]
    keys = Keys("tier-scale-test")
    job = WatchdogStore(bench.CountingStore(client, count), keys, STORE_TIMEOUT_S, STORE_TIMEOUT_S)
    nodes = [bench.SimNode(n, NODES, job) for n in range(NODES)]
    t = SimpleNamespace(bench=bench, server=server, client=client, count=count, keys=keys, job=job, nodes=nodes)
    yield t
    for node in nodes:
        node.agent.close()
    job.close()


def beat(t: Any, beat_no: int, stopped: frozenset[int] = frozenset()) -> list[int]:
    """One beat: every rank publishes, then every agent not in ``stopped`` beats; its job requests."""
    for node in t.nodes:
        for lr in range(len(node.ranks)):
            node.publish(lr, beat_no)
    made = []
    for node in t.nodes:
        if node.node in stopped:
            continue
        before = t.count[0]
        assert node.agent.beat()
        made.append(t.count[0] - before)
    return made


def digests_in(t: Any) -> dict[int, Digest]:
    """Every node's digest, as the job's store holds it."""
    keys = [t.keys.digest(n) for n in range(NODES)]
    return {
        n: decode(Digest, bytes(raw), k, DIGEST_LIMIT)
        for n, (k, raw) in enumerate(zip(keys, t.server.multi_get(keys), strict=True))
    }


def test_an_agent_beat_makes_4_job_requests_once_the_watched_digests_exist(tier):
    # The first beat, in node order: a digest ``set``; one ``check`` of the 3 watched nodes'
    # digests, which fails while one is missing, then a ``check`` each and a ``multi_get`` of those
    # there (store/rounds.read_present); a ``check`` of ``closing``. Nodes 0-4 find none of theirs
    # (they watch 1-3 ... 5-7, not yet beaten), 5 and 6 find node 0 (and 1), 7 finds 0-2.
    assert beat(tier, 1) == [6, 6, 6, 6, 6, 7, 7, 4]
    # From then on: set, check + multi_get, check: 4 for the node, where its 8 ranks made 4 each.
    assert beat(tier, 2) == [4] * NODES
    assert beat(tier, 3) == [4] * NODES


def test_the_closing_mark_costs_a_get_and_is_copied_into_every_node_store(tier):
    beat(tier, 1)
    tier.server.set(tier.keys.closing, "1")
    assert beat(tier, 2) == [5] * NODES  # the check finds it: a ``get`` more
    assert all(bytes(node.near.get(tier.keys.closing)) == b"1" for node in tier.nodes)


def test_every_digest_holds_its_nodes_8_ranks(tier):
    beat(tier, 1)
    beat(tier, 2)
    digests = digests_in(tier)
    assert sorted(digests) == list(range(NODES))
    for n, digest in digests.items():
        assert digest.beat == 2 and sorted(digest.beats) == list(range(n * 8, n * 8 + 8))
        for rank, text in digest.beats.items():
            hb = parse_value(Heartbeat, text, f"rank {rank}")
            assert (hb.rank, hb.beat) == (rank, 2)


def test_each_node_store_holds_every_peer_its_ranks_watch_after_two_beats(tier):
    beat(tier, 1)
    beat(tier, 2)
    world = NODES * 8
    for node in tier.nodes:
        assert (
            node.agent.watched == watched_nodes(node.node, NODES, 16, 8) == [(node.node + i) % NODES for i in (1, 2, 3)]
        )
        for rank in node.ranks:
            for peer in watched_peers(rank, world, 16):
                key = tier.keys.heartbeat(peer)
                assert node.near.check([key]), f"node {node.node} lacks rank {peer}, watched by rank {rank}"
                hb = parse_value(Heartbeat, bytes(node.near.get(key)), key)
                # Its own ranks' as they published; a watched node's as its agent put it at its last
                # beat: this beat's for those that beat before this node in the order, else the one before.
                assert hb.rank == peer and hb.beat == (2 if peer // 8 <= node.node else 1)


def test_a_stopped_agents_digest_stands_still_and_its_copies_with_it(tier):
    beat(tier, 1)
    beat(tier, 2)
    assert beat(tier, 3, stopped=frozenset({5})) == [4] * (NODES - 1)
    beat(tier, 4, stopped=frozenset({5}))
    digests = digests_in(tier)
    assert {n: d.beat for n, d in digests.items()} == {n: 2 if n == 5 else 4 for n in range(NODES)}
    assert all(parse_value(Heartbeat, text, "hb").beat == 2 for text in digests[5].beats.values())
    watcher = tier.nodes[4]  # watches 5, 6, 7
    copied = {
        r: parse_value(Heartbeat, bytes(watcher.near.get(tier.keys.heartbeat(r))), "hb").beat for r in range(40, 56)
    }
    assert copied == {r: 2 if r < 48 else 3 for r in range(40, 56)}  # node 6 beat after 4 in beat 4: its beat 3


def test_the_harness_ranks_make_2_requests_with_the_tier_and_6_without(tier):
    before = tier.count[0]
    tier.bench.counter_reads(tier.job.store, tier.keys)
    assert tier.count[0] - before == 2
    world = NODES * 8
    template = tier.bench.heartbeat_template(0)
    tier.client.multi_set(
        [tier.keys.heartbeat(r) for r in range(world)], [tier.bench.heartbeat_text(template, 1, 0.0)] * world
    )
    before = tier.count[0]
    tier.bench.direct_beat(tier.job.store, tier.keys, 3, world, tier.bench.heartbeat_text(template, 2, 0.0))
    assert tier.count[0] - before == 6


def test_the_harness_heartbeat_is_a_real_one_of_1_to_2_kb():
    bench = harness()
    text = bench.heartbeat_text(bench.heartbeat_template(4099), 17, 1_767_000_123.456)
    hb = parse_value(Heartbeat, text, "hb")
    assert (hb.rank, hb.beat, hb.time) == (4099, 17, 1_767_000_123.456) and hb.window is not None
    assert 1024 <= len(text) <= 2048
