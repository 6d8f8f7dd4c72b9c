"""A real two-host network: two network namespaces joined by a veth pair.

Namespace A holds 198.18.0.1/30, namespace B 198.18.0.2/30 (198.18.0.0/15 is the benchmarking
range of RFC 2544; these addresses exist only inside the two namespaces, which have no other
interface than loopback, so nothing can leave them). The tests detect the veth from each side,
run a 2-rank gloo job across the pair with the applied GLOO_SOCKET_IFNAME, and run
`doctor --check-ranks` as a two-node torchrun job, one node per namespace. Everything made is
removed at the end; without root (or without `ip netns`) the module is skipped and says why.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from netns import ADDR_A, ADDR_B, WORKERS, _env, _run_in, run_two_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def detected(pair):
    worker = [sys.executable, str(WORKERS / "netenv_worker.py"), "detect"]
    doctor = [sys.executable, "-m", "ncclguard", "doctor", "--json", "--master-addr", ADDR_A, "--pg-timeout", "3600"]
    a, b = _run_in(
        [(pair.ns_a, [*worker, ADDR_B, ADDR_A, "203.0.113.9", "-"], _env()), (pair.ns_b, doctor, _env())], 120
    )
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stdout + b.stderr
    return json.loads(a.stdout), json.loads(b.stdout)


def test_detect_finds_the_veth_from_each_side(pair, detected):
    plans, doctor_b = detected
    to_b = plans[ADDR_B]
    assert (to_b["interface"], to_b["local_address"], to_b["family"]) == (pair.if_a, ADDR_A, "ipv4")
    assert to_b["route"] == {
        "destination": ADDR_B,
        "interface": pair.if_a,
        "source": ADDR_A,
        "gateway": None,
        "kind": "unicast",
        "method": "ip -j route get",
    }
    assert to_b["environment"]["NCCL_SOCKET_IFNAME"] == f"={pair.if_a}"
    assert to_b["environment"]["GLOO_SOCKET_IFNAME"] == pair.if_a
    assert to_b["warnings"] == []
    # The doctor in namespace B, asked about A.
    plan_b = doctor_b["plan"]
    assert (plan_b["interface"], plan_b["local_address"]) == (pair.if_b, ADDR_B)
    assert doctor_b["ok"] is True and doctor_b["warnings"] == []


def test_own_address_inside_the_namespace_is_the_veth(pair, detected):
    own = detected[0][ADDR_A]
    assert (own["route"]["kind"], own["route"]["interface"]) == ("local", "lo")
    assert (own["interface"], own["local_address"]) == (pair.if_a, ADDR_A)


def test_unreachable_and_no_default_route_are_warnings(detected):
    plans = detected[0]
    off = plans["203.0.113.9"]
    assert off["interface"] is None and "GLOO_SOCKET_IFNAME" not in off["environment"]
    assert off["warnings"] == [
        "203.0.113.9 is unreachable from this host (no route to 203.0.113.9: RTNETLINK answers: Network is "
        "unreachable); check the address given and the routing table."
    ]
    probe = plans["-"]
    assert probe["interface"] is None
    assert probe["warnings"] == [
        "this host has no default route; set MASTER_ADDR or pass --master-addr to pick the peer."
    ]


def test_gloo_job_across_the_namespaces(pair):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-netns-"))
    argv = [sys.executable, str(WORKERS / "netenv_worker.py"), "netns"]
    ranks = run_two_ranks(pair, argv, out, port=29500, timeout_s=120)
    # Both ranks' output on a failure: one rank's error names the peer that closed, not why it did.
    said = "\n".join(f"--- rank {n} (rc {r.returncode}):\n{r.stdout}{r.stderr}" for n, r in enumerate(ranks))
    assert [r.returncode for r in ranks] == [0, 0], said
    res = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r, ifname, addr in ((0, pair.if_a, ADDR_A), (1, pair.if_b, ADDR_B)):
        plan = res[r]["init"]["plan"]
        assert (plan["target_source"], plan["interface"], plan["local_address"]) == ("MASTER_ADDR", ifname, addr)
        assert res[r]["gloo_ifname"] == ifname
        assert res[r]["init"]["applied"]["GLOO_SOCKET_IFNAME"] == ifname
        assert res[r]["sum"] == [3.0, 3.0, 3.0, 3.0]
        assert (res[r]["init"]["timeout_s"], res[r]["subgroup_timeout"]) == (20.0, 20.0)
    # Rank 0 holds MASTER_ADDR itself: the kernel says `local ... dev lo`, the plan says its veth.
    assert res[0]["init"]["plan"]["route"]["kind"] == "local"
    shutil.rmtree(out, ignore_errors=True)


def test_check_ranks_as_a_two_node_torchrun_job(pair):
    def node(rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={rank}",
            "--nproc-per-node=1",
            f"--master-addr={ADDR_A}",
            "--master-port=29501",
            "--monitor-interval=0.1",
            "-m",
            "ncclguard",
            "doctor",
            "--check-ranks",
            "--json",
            "--pg-timeout",
            "3600",
            "--timeout",
            "30",
        ]

    a, b = _run_in([(pair.ns_a, node(0), _env()), (pair.ns_b, node(1), _env())], 150)
    # Each host detects its own veth: the ranks disagree on the interface name, so both exit 1.
    assert a.returncode != 0 and b.returncode != 0
    report = json.loads(a.stdout)
    ranks = report["ranks"]
    assert (ranks["world_size"], ranks["all_reduce_ok"]) == (2, True)
    assert {r: p["plan"]["interface"] for r, p in ranks["reports"].items()} == {"0": pair.if_a, "1": pair.if_b}
    assert ranks["disagreements"] == [
        f"ranks disagree on the interface: {pair.if_a} on rank 0; {pair.if_b} on rank 1. One exported "
        "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME cannot name them all: let ncclguard.init_process_group apply each "
        "rank's own plan, or give NCCL a prefix list that matches every one."
    ]
    assert b.stdout.strip() == ""  # only rank 0 prints
