"""The node tier on real ranks (issue 63): two hosts (network namespaces, tests/netns.py), two ranks
each under ``ncclguard run --nnodes 2 --nproc-per-node 2`` (torchrun, with the network set for two
hosts), the tier turned on by its setting
(``NCCLGUARD_WATCHDOG_NODE_TIER=on``) in the script's watchdog, started after the group.

Two launches. tests/workers/node_tier_worker.py ``two_nodes``: the heartbeats go through each node's
store (the one its launcher serves) and one digest a node reaches the job's store; a desync across
the nodes names the skipping rank with its phase and site; host B's ``LOCAL_RANK`` 0 stopped is a
lost rank 2 alone, its node's other rank still linked to its launcher's store and running its
node's agent. And tests/workers/heal_worker.py under ``ncclguard run --ncclguard-restarts 1`` with
``HEAL_KILL_RANK=2``: host B's ``LOCAL_RANK`` 0 SIGKILLed in training, restarted, healed bit-equal,
its node's ranks linked to the same launcher's store before and after.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from netns import ADDR_A, WORKERS, _env, _run_in

pytestmark = pytest.mark.multirank

WORKER = "node_tier_worker.py"
HANG_S, HEARTBEAT_S = 3.0, 0.5  # the worker's
# Hang guard of the whole launch: ~35 s of work (warm-up, a desync's report, a loss after 8 s) and
# two torchruns' start on a loaded 2-core machine; over 3x that.
LAUNCH_GUARD_S = 240


def mark(name: str) -> int:
    """The line of the worker that ends in ``# MARK: <name>``."""
    lines = (WORKERS / WORKER).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# MARK: {name}"))


@pytest.fixture(scope="module")
def tier(hosts):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-tier-"))
    runs = []
    for n, ns in enumerate((hosts.ns_a, hosts.ns_b)):
        argv = [sys.executable, "-m", "ncclguard", "run", "--nnodes", "2", "--node-rank", str(n)]
        argv += [
            "--master-addr",
            ADDR_A,
            "--master-port",
            "29540",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.1",
        ]
        argv += [str(WORKERS / WORKER), "two_nodes"]
        env = _env(NCCLGUARD_TEST_OUT=str(out), OMP_NUM_THREADS="1", NCCLGUARD_WATCHDOG_NODE_TIER="on")
        runs.append((ns, argv, env))
    a, b = _run_in(runs, LAUNCH_GUARD_S)
    got = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4) if (out / f"rank{r}.json").exists()}
    yield a, b, got, out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def healed(hosts):
    """Host B's agent (launch rank 2) SIGKILLed at step 3 of RecoveringStep(heal=True), restarted by its
    supervisor (``--ncclguard-restarts 1``) and healed (tests/workers/heal_worker.py), the watchdog
    started by ``ncclguard run`` with the tier on and a 1 s heartbeat."""
    out = Path(tempfile.mkdtemp(prefix="ncclguard-tier-heal-"))
    runs = []
    for n, ns in enumerate((hosts.ns_a, hosts.ns_b)):
        argv = [sys.executable, "-m", "ncclguard", "run", "--nnodes", "2", "--node-rank", str(n)]
        argv += [
            "--master-addr",
            ADDR_A,
            "--master-port",
            "29542",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.1",
        ]
        argv += ["--ncclguard-restarts", "1", "--ncclguard-incident-dir", str(out / f"inc{n}")]
        argv += [str(WORKERS / "heal_worker.py")]
        env = _env(
            NCCLGUARD_TEST_OUT=str(out),
            OMP_NUM_THREADS="1",
            NCCLGUARD_WATCHDOG_NODE_TIER="on",
            NCCLGUARD_WATCHDOG_HEARTBEAT_S="1",
            HEAL_KILL_RANK="2",
        )
        runs.append((ns, argv, env))
    a, b = _run_in(runs, LAUNCH_GUARD_S)
    got = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4) if (out / f"rank{r}.json").exists()}
    yield a, b, got
    shutil.rmtree(out, ignore_errors=True)


