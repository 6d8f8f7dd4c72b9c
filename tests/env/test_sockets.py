"""The socket plan's rule (ncclguard/env/sockets.py) on made-up hosts, the route-table parsers, and the
off switch and the early refusal of ``ncclguard run``. No rank is launched: tests/env/test_netns_run.py
runs the plan on two hosts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ncclguard.cli import main
from ncclguard.cli.autostart import before_init, peer_gone_line, plan_line
from ncclguard.cli.run import plan
from ncclguard.env.hostview import check_interfaces, parse_ip_routes, parse_proc_routes, plan_sockets, prepare_sockets
from ncclguard.env.sockets import (
    HostView,
    TableRoute,
    check_user,
    decide,
    gloo_default,
    nccl_default,
    plan_enabled,
    reaches,
)
from ncclguard.errors import BadInterface
from ncclguard.incidents.model import Heartbeat

# Host B of the issue: the hostname resolves to 127.0.1.1, one veth to the master's subnet.
HOST_B = HostView(
    hostname="vm",
    hostname_addresses=["127.0.1.1"],
    interfaces={"lo": ["127.0.0.1", "::1"], "veth0": ["198.18.0.2", "fe80::1"]},
    routes=[TableRoute(network="198.18.0.0/30", interface="veth0")],
)
# A cluster node: the hostname resolves to the docker bridge's address, eth0 holds the default route.
DOCKER = HostView(
    hostname="node7",
    hostname_addresses=["172.17.0.1"],
    interfaces={
        "lo": ["127.0.0.1"],
        "docker0": ["172.17.0.1"],
        "eth0": ["10.0.0.7"],
        "ib0": ["192.168.7.7"],
    },
    routes=[
        TableRoute(network="0.0.0.0/0", interface="eth0", gateway="10.0.0.1"),
        TableRoute(network="10.0.0.0/24", interface="eth0"),
        TableRoute(network="172.17.0.0/16", interface="docker0"),
        TableRoute(network="192.168.7.0/24", interface="ib0"),
    ],
)


def _plan(environ: dict[str, str], view: HostView, address: str | None, interface: str | None):
    return decide(environ, view, master=address, address=address, interface=interface)


def test_the_libraries_defaults_as_modelled() -> None:
    assert gloo_default(HOST_B) == ("127.0.1.1", "lo")  # 127/8 binds on lo
    assert gloo_default(DOCKER) == ("172.17.0.1", "docker0")
    unresolved = HOST_B.model_copy(update={"hostname_addresses": ["203.0.113.5"]})  # not this host's
    assert gloo_default(unresolved) == ("127.0.0.1", "lo")
    assert nccl_default(HOST_B) == "veth0"  # neither docker nor lo
    assert nccl_default(DOCKER) == "ib0"  # ib first
    assert nccl_default(HOST_B, family=6) == "lo"  # veth0 has only a link-local IPv6 address
    bridge_only = HostView(interfaces={"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"]})
    assert nccl_default(bridge_only) == "docker0"


def test_routes_and_local_addresses_reach_the_master() -> None:
    assert reaches("veth0", "198.18.0.1", HOST_B) and not reaches("lo", "198.18.0.1", HOST_B)
    assert reaches("eth0", "10.9.9.9", DOCKER)  # the default route
    assert not reaches("docker0", "10.9.9.9", DOCKER)
    # The master's own host: every interface reaches its own address.
    assert reaches("lo", "198.18.0.2", HOST_B) and reaches("lo", "127.0.0.1", HOST_B)


def test_set_only_where_the_default_binds_loopback_or_unroutable() -> None:
    p = _plan({}, HOST_B, "198.18.0.1", "veth0")
    assert p.to_set() == {"GLOO_SOCKET_IFNAME": "veth0"}
    assert p.lines() == [
        "GLOO_SOCKET_IFNAME=veth0 set: gloo would bind 127.0.1.1 on lo (hostname vm resolves to it): a loopback "
        "address; the route to MASTER_ADDR 198.18.0.1 goes through veth0",
        "NCCL_SOCKET_IFNAME left unset: NCCL would pick veth0, which reaches MASTER_ADDR 198.18.0.1",
    ]
    # The docker bridge has no route to the master; NCCL's ib0 neither: both set, NCCL's exactly.
    p = _plan({}, DOCKER, "10.0.0.1", "eth0")
    assert p.to_set() == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert "an interface with no route to 10.0.0.1" in p.lines()[0]
    # A master on ib0's subnet: NCCL's default reaches it, gloo's bridge does not.
    assert _plan({}, DOCKER, "192.168.7.1", "ib0").to_set() == {"GLOO_SOCKET_IFNAME": "ib0"}
    # One host, loopback master: the defaults are fine, nothing is set.
    assert _plan({}, HOST_B, "127.0.0.1", "lo").to_set() == {}
    # No master, or no route to it: the defaults are left.
    for address, interface in ((None, None), ("203.0.113.9", None)):
        p = _plan({}, HOST_B, address, interface)
        assert p.to_set() == {} and {c.action for c in p.choices} == {"left"}


def test_the_users_interface_is_kept_or_refused_with_the_routes() -> None:
    p = _plan({"GLOO_SOCKET_IFNAME": "veth0", "NCCL_SOCKET_IFNAME": "^docker,lo"}, HOST_B, "198.18.0.1", "veth0")
    assert p.refusal is None and p.to_set() == {}
    assert [(c.action, c.value) for c in p.choices] == [("kept", "veth0"), ("kept", "^docker,lo")]
    p = _plan({"GLOO_SOCKET_IFNAME": "eth9"}, HOST_B, "198.18.0.1", "veth0")
    assert p.refusal == (
        "GLOO_SOCKET_IFNAME=eth9 names no interface of this host (eth9). Interfaces here: lo, veth0; routes here: "
        "198.18.0.0/30 dev veth0. Set GLOO_SOCKET_IFNAME to interfaces of this host that the other nodes reach (a "
        "comma list of exact names: e.g. GLOO_SOCKET_IFNAME=veth0), or unset GLOO_SOCKET_IFNAME and ncclguard picks "
        "the one that routes to MASTER_ADDR."
    )
    assert p.choices[0].action == "kept" and p.to_set() == {}  # refused, never replaced
    # Two nodes: gloo on loopback cannot work (refused); NCCL's interface without a route is only warned about
    # (tests/env/test_sockets_no_harm.py has the rule in full).
    two = {"GLOO_SOCKET_IFNAME": "veth0,lo", "NCCL_SOCKET_IFNAME": "=lo", "GROUP_WORLD_SIZE": "2"}
    p = _plan(two, HOST_B, "198.18.0.1", "veth0")
    assert p.refusal is not None
    assert p.refusal.startswith("GLOO_SOCKET_IFNAME=veth0,lo: lo holds only loopback addresses")
    assert "NCCL_SOCKET_IFNAME" not in p.refusal
    assert p.warnings[0].startswith("NCCL_SOCKET_IFNAME==lo: no route to MASTER_ADDR 198.18.0.1 through lo here")
    # NCCL prefixes: 'eth' matches eth0, which routes; 'docker' matches only the bridge: kept, not refused.
    assert check_user("NCCL_SOCKET_IFNAME", "eth,ib", "10.0.0.1", DOCKER) is None
    assert check_user("NCCL_SOCKET_IFNAME", "docker", "10.0.0.1", DOCKER) is None
    assert "matches no interface" in (check_user("NCCL_SOCKET_IFNAME", "=eth", "10.0.0.1", DOCKER) or "")
    # No master known: only existence is checked.
    assert check_user("GLOO_SOCKET_IFNAME", "docker0", None, DOCKER) is None


def test_the_switch_turns_the_plan_off() -> None:
    assert plan_enabled({}) and plan_enabled({"NCCLGUARD_NET_PLAN": "1"})
    assert not plan_enabled({"NCCLGUARD_NET_PLAN": "0"}) and not plan_enabled({"NCCLGUARD_NET_PLAN": " Off"})
    p = _plan({"NCCLGUARD_NET_PLAN": "0", "GLOO_SOCKET_IFNAME": "eth9"}, HOST_B, "198.18.0.1", "veth0")
    assert (p.enabled, p.refusal, p.to_set()) == (False, None, {})
    assert {c.action for c in p.choices} == {"off"}


def test_route_tables_parsed() -> None:
    text = (
        '[{"dst":"default","gateway":"192.0.2.1","dev":"eth0","flags":[]},'
        '{"dst":"192.0.2.0/24","dev":"eth0","protocol":"kernel","scope":"link","prefsrc":"192.0.2.2","flags":[]},'
        '{"type":"unreachable","dst":"203.0.113.0/24","flags":[]},'
        '{"type":"blackhole","dst":"198.51.100.0/24","dev":"lo","flags":[]}]'
    )
    assert [r.text() for r in parse_ip_routes(text, 4)] == ["default via 192.0.2.1 dev eth0", "192.0.2.0/24 dev eth0"]
    assert parse_ip_routes('[{"dst":"default","gateway":"fd00::1","dev":"eth0"}]', 6)[0].network == "::/0"
    with pytest.raises(ValueError, match="no list"):
        parse_ip_routes('{"dst": "default"}', 4)
    proc = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "eth1\t000A0A0A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"  # not up
    )
    if sys.byteorder == "little":
        assert [r.text() for r in parse_proc_routes(proc)] == [
            "default via 192.0.2.1 dev eth0",
            "192.0.2.0/24 dev eth0",
        ]


def test_this_host_plan_and_the_early_refusal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCLGUARD_NET_PLAN"):
        monkeypatch.delenv(name, raising=False)
    # A loopback master on one host: nothing to set, nothing printed.
    env: dict[str, str] = {"MASTER_ADDR": "127.0.0.1"}
    p = prepare_sockets(environ=env)
    assert p.interface == "lo" and p.to_set() == {} and env == {"MASTER_ADDR": "127.0.0.1"}
    assert plan_sockets({"GLOO_SOCKET_IFNAME": "lo"}, master_addr="127.0.0.1").refusal is None
    check_interfaces("127.0.0.1:29500", {"GLOO_SOCKET_IFNAME": "lo"})
    with pytest.raises(BadInterface, match=r"GLOO_SOCKET_IFNAME=nosuch0 names no interface of this host.*routes here"):
        prepare_sockets(environ={"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "nosuch0"})
    with pytest.raises(BadInterface, match="NCCL_SOCKET_IFNAME==nosuch0 matches no interface"):
        check_interfaces("[::1]:29500", {"NCCL_SOCKET_IFNAME": "=nosuch0"})
    check_interfaces("127.0.0.1", {"NCCL_SOCKET_IFNAME": "=nosuch0", "NCCLGUARD_NET_PLAN": "0"})  # off: not checked
    # ncclguard run: refused before any rank starts (exit 2), and the option that turns the plan off.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    assert main(["run", "--standalone", "--nproc-per-node", "2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncclguard run: GLOO_SOCKET_IFNAME=nosuch0 names no interface of this host") and "lo" in err
    job = plan(["--ncclguard-no-net-plan", "--standalone", "train.py"], cwd=tmp_path)
    assert job.env["NCCLGUARD_NET_PLAN"] == "0"
    # The start-up hook leaves a restarted rank's stand-in (fake backend) alone.
    assert before_init("fake", None) is None
    line = plan_line(_plan({}, HOST_B, "198.18.0.1", "veth0"), "3", "vm")
    assert line.startswith("ncclguard: rank 3 on vm: network plan to reach MASTER_ADDR 198.18.0.1: GLOO_SOCKET_IFNAME=")
    assert line.endswith("(off: NCCLGUARD_NET_PLAN=0, or ncclguard run --ncclguard-no-net-plan)")


def test_gloos_lost_peer_errors_name_the_host() -> None:
    beats = {
        r: Heartbeat(
            rank=r,
            host="nodeB",
            address="198.18.0.2",
            pid=1,
            beat=1,
            time=0.0,
            phase="",
            site="",
            last_seq={},
            last_completed={},
            inflight=[],
        )
        for r in (2, 3)
    }
    closed = "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [198.18.0.2]:55496. This is typically"
    assert peer_gone_line(closed, 0, beats, "198.18.0.1") == (
        "ncclguard: rank 0: the host at 198.18.0.2 (nodeB: ranks 2-3) is gone: its processes died or its link is "
        "down; this rank's collective failed on it (gloo's error above)"
    )
    reset = "[/gloo/transport/tcp/pair.cc:537] Read error [198.18.0.1]:54146: Connection reset by peer. This is"
    line = peer_gone_line(reset, 2, beats, "198.18.0.1")
    assert line == (
        "ncclguard: rank 2: the host at 198.18.0.1, the host of the job's store (MASTER_ADDR), is gone: its processes "
        "died or its link is down; this rank's collective failed on it (gloo's error above)"
    )
    assert peer_gone_line("Timed out waiting 1800000ms for recv operation to complete", 0, beats, None) is None
