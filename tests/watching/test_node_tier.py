"""The node tier's parts in one process (issue 63): the layout read from a launcher's environment,
which nodes a node watches, when the tier is on; three nodes of two ranks each against one real job
``TCPStore``, each node's agent serving a real ``TCPStore`` of its own; and ``status`` reading the
digests of 16,384 simulated ranks.

The tier on real ranks in two hosts is tests/watching/test_node_tier_multirank.py; its cost at scale,
benchmarks/node_tier_scale.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ncclguard.cli.status_read import StatusReader, read_index, read_status
from ncclguard.incidents.model import Heartbeat
from ncclguard.store import node_store
from ncclguard.store.codec import encode
from ncclguard.store.keys import Keys, index_key
from ncclguard.watching.base.index import WatchIndex
from ncclguard.watching.base.near_store import FROZEN_BEATS, TieredWatchdogStore, read_digests
from ncclguard.watching.base.node_agent import LEASE_BEATS, LeasedAgent, NodeAgent, start_agent
from ncclguard.watching.base.node_layout import DIGEST_LIMIT, Digest, NodeLayout, tier_wanted, watched_nodes
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import WatchdogStore

HEARTBEAT_S = 0.2  # the simulated ranks' beat: FROZEN_BEATS of it is the wait for a frozen copy


class Counted:
    """A store client that counts its requests."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.requests = inner, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not callable(method):
            return method

        def call(*args: Any) -> Any:
            self.requests += 1
            return method(*args)

        return call