def test_host_bs_agent_killed_is_restarted_healed_bit_equal_and_its_node_linked_again(healed):
    a, b, got = healed
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-4000:] + b.stderr[-4000:]
    assert "restart 1 of 1" in b.stderr + b.stdout, b.stderr[-3000:]
    assert [got[r]["life"] for r in range(4)] == [0, 0, 1, 0]
    # The survivors' rebuild_world and the restarted rank's rejoin_world met through the tier
    # (recovery/_rebuild/meeting.py): a log line a rank, the roster standing for the arrivals.
    assert (a.stderr + b.stderr).count("rebuild: the meeting through the node tier") >= 4, a.stderr[-3000:]
    for r in range(4):
        res = got[r]
        assert res["final"] == [r, 4, 1], (r, res["final"])
        assert (res["equal_across_ranks"], res["equal_to_reference"], res["buffers_equal_to_own_reference"]) == (
            True,
            True,
            True,
        ), r
        # Every rank through its node's store in the rebuilt world: the one its launcher serves
        # (NCCLGUARD_NODE_STORE), which outlived the killed rank.
        commits, meeting = res["tier"]["commits"], res["tier"]["meeting_keys"]
        linked = {k: v for k, v in res["tier"].items() if k not in ("commits", "meeting_keys")}
        # The meetings' keys are gone but their outcomes (recovery/_rebuild/meeting.py forget_meeting),
        # in the job's store and in this node's.
        assert meeting["job"] and all(k.endswith("/v") for k in meeting["job"]), (r, meeting)
        assert meeting["node"] and all(k.endswith("/v") for k in meeting["node"]), (r, meeting)
        assert linked == {
            "linked": True,
            "near_addr": res["tier"]["launcher"],
            "generation": 1,
            "launcher": res["tier"]["launcher"],
        }, (r, res["tier"])
        assert res["tier"]["launcher"].startswith("127.0.0.1:"), res["tier"]
        # Its commits went through the tier (store/tier_round.py): met in its node's store, carried
        # or read there; the first ones, before its watchdog linked, by itself. The restarted rank
        # 2 commits 3 steps, all before its new watchdog links: by itself.
        assert sum(commits.values()) >= 3, (r, commits)  # heal_worker: STEPS - K = 3 steps after the kill
        if r != 2:
            assert commits["carried"] + commits["waited"] >= 1, (r, commits)
    assert got[0]["tier"]["near_addr"] == got[1]["tier"]["near_addr"] != got[2]["tier"]["near_addr"]
    assert got[2]["tier"]["near_addr"] == got[3]["tier"]["near_addr"]
    assert got[2]["healed"][:2] == [True, "receiver"]


