"""Two hosts, no setup: jobs launched as users launch them, one node per network namespace.

Namespace A holds 198.18.0.1 (the master), B 198.18.0.2 (tests/netns.py). In both, this machine's
hostname resolves to 127.0.1.1 (``ip netns exec`` reads /etc/netns/<ns>/hosts over /etc/hosts), as it
does wherever /etc/hosts maps the hostname to a loopback address: left alone, gloo binds it and the job
never starts. Nothing is exported: each rank applies the network plan (docs/environment.md).

- ``ncclguard run --nnodes 2`` trains docs/examples/ddp_hang.py, whose slow rank is on host B; the
  culprit is named, node 0's log holds the merged verdict, and ``ncclguard report`` reads it on node 0
  (the incident directories are not shared), naming the host of each rank's dump;
- the same under ``NCCLGUARD_AUTO=1 torchrun``, host B with its own GLOO_SOCKET_IFNAME (kept);
- an interface that cannot work is refused at start: gloo on loopback in a 2-node job by ``ncclguard run``,
  a name that matches no interface in a rank (an interface with no route to the master is only warned
  about: tests/env/test_netns_no_harm.py).
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest
from netns import ADDR_A, ADDR_B, REPO, _env, _run_in

from ncclguard.cli import main

pytestmark = pytest.mark.multirank

HANG = ["--ncclguard-hang-timeout-s", "4", "--ncclguard-heartbeat-s", "1"]
SCRIPT = [str(REPO / "docs" / "examples" / "ddp_hang.py"), "--steps", "8", "--eval-after", "3", "--eval-s", "8"]
MERGED = r"incident (\S+) merged[^\n]*rank {r} last completed #\d+, now in evaluate\(\) at ddp_hang\.py:\d+"


def _node(launcher: list[str], rank: int, port: int, tail: list[str]) -> list[str]:
    nodes = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", ADDR_A, "--master-port", str(port)]
    return [*launcher, *nodes, "--monitor-interval", "0.1", *tail]


def _plan_lines(text: str) -> dict[int, str]:
    return {int(r): line for r, line in re.findall(r"ncclguard: rank (\d+) on \S+: (network plan[^\n]*)", text)}


def _report(where: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["report", str(where)]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def ran(hosts):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-tworun-"))
    run = [sys.executable, "-m", "ncclguard", "run"]
    runs = [
        (
            ns,
            _node(run, n, 29510, ["--nproc-per-node", "2", *HANG, "--ncclguard-incident-dir", str(out / f"inc{n}")])
            + [*SCRIPT, "--slow-rank", "3"],
            _env(OMP_NUM_THREADS="1"),
        )
        for n, ns in enumerate((hosts.ns_a, hosts.ns_b))
    ]
    yield _run_in(runs, 180), out  # hang guard: 6x the 30 s of a run here
    shutil.rmtree(out, ignore_errors=True)


def test_ncclguard_run_on_two_hosts_with_nothing_exported(hosts, ran, capsys):
    (a, b), out = ran
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert "trained 8 steps on 4 ranks" in a.stdout
    # Each rank set its own host's interface, once, and said why.
    plans = {**_plan_lines(a.stderr), **_plan_lines(b.stderr)}
    assert sorted(plans) == [0, 1, 2, 3]
    for r, ifname in ((0, hosts.if_a), (1, hosts.if_a), (2, hosts.if_b), (3, hosts.if_b)):
        assert f"GLOO_SOCKET_IFNAME={ifname} set: gloo would bind 127.0.1.1 on lo" in plans[r], plans[r]
        assert f"the route to MASTER_ADDR {ADDR_A} goes through {ifname}" in plans[r]
    assert len(re.findall(r"ncclguard: rank 0 on", a.stderr)) == 1
    # The culprit on host B is named in node 0's log and in node 1's, whichever host merged.
    (ident,) = set(re.findall(MERGED.format(r=3), a.stderr))
    assert re.search(MERGED.format(r=3), b.stderr), b.stderr[-3000:]
    # Not shared: each host's directory holds its own ranks' dumps and the merged report.
    here = out / "inc0" / ident
    assert sorted(p.name for p in here.glob("*.json")) == ["incident.json", "rank0.json", "rank1.json"]
    assert sorted(p.name for p in (out / "inc1" / ident).glob("*.json")) == [
        "incident.json",
        "rank2.json",
        "rank3.json",
    ]
    text = _report(here, capsys)
    assert re.search(r"rank 3 \(host:pid \S+\): not in the collective the others wait in", text), text
    assert "main thread in evaluate()" in text and "VICTIMS (waiting for the culprits): ranks 0-2" in text
    assert f"ranks 0-1 on {socket.gethostname()} ({ADDR_A}); ranks 2-3 on {socket.gethostname()} ({ADDR_B})" in text


@pytest.fixture(scope="module")
def auto(hosts):
    out = Path(tempfile.mkdtemp(prefix="ncclguard-twoauto-"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    watch = dict(
        NCCLGUARD_AUTO="1",
        NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S="4",
        NCCLGUARD_WATCHDOG_HEARTBEAT_S="1",
        OMP_NUM_THREADS="1",
    )
    runs = [
        (
            hosts.ns_a,
            _node(torchrun, 0, 29511, [*SCRIPT, "--slow-rank", "1"]),
            _env(NCCLGUARD_WATCHDOG_INCIDENT_DIR=str(out / "inc0"), **watch),
        ),
        # Host B's user exported the interface himself: it is kept (and checked).
        (
            hosts.ns_b,
            _node(torchrun, 1, 29511, [*SCRIPT, "--slow-rank", "1"]),
            _env(NCCLGUARD_WATCHDOG_INCIDENT_DIR=str(out / "inc1"), GLOO_SOCKET_IFNAME=hosts.if_b, **watch),
        ),
    ]
    yield _run_in(runs, 150), out
    shutil.rmtree(out, ignore_errors=True)


def test_auto_under_torchrun_keeps_the_users_interface(hosts, auto, capsys):
    (a, b), out = auto
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert "trained 8 steps on 2 ranks" in a.stdout
    assert f"GLOO_SOCKET_IFNAME={hosts.if_a} set:" in _plan_lines(a.stderr)[0]
    assert f"GLOO_SOCKET_IFNAME={hosts.if_b} kept: set by the user" in _plan_lines(b.stderr)[1]
    (ident,) = set(re.findall(MERGED.format(r=1), a.stderr))
    text = _report(out / "inc0" / ident, capsys)
    assert "now in evaluate() at" in (out / "inc0" / ident / "summary.txt").read_text()
    assert re.search(r"rank 1 \(host:pid \S+\): not in the collective the others wait in", text), text


def test_an_interface_that_cannot_reach_the_master_is_refused_at_start(hosts):
    run = _node([sys.executable, "-m", "ncclguard", "run"], 1, 29512, ["--nproc-per-node", "1", *SCRIPT])
    rank = [sys.executable, "-c", "import torch.distributed as d; d.init_process_group('gloo')"]
    where = dict(MASTER_ADDR=ADDR_A, MASTER_PORT="29513", RANK="1", WORLD_SIZE="2", LOCAL_RANK="0")
    launcher, in_rank = _run_in(
        [
            (hosts.ns_b, run, _env(GLOO_SOCKET_IFNAME="lo")),
            (hosts.ns_b, rank, _env(NCCLGUARD_AUTO="1", NCCL_SOCKET_IFNAME="=eth9", **where)),
        ],
        90,
    )
    routes = f"routes here: 198.18.0.0/30 dev {hosts.if_b}"
    assert launcher.returncode == 2, launcher.stderr[-3000:]
    assert "ncclguard run: GLOO_SOCKET_IFNAME=lo: lo holds only loopback addresses, which the other nodes of this " in (
        launcher.stderr
    )
    assert routes in launcher.stderr
    assert in_rank.returncode == 1
    assert "ncclguard.errors.BadInterface: NCCL_SOCKET_IFNAME==eth9 matches no interface of this host" in in_rank.stderr
    assert routes in in_rank.stderr