def torchrun_env(node: int, local: int, **extra: str) -> dict[str, str]:
    env = {"GROUP_RANK": str(node), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16384"}
    return {**env, **extra}


def test_the_layout_is_what_torchrun_says_or_none():
    assert NodeLayout.from_env(torchrun_env(5, 3)) == NodeLayout(node=5, nodes=2048, local_rank=3, local_size=8)
    assert NodeLayout.from_env(torchrun_env(5, 0, GROUP_WORLD_SIZE="2048")).is_agent
    assert NodeLayout.from_env({"LOCAL_RANK": "0", "WORLD_SIZE": "4"}) is None  # not launched by torchrun
    assert NodeLayout.from_env(torchrun_env(2048, 0)) is None  # a node past the nodes
    assert NodeLayout.from_env(torchrun_env(1, 8)) is None  # a local rank past the node's ranks
    assert NodeLayout.from_env(torchrun_env(1, 0, LOCAL_WORLD_SIZE="65", WORLD_SIZE="130")) is None


def test_a_node_watches_the_next_nodes_that_hold_its_ranks_peers():
    assert watched_nodes(5, 2048, 16, 8) == [6, 7, 8]  # ranks 40-47 watch up to rank 63: nodes 6-7, one more
    assert watched_nodes(2047, 2048, 16, 8) == [0, 1, 2]
    assert watched_nodes(0, 2, 16, 8) == [1]
    assert watched_nodes(0, 1, 16, 8) == []


def test_the_tier_is_on_from_its_threshold_with_several_nodes_of_several_ranks():
    many = NodeLayout(0, 2048, 0, 8)
    cfg = WatchdogConfig()
    assert (cfg.node_tier, cfg.node_tier_min_ranks) == ("auto", 512)
    assert tier_wanted("auto", 16384, 512, many) and not tier_wanted("auto", 256, 512, many)
    assert tier_wanted("on", 4, 512, NodeLayout(0, 2, 0, 2)) and not tier_wanted("off", 16384, 512, many)
    assert not tier_wanted("on", 8, 512, NodeLayout(0, 1, 0, 8))  # one node: nothing to aggregate
    assert not tier_wanted("on", 8, 512, NodeLayout(0, 8, 0, 1))  # one rank a node: nothing either
    assert not tier_wanted("on", 8, 512, None)


def heartbeat(rank: int, beat: int, **kw: Any) -> Heartbeat:
    fields = dict(rank=rank, host=f"node{rank // 2}", pid=100 + rank, beat=beat, time=time.time(), phase="train")
    fields.update(site="train.py:40", last_seq={"0": beat}, last_completed={"0": beat}, inflight=[])
    return Heartbeat(**{**fields, **kw})


@pytest.fixture
def job():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


NODES, LOCAL = 3, 2


def tiered(job_port: int, rank: int) -> TieredWatchdogStore:
    client = Counted(dist.TCPStore("127.0.0.1", job_port, is_master=False, timeout=timedelta(seconds=10)))
    layout = NodeLayout(rank // LOCAL, NODES, rank % LOCAL, LOCAL)
    return TieredWatchdogStore(client, Keys("main"), 5.0, 30.0, layout, HEARTBEAT_S)


def test_three_nodes_beat_through_their_stores_and_the_job_store_sees_one_digest_a_node(job):
    ranks = {r: tiered(job.port, r) for r in range(NODES * LOCAL)}
    agents = {
        n: NodeAgent(ranks[n * LOCAL].layout, 2, ranks[n * LOCAL], node_store.serve(5.0, fresh=True))
        for n in range(NODES)
    }
    keys = Keys("main")
    seen: dict[int, dict[int, int]] = {}
    for b in range(1, 5):
        before = {r: s.calls.store.requests for r, s in ranks.items()}
        for r, store in ranks.items():
            store.publish_heartbeat(heartbeat(r, b))
        for agent in agents.values():
            assert agent.beat()
        time.sleep(HEARTBEAT_S)  # a rank looks for its node's store at most once a heartbeat
        seen = {
            r: {p: hb.beat for p, hb in s.read_heartbeats([(r + 1) % 6, (r + 2) % 6]).items()} for r, s in ranks.items()
        }
        if b >= 3:  # linked since beat 2: only the agents talk to the job's store, 4 requests a beat each
            used = {r: s.calls.store.requests - before[r] for r, s in ranks.items()}
            assert used == {0: 4, 1: 0, 2: 4, 3: 0, 4: 4, 5: 0}, (b, used)
    # Each rank sees its two next peers: those of its node at this beat; another node's as of the
    # last digest its own agent copied in: this beat's for the nodes whose agent beat before its own
    # (agents beat in the order 0, 1, 2 here), the beat before for the others (the tier's one beat
    # of lag, docs/scale.md).
    assert seen == {
        0: {1: 4, 2: 3},
        1: {2: 3, 3: 3},
        2: {3: 4, 4: 3},
        3: {4: 3, 5: 3},
        4: {5: 4, 0: 4},
        5: {0: 4, 1: 4},
    }
    digests = read_digests(ranks[0], keys, [0, 1, 2])
    assert {n: (d.beat, sorted(d.beats)) for n, d in digests.items()} == {
        0: (4, [0, 1]),
        1: (4, [2, 3]),
        2: (4, [4, 5]),
    }
    # The job's store holds each rank's first heartbeat only (published before its node's store was named).
    for r in range(6):
        assert Heartbeat.model_validate_json(job.get(keys.heartbeat(r))).beat == 1
    # The job's closing mark reaches the ranks through their node's store, copied by its agent.
    assert not ranks[3].has_mark(keys.closing)
    job.set(keys.closing, "1")
    agents[1].beat()
    assert ranks[3].has_mark(keys.closing) and not ranks[5].has_mark(keys.closing)


def test_a_node_whose_agent_stopped_is_read_from_the_job_store_where_its_ranks_go_on(job):
    """Node 1's agent stops beating; its rank 3 goes on through the job's store (as a rank whose node's
    store is gone does), rank 2 is silent. Rank 1 reads rank 3's fresh heartbeats there once its copy
    stood still FROZEN_BEATS heartbeats, and rank 2's stays the last copied."""
    ranks = {r: tiered(job.port, r) for r in range(4)}
    layout = {r: NodeLayout(r // LOCAL, 2, r % LOCAL, LOCAL) for r in range(4)}
    for r, s in ranks.items():
        s.layout = layout[r]
    agents = {n: NodeAgent(layout[n * LOCAL], 2, ranks[n * LOCAL], node_store.serve(5.0, fresh=True)) for n in (0, 1)}
    for b in (1, 2, 3):
        for r, store in ranks.items():
            store.publish_heartbeat(heartbeat(r, b))
        for agent in agents.values():
            agent.beat()
    assert {p: hb.beat for p, hb in ranks[1].read_heartbeats([2, 3]).items()} == {2: 3, 3: 3}
    direct = WatchdogStore(dist.TCPStore("127.0.0.1", job.port, is_master=False), Keys("main"), 5.0, 30.0)
    deadline = time.monotonic() + (FROZEN_BEATS + 1) * HEARTBEAT_S
    b = 4
    while time.monotonic() < deadline:  # node 1's agent and rank 2 stand still; rank 3 publishes directly
        direct.publish_heartbeat(heartbeat(3, b))
        for r in (0, 1):
            ranks[r].publish_heartbeat(heartbeat(r, b))
        agents[0].beat()
        got = {p: hb.beat for p, hb in ranks[1].read_heartbeats([2, 3]).items()}
        b += 1
        time.sleep(HEARTBEAT_S)
    assert got == {2: 3, 3: b - 1}, got


def test_status_reads_16384_ranks_from_2048_digests_in_a_handful_of_requests(job):
    world, nodes, now = 16384, 2048, time.time()
    idx = WatchIndex(
        run_id="run", restart="0", session="tier", generation=0, world_size=world, heartbeat_s=5.0,
        peer_timeout_s=30.0, hang_timeout_s=300.0, written=now, nodes=nodes,
    )  # fmt: skip
    job.set(index_key("tier"), idx.model_dump_json())
    keys = idx.keys
    names, values = [], []
    for n in range(nodes):
        beats = {r: encode(heartbeat(r, 7)) for r in range(8 * n, 8 * n + 8) if r != 9000}
        names.append(keys.digest(n))
        values.append(encode(Digest(node=n, beat=7, generation=0, beats=beats)))
    job.multi_set(names, values)
    job.get(names[-1])  # the server took the whole multi_set (a set is not answered; a get on its connection is)
    job.set(keys.heartbeat(9000), encode(heartbeat(9000, 7)))  # rank 9000 went on without its node's store
    reader = StatusReader(dist.TCPStore("127.0.0.1", job.port, is_master=False), 30.0)
    status = read_status(reader, read_index(reader, "tier"), "here")
    reader.close()
    assert [(g.count, g.state) for g in status.groups] == [(16384, "ok")]
    # The index (2); the digests: 2 checks of 1,024 keys, then reads of 64 and of as many as fit
    # READ_BYTES (4 reads of ~4.4 KB digests); rank 9000's look in the job's store (a check and a
    # read); the incident counter's check. Without the tier: 56 (tests/watching/test_views.py).
    assert status.requests == 2 + 2 + 4 + 2 + 1 == 11, status.requests


def test_hostile_values_in_the_tiers_keys_are_refused_and_logged(job, caplog):
    """A node's store address that is none, digests that are no digest, too big, another node's or
    another world's, a member that is no rank: each refused with one log line, nothing raised, and
    the ranks go on (unlinked ones through the job's store)."""
    keys = Keys("main")
    caplog.set_level("WARNING", logger="ncclguard")
    bad = {
        "{not json": "not a valid Digest (value: Invalid JSON",
        "x" * (DIGEST_LIMIT + 1): f"over the {DIGEST_LIMIT}-byte bound of a Digest",  # and under what the store takes
        encode(Digest(node=0, beat=1, generation=0, beats={})): "holds node 0's digest of generation 0",
        encode(Digest(node=1, beat=1, generation=5, beats={})): "holds node 1's digest of generation 5",
        encode(Digest(node=1, beat=1, generation=0, beats={1: "x"})).replace(
            '"beat":1', '"beat":0'
        ): "greater than or equal to 1",
    }
    for value, why in bad.items():
        job.set(keys.digest(1), value)
        job.get(keys.digest(1))  # the server took it (a set is not answered; a get on its connection is)
        reader = WatchdogStore(dist.TCPStore("127.0.0.1", job.port, is_master=False), keys, 5.0, 30.0)
        caplog.clear()
        assert read_digests(reader, keys, [1]) == {}
        (line,) = [r.getMessage() for r in caplog.records]
        assert keys.digest(1) in line and why in line, (why, line)
    # The agent and the ranks go on beside hostile values: node 1's store named as no address, its
    # digest no digest, a member of node 0 that names no rank.
    ranks = {r: tiered(job.port, r) for r in range(4)}
    for r, s in ranks.items():
        s.layout = NodeLayout(r // LOCAL, 2, r % LOCAL, LOCAL)
    job.set(keys.node_addr(1), "no address here")
    job.set(keys.node_addr(0), "127.0.0.1:²")  # a digit that is no decimal: refused, never an int() that raises
    job.get(keys.node_addr(0))
    lone = tiered(job.port, 1)
    lone.layout = NodeLayout(0, 2, 1, LOCAL)
    caplog.clear()
    lone.publish_heartbeat(heartbeat(1, 1))  # looks, refuses the address, publishes to the job's store
    assert lone.near is None and Heartbeat.model_validate_json(job.get(keys.heartbeat(1))).beat == 1
    assert ["'127.0.0.1:²', not the 'host:port'" in r.getMessage() for r in caplog.records] == [True]
    near = node_store.serve(5.0, fresh=True)
    agent = NodeAgent(ranks[0].layout, 2, ranks[0], near)
    near.set(keys.member(1), "rank one")
    caplog.clear()
    for b in (1, 2, 3):
        for r in (0, 2, 3):
            ranks[r].publish_heartbeat(heartbeat(r, b))
        assert agent.beat()
        time.sleep(HEARTBEAT_S)
    assert ranks[0].near is not None and ranks[2].near is None and ranks[3].near is None
    assert set(agent._gather(keys)) == {0}  # rank 1's member key names no rank
    # Ranks 2-3 stayed on the job's store: rank 0 reads them there (node 1's digest is no digest).
    assert {p: hb.beat for p, hb in ranks[0].read_heartbeats([2, 3]).items()} == {2: 3, 3: 3}
    said = [r.getMessage() for r in caplog.records]
    assert sum("'no address here', not the 'host:port'" in m for m in said) == 2, said  # ranks 2 and 3, once each
    assert sum(keys.digest(1) in m for m in said) == 1, said  # once, however often it is read


def test_an_agent_of_many_heavy_ranks_cuts_their_heartbeats_to_fit_one_digest(job):
    """32 ranks a node, each heartbeat ~200 KB of sensors' readings (under its own 256 KiB bound):
    whole, they would make a digest of ~7 MB, over its 4 MiB. The agent sends each without its
    readings, and the digest is read back whole."""
    keys = Keys("main")
    local = 32
    store = WatchdogStore(dist.TCPStore("127.0.0.1", job.port, is_master=False), keys, 5.0, 30.0)
    near = dist.HashStore()
    agent = NodeAgent(NodeLayout(0, 2, 0, local), 16, store, near)
    readings = {f"s{i}": {f"k{j}": "x" * 180 for j in range(60)} for i in range(16)}  # ~190 KB of figures
    for r in range(local):
        text = encode(heartbeat(r, 1, readings=readings))
        assert 150_000 < len(text) <= 256 * 1024
        near.set(keys.member(r), str(r))
        near.set(keys.heartbeat(r), text)
    assert agent.beat()
    raw = job.get(keys.digest(0))
    assert len(raw) <= DIGEST_LIMIT
    (digest,) = read_digests(store, keys, [0]).values()
    beats = {r: Heartbeat.model_validate_json(t) for r, t in digest.beats.items()}
    assert sorted(beats) == list(range(local)) and all(hb.readings is None and hb.beat == 1 for hb in beats.values())


def test_a_lease_on_the_agent_is_won_by_one_claimant_renewed_by_it_and_taken_over_when_it_lapses() -> None:
    near = dist.HashStore()
    assert node_store.claim_agent(near, "10/0", 100.0, 1.5)
    assert not node_store.claim_agent(near, "11/1", 100.5, 1.5)  # held by 10/0 until 101.5
    assert node_store.claim_agent(near, "10/0", 101.0, 1.5)  # renewed: until 102.5
    assert not node_store.claim_agent(near, "11/1", 102.0, 1.5)
    assert node_store.claim_agent(near, "11/1", 102.6, 1.5)  # lapsed: taken over
    assert not node_store.claim_agent(near, "10/0", 102.7, 1.5)  # the old holder back: not its any more
    near.set(node_store.AGENT_KEY, "not a lease")  # junk is taken over, by compare-and-set on what is there
    assert node_store.claim_agent(near, "12/0", 103.0, 1.5)
    assert node_store.AgentLease.model_validate_json(near.get(node_store.AGENT_KEY)).holder == "12/0"
    env = {node_store.LAUNCHER_VAR: "127.0.0.1:29511"}
    assert node_store.launcher_address(env) == "127.0.0.1:29511"
    for bad in ("", "29511", "127.0.0.1:", "127.0.0.1:port", "127.0.0.1:70000", "h:" + "1" * 400):
        assert node_store.launcher_address({node_store.LAUNCHER_VAR: bad}) == "", bad


def test_under_a_launchers_store_one_rank_a_node_runs_the_agent_and_another_takes_over_when_it_stops(job):
    """Two nodes of two ranks, each node's store served as ``ncclguard run``'s launcher serves it
    (a process of its own here: this test's). Every rank links at its first beat and none publishes
    to the job's store; one rank a node holds the agent's lease and only it talks to the job's store.
    Node 1's holder stops: within LEASE_BEATS + 1 beats its node's other rank runs the agent, node 1's
    digest goes on with that rank's fresh heartbeats (its number never going back), and rank 0 reads
    them through its own node's store. The stopped rank, back, finds the lease taken and runs nothing."""
    launchers = {n: node_store.serve(5.0, fresh=True) for n in (0, 1)}
    layout = {r: NodeLayout(r // LOCAL, 2, r % LOCAL, LOCAL) for r in range(4)}
    ranks: dict[int, TieredWatchdogStore] = {}
    for r in range(4):
        client = Counted(dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timedelta(seconds=10)))
        addr = f"127.0.0.1:{launchers[r // LOCAL].port}"
        ranks[r] = TieredWatchdogStore(client, Keys("main"), 5.0, 30.0, layout[r], HEARTBEAT_S, launcher=addr)
        ranks[r].agent = start_agent(ranks[r], 2)
    keys = Keys("main")

    def beat(who: list[int], b: int) -> None:
        for r in who:
            ranks[r].publish_heartbeat(heartbeat(r, b))

    def holders() -> list[int]:
        return [r for r, s in ranks.items() if isinstance(s.agent, LeasedAgent) and s.agent.holding]

    b = 1
    for b in range(1, 4):
        before = {r: s.calls.store.requests for r, s in ranks.items()}
        beat([0, 1, 2, 3], b)
        used = {r: s.calls.store.requests - before[r] for r, s in ranks.items()}
        assert sorted(r // LOCAL for r in holders()) == [0, 1], holders()
        # Only the holders talk to the job's store: 4 requests a beat (5 at the first: the store named).
        assert {r: u for r, u in used.items() if r not in holders()} == {r: 0 for r in range(4) if r not in holders()}
        assert all(used[r] in (4, 5) for r in holders()), used
    assert all(not job.check([keys.heartbeat(r)]) for r in range(4))  # no rank went to the job's store
    first = holders()
    stopped = next(r for r in first if r // LOCAL == 1)
    other = 5 - stopped  # node 1's other rank
    last_digest = read_digests(ranks[0], keys, [1])[1].beat
    taken_after = None
    for i in range(1, 3 * (LEASE_BEATS + 1)):
        b += 1
        beat([r for r in range(4) if r != stopped], b)
        time.sleep(HEARTBEAT_S)
        digest = read_digests(ranks[0], keys, [1])[1]
        assert digest.beat >= last_digest, (digest.beat, last_digest)  # its number never goes back
        last_digest = digest.beat
        if taken_after is None and other in holders():
            taken_after = i
    assert taken_after is not None and taken_after <= LEASE_BEATS + 1, taken_after
    # (The stopped rank still thinks it holds the lease: it has not beaten since.)
    assert sorted(r for r in holders() if r != stopped) == sorted([r for r in first if r != stopped] + [other])
    digest = read_digests(ranks[0], keys, [1])[1]
    assert Heartbeat.model_validate_json(digest.beats[other]).beat == b
    assert Heartbeat.model_validate_json(digest.beats[stopped]).beat == 3  # the stopped rank's last
    # Rank 0 sees node 1's ranks through its own node's store, as the agents copied them in.
    seen = {p: hb.beat for p, hb in ranks[0].read_heartbeats([2, 3]).items()}
    assert seen[other] >= b - 1 and seen[stopped] == 3, seen
    # Back: the stopped rank finds the lease another's and runs nothing.
    beat([stopped], b + 1)
    assert stopped not in holders() and other in holders()
    for s in ranks.values():
        s.close()