def test_heartbeats_go_through_each_nodes_store_and_one_digest_a_node_reaches_the_jobs_store(tier):
    a, b, got, _ = tier
    assert a.returncode == 0, a.stderr[-6000:]
    assert sorted(got) == [0, 1, 2, 3], (sorted(got), a.stderr[-3000:], b.stderr[-3000:])
    for r in range(4):
        state = got[r]["tier"]
        assert state["tiered"] and state["linked"] and state["generation"] == 0, (r, state)
    # Each node's ranks publish to their own node's store: one address per node, two nodes.
    assert got[0]["tier"]["near_addr"] == got[1]["tier"]["near_addr"]
    assert got[2]["tier"]["near_addr"] == got[3]["tier"]["near_addr"]
    job = got[0]["job"]
    # `status` from outside finds the tier named in rank 0's index and reads every rank in the digests.
    assert job["status"] == {"nodes": 2, "states": ["ok", "ok", "ok", "ok"]}, job["status"]
    assert {n: d["ranks"] for n, d in job["digests"].items()} == {"0": [0, 1], "1": [2, 3]}
    assert all(d["beat"] >= 4 for d in job["digests"].values()), job
    # What reached the job's store directly is a rank's first beats, before its node's store was
    # named: each is older than the same rank's heartbeat in its node's digest.
    for r, beat in job["direct_beats"].items():
        assert beat < job["digest_beats"][str(int(r) // 2)][r], job
    # Every rank saw each of its 3 peers (watch_peers 16 > 3) beating, through its node's store.
    for r in range(4):
        assert sorted(int(p) for p in got[r]["peers"]) == sorted({0, 1, 2, 3} - {r}), got[r]["peers"]
        assert all(beat >= 4 for beat in got[r]["peers"].values()), (r, got[r]["peers"])


def merged(out: Path) -> list[dict]:
    """The merged reports of the launch, oldest first."""
    found = sorted(p for p in (out / "incidents").iterdir() if (p / "incident.json").is_file())
    return [json.loads((p / "incident.json").read_text()) for p in found]


def test_a_desync_across_the_nodes_names_the_skipping_rank_with_its_phase_and_site(tier):
    _, _, got, out = tier
    inc = merged(out)[0]
    (finding,) = inc["findings"]
    assert (finding["kind"], finding["op"], finding["phase"]) == ("desync", "all_reduce(SUM)", "train step=4")
    assert finding["site"].endswith(f"{WORKER}:{mark('desync')}")
    assert finding["waiting"] == [0, 1, 2] and inc["victims"] == [0, 1, 2]
    (culprit,) = inc["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["phase"]) == (3, "behind", "eval batch=7")
    assert culprit["site"].endswith(f"{WORKER}:{mark('eval')}")
    assert inc["summary"].startswith("ranks 0-2 waiting in all_reduce(SUM)")
    # Named within the bound (hang_timeout_s + 2 beats), one beat more for the tier's copy.
    hang_to_disk = inc["written_at"] - min(got[r]["desync_start"] for r in (0, 1, 2))
    assert HANG_S <= hang_to_disk, hang_to_disk
    put_down = {r: len(got[r]["after_desync"]) for r in range(4)}
    assert put_down == {0: 1, 1: 1, 2: 1, 3: 1}, put_down
    # The statements went through each node's store: a rank of each host carried its node's (both,
    # or the one filed within the carry's wait, the other then filed by itself), and the report holds
    # every rank's (ncclguard/watching/base/near_filing.py).
    carried = {r: got[r]["carried"] for r in range(4)}
    assert max(carried[0], carried[1]) >= 1 and max(carried[2], carried[3]) >= 1, carried
    assert sum(carried.values()) <= 4 and inc["statements_from"] == [0, 1, 2, 3], (carried, inc["statements_from"])


def test_a_stopped_local_rank_0_is_its_own_rank_lost_and_its_nodes_other_rank_runs_the_agent(tier):
    a, b, got, out = tier
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-4000:] + b.stderr[-4000:]
    lost = merged(out)[1]
    assert [f["kind"] for f in lost["findings"]] == ["lost"]
    assert [c["rank"] for c in lost["culprits"]] == [2] and lost["victims"] == [0, 1, 3]
    assert lost["culprits"][0]["why"] == "lost"
    for r in (0, 1, 3):
        assert [i["kind"] for i in got[r]["after_lost"]] == ["hang", "lost"], (r, got[r]["after_lost"])
    # Host B's store is its launcher's, not rank 2's: rank 3 stays linked to it and runs host B's
    # agent (taken over from rank 2 where rank 2 held the lease).
    after = {r: got[r]["tier_after"] for r in (0, 1, 3)}
    assert all(s["tiered"] and s["linked"] and s["near_addr"] == s["launcher"] for s in after.values()), after
    assert after[3]["agent"] and after[3]["near_addr"] == got[3]["tier"]["near_addr"], after
    # Said in host B's log (node_agent.LeasedAgent), at its start or at the take-over.
    assert "node 1's agent now runs in this rank (local rank 1)" in b.stderr, b.stderr[-3000:]
    # Ranks 0 and 1 still see rank 3 beating (read from the job's store), not rank 2.
    for r in (0, 1):
        peers = got[r]["peers_after"]
        assert peers["3"][1] < PEER_FRESH_S, (r, peers)
        assert peers["2"][1] >= PEER_S, (r, peers)


PEER_S = 8.0  # the worker's peer_timeout_s
# Rank 3's last beat seen this recently: its copy in node 0's store is read from the job's store
# after FROZEN_BEATS (3) beats of 0.5 s; over 2x that.
PEER_FRESH_S = 4.0
