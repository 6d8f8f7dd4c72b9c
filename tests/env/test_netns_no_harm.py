"""The network plan never refuses a setting that can work, on two network-namespace hosts.

Namespace A holds 198.18.0.1 (the master), B 198.18.0.2, joined by a veth pair (tests/netns.py); a
second veth pair joins them on a fabric network of its own, ``fab0`` on both sides (198.19.0.1/24
and 198.19.0.2/24): no route from B's fab0 to the master. This machine's hostname resolves to
127.0.1.1 in both, and the alias ``MASTER`` (below) resolves to 127.0.1.1 on A, to 198.18.0.1 on B,
as a cluster's DNS and the master's own /etc/hosts do. Every job is ``ncclguard run --nnodes 2
--nproc-per-node 1`` on each host running tests/workers/launching_netns_worker.py (one gloo
all_reduce; each rank records the sum and its TCP connections). Four launches at once:

- ``NCCL_SOCKET_IFNAME=fab0`` on both hosts, as clusters set it for their fabric: the job runs (exit
  0); host B's launcher and rank warn that fab0 has no route to MASTER_ADDR and keep it;
- ``GLOO_SOCKET_IFNAME=fab0`` too: the job runs, and gloo's connections between the ranks are
  between the fab0 addresses (gloo connects to the peers, never to MASTER_ADDR);
- ``--master-addr MASTER``: on A it resolves to 127.0.1.1; the plan on A sets gloo's interface to
  A's veth (not loopback) and the job runs;
- ``NCCL_SOCKET_IFNAME=fab9`` on host B alone: refused at start (exit 2), saying what to set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from netns import ADDR_A, REPO, _env, _ip, _run_in, hosts_files

pytestmark = pytest.mark.multirank

WORKER = str(REPO / "tests" / "workers" / "launching_netns_worker.py")
FAB_A, FAB_B = "198.19.0.1", "198.19.0.2"
MASTER = f"ncgmaster{os.getpid() % 100000}"
GUARD_S = 240  # hang guard: 4 jobs of 2 ranks importing torch at once on 2 shared cores take 30-60 s here


@pytest.fixture(scope="module")
def fabric(pair):
    """The pair with fab0 on both sides, and the hosts files (the hostname and the alias MASTER)."""
    tag = f"ncf{os.getpid() % 100000}"
    _ip("link", "add", f"{tag}a", "netns", pair.ns_a, "type", "veth", "peer", "name", f"{tag}b", "netns", pair.ns_b)
    for ns, ifname, addr in ((pair.ns_a, f"{tag}a", FAB_A), (pair.ns_b, f"{tag}b", FAB_B)):
        _ip("link", "set", ifname, "name", "fab0", ns=ns)
        _ip("addr", "add", f"{addr}/24", "dev", "fab0", ns=ns)
        _ip("link", "set", "fab0", "up", ns=ns)
    with hosts_files({pair.ns_a: f"127.0.1.1 {MASTER}\n", pair.ns_b: f"{ADDR_A} {MASTER}\n"}):
        yield pair


def _node(rank: int, port: int, master: str = ADDR_A) -> list[str]:
    nodes = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", master, "--master-port", str(port)]
    return [
        sys.executable,
        "-m",
        "ncclguard",
        "run",
        *nodes,
        "--nproc-per-node",
        "1",
        "--monitor-interval",
        "0.1",
        WORKER,
    ]


@pytest.fixture(scope="module")
def ran(fabric):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-noharm-"))
    jobs = {
        "nccl-fab": (29531, ADDR_A, {"NCCL_SOCKET_IFNAME": "fab0"}),
        "gloo-fab": (29532, ADDR_A, {"NCCL_SOCKET_IFNAME": "fab0", "GLOO_SOCKET_IFNAME": "fab0"}),
        "master-lo": (29533, MASTER, {}),
    }
    runs = []
    for name, (port, master, extra) in jobs.items():
        (out / name).mkdir()
        for n, ns in enumerate((fabric.ns_a, fabric.ns_b)):
            env = _env(OMP_NUM_THREADS="1", NCCLGUARD_TEST_OUT=str(out / name), **extra)
            runs.append((ns, _node(n, port, master), env))
    runs.append((fabric.ns_b, _node(1, 29534), _env(NCCL_SOCKET_IFNAME="fab9")))
    done = _run_in(runs, GUARD_S)
    names = [*(f"{j}/{n}" for j in jobs for n in ("a", "b")), "refused/b"]
    yield dict(zip(names, done, strict=True)), out
    shutil.rmtree(out, ignore_errors=True)


def _ranks(out: Path, job: str) -> list[dict]:
    return [json.loads((out / job / f"rank{r}.json").read_text()) for r in (0, 1)]


def _ok(ran: dict, job: str) -> None:
    for side in ("a", "b"):
        run = ran[f"{job}/{side}"]
        assert run.returncode == 0, f"{job}/{side}: {run.stderr[-4000:]}"


def test_a_fabric_nccl_interface_with_no_route_to_the_master_runs(ran) -> None:
    ran, out = ran
    _ok(ran, "nccl-fab")
    assert [r["sum"] for r in _ranks(out, "nccl-fab")] == [3.0, 3.0]
    b = ran["nccl-fab/b"].stderr
    assert f"ncclguard run: warning: NCCL_SOCKET_IFNAME=fab0: no route to MASTER_ADDR {ADDR_A} through fab0 here" in b
    assert "NCCL never connects to MASTER_ADDR (only the c10d store does)" in b
    assert "NCCL_SOCKET_IFNAME=fab0 kept: set by the user (kept despite a warning: see below)" in b  # the rank's line
    assert "warning" not in ran["nccl-fab/a"].stderr.lower()  # on the master's host, its own address: no doubt


def test_gloo_on_the_fabric_connects_the_peers_there(ran) -> None:
    ran, out = ran
    _ok(ran, "gloo-fab")
    ranks = _ranks(out, "gloo-fab")
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in ranks] == ["fab0", "fab0"]
    # gloo's pairs: rank 0 on A's fab0, rank 1 on B's; only the store's connections use 198.18.0.x.
    assert [FAB_A, FAB_B] in ranks[0]["links"] and [FAB_B, FAB_A] in ranks[1]["links"], ranks
    assert "ncclguard run: warning: GLOO_SOCKET_IFNAME=fab0: no route to MASTER_ADDR" in ran["gloo-fab/b"].stderr


def test_the_master_host_on_loopback_binds_the_interface_the_others_reach(ran, fabric) -> None:
    ran, out = ran
    _ok(ran, "master-lo")
    assert [r["sum"] for r in _ranks(out, "master-lo")] == [3.0, 3.0]
    line = re.search(r"ncclguard: rank 0 on \S+: network plan[^\n]*", ran["master-lo/a"].stderr)
    assert line is not None, ran["master-lo/a"].stderr[-3000:]
    assert f"GLOO_SOCKET_IFNAME={fabric.if_a} set: gloo would bind 127.0.1.1 on lo" in line.group(0)
    assert f"MASTER_ADDR {MASTER} resolves to 127.0.1.1, a loopback address, on this host (the master's)" in line.group(
        0
    )


def test_a_name_that_matches_no_interface_is_refused_saying_what_to_set(ran, fabric) -> None:
    ran, _ = ran
    run = ran["refused/b"]
    assert run.returncode == 2, run.stderr[-3000:]
    assert "ncclguard run: NCCL_SOCKET_IFNAME=fab9 matches no interface of this host." in run.stderr
    assert f"Interfaces here: lo, {fabric.if_b}, fab0" in run.stderr or "Interfaces here: lo, fab0" in run.stderr
    assert "Set NCCL_SOCKET_IFNAME to interfaces of this host that the other nodes reach" in run.stderr
    assert f"e.g. NCCL_SOCKET_IFNAME=={fabric.if_b})" in run.stderr
