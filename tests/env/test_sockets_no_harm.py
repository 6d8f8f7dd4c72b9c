"""The network plan never refuses a setting that can work (issue 45, "do no harm"), as pure logic.

No process is launched: made-up hosts (ncclguard/env/hostmodel.py), iproute2's JSON as text.
tests/env/test_netns_no_harm.py runs the same scenarios on two network-namespace hosts.

- a worker whose ``NCCL_SOCKET_IFNAME=fab0`` is a fabric NIC with no route to ``MASTER_ADDR``: kept,
  with a warning (NCCL never connects to ``MASTER_ADDR``); gloo's own interface the same, unless it is
  loopback on a job of several nodes (the peers cannot reach it): refused;
- a name that matches no interface (NCCL's syntax: comma lists, ``^``, ``=``, ``name:port``) is
  refused, saying what to set;
- multipath routes (``nexthops``) and policy routes (``ip rule``) carry traffic where the code reads
  routes;
- the master's own host, ``MASTER_ADDR`` resolving to 127.0.1.1 on a job of several nodes, is not
  left on loopback: the interface the other nodes reach is set, or a warning says why none is.
"""

from __future__ import annotations

import ipaddress
import json
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.env.envvars import nccl_ifname_matches
from ncclguard.env.hostview import parse_ip_routes, parse_ip_rules, parse_proc_tcp
from ncclguard.env.routes import parse_ip_json, parse_ip_text
from ncclguard.env.sockets import (
    HostView,
    RouteRule,
    TableRoute,
    assess_user,
    decide,
    nodes_of,
    outward,
    reaches,
)

MASTER = "198.18.0.1"
# The worker of the issue: veth0 on the master's subnet, fab0 a fabric NIC on a subnet of its own.
WORKER = HostView(
    hostname="w1",
    hostname_addresses=["127.0.1.1"],
    interfaces={"lo": ["127.0.0.1", "::1"], "veth0": ["198.18.0.2"], "fab0": ["198.19.0.2"]},
    routes=[
        TableRoute(network="198.18.0.0/30", interface="veth0"),
        TableRoute(network="198.19.0.0/24", interface="fab0"),
    ],
)
# The master's host: its hostname (MASTER_ADDR) resolves to 127.0.1.1, as Debian's /etc/hosts has it.
MASTER_HOST = HostView(
    hostname="m0",
    hostname_addresses=["127.0.1.1"],
    interfaces={"lo": ["127.0.0.1"], "veth0": [MASTER]},
    routes=[TableRoute(network="198.18.0.0/30", interface="veth0")],
)


def _plan(environ: dict[str, str], view: HostView, address: str, interface: str | None, nodes: int | None = None):
    return decide(environ, view, master=address, address=address, interface=interface, nodes=nodes)


def test_a_fabric_nic_with_no_route_to_the_master_is_kept_with_a_warning() -> None:
    p = _plan({"NCCL_SOCKET_IFNAME": "fab0"}, WORKER, MASTER, "veth0", nodes=2)
    assert p.refusal is None
    assert [(c.variable, c.action, c.value) for c in p.choices] == [
        ("GLOO_SOCKET_IFNAME", "set", "veth0"),
        ("NCCL_SOCKET_IFNAME", "kept", "fab0"),
    ]
    (warning,) = p.warnings
    assert warning.startswith(f"NCCL_SOCKET_IFNAME=fab0: no route to MASTER_ADDR {MASTER} through fab0 here; kept")
    assert "NCCL never connects to MASTER_ADDR (only the c10d store does)" in warning
    # gloo's own fabric interface: kept too (gloo connects to the peers' gloo addresses, not to the master).
    p = _plan({"GLOO_SOCKET_IFNAME": "fab0", "NCCL_SOCKET_IFNAME": "=fab0"}, WORKER, MASTER, "veth0", nodes=2)
    assert p.refusal is None and p.to_set() == {}
    assert [w.split(":")[0] for w in p.warnings] == ["GLOO_SOCKET_IFNAME=fab0", "NCCL_SOCKET_IFNAME==fab0"]
    assert "gloo connects to the other ranks' own GLOO_SOCKET_IFNAME addresses, never to MASTER_ADDR" in p.warnings[0]
    # A route to the master through it: no warning.
    assert _plan({"NCCL_SOCKET_IFNAME": "veth"}, WORKER, MASTER, "veth0", nodes=2).warnings == []


def test_gloo_on_loopback_is_refused_only_where_it_cannot_work() -> None:
    p = _plan({"GLOO_SOCKET_IFNAME": "lo"}, WORKER, MASTER, "veth0", nodes=2)
    assert p.refusal is not None
    assert p.refusal.startswith(
        "GLOO_SOCKET_IFNAME=lo: lo holds only loopback addresses, which the other nodes of this 2-node job cannot "
        "reach (gloo connects every rank to the others at that address). Interfaces here: lo, veth0, fab0;"
    )
    assert "Set GLOO_SOCKET_IFNAME to interfaces of this host that the other nodes reach" in p.refusal
    assert "e.g. GLOO_SOCKET_IFNAME=veth0)" in p.refusal  # the one that routes to the master
    # One node (a store elsewhere, every rank here), or the count unknown: it can work; warned.
    for nodes in (1, None):
        p = _plan({"GLOO_SOCKET_IFNAME": "lo"}, WORKER, MASTER, "veth0", nodes=nodes)
        assert p.refusal is None and p.warnings[0].startswith("GLOO_SOCKET_IFNAME=lo: no route to MASTER_ADDR")
    # An interface with no address: gloo cannot bind it, whatever the job.
    bare = WORKER.model_copy(update={"interfaces": {**WORKER.interfaces, "fab1": []}})
    assert "fab1 has no IP address, which gloo binds" in (
        assess_user("GLOO_SOCKET_IFNAME", "fab1", MASTER, bare).refusal or ""
    )


def test_a_name_that_matches_nothing_is_refused_saying_what_to_set() -> None:
    refusal = assess_user("NCCL_SOCKET_IFNAME", "ib", MASTER, WORKER).refusal
    assert refusal == (
        "NCCL_SOCKET_IFNAME=ib matches no interface of this host. Interfaces here: lo, veth0, fab0; routes here: "
        "198.18.0.0/30 dev veth0; 198.19.0.0/24 dev fab0. Set NCCL_SOCKET_IFNAME to interfaces of this host that "
        "the other nodes reach (a comma list of name prefixes; '=' first for exact names, '^' first to exclude: "
        "e.g. NCCL_SOCKET_IFNAME==veth0), or unset NCCL_SOCKET_IFNAME and ncclguard picks the one that routes "
        "to MASTER_ADDR."
    )
    # NCCL's syntax, as src/misc/utils.cc parses it.
    for value, refused in (
        ("fab", False),  # a prefix
        ("=fab", True),  # exact: no interface is named 'fab'
        ("=fab0", False),
        ("ib,fab0:5000", False),  # name:port, the port is not part of the name
        ("^lo", False),  # everything but lo: veth0, fab0
        ("^lo,veth,fab", True),  # everything excluded
        ("^=fab0", False),
        ("^=", True),  # an empty list matches all, '^' excludes them all
        (" fab0", True),  # NCCL keeps the space: no interface is named ' fab0'
    ):
        assert (assess_user("NCCL_SOCKET_IFNAME", value, MASTER, WORKER).refusal is not None) is refused, value
    # One character: NCCL ignores the variable (strlen(env) > 1), so nothing to refuse.
    check = assess_user("NCCL_SOCKET_IFNAME", "f", MASTER, WORKER)
    assert check.refusal is None and "NCCL ignores a value of one character" in check.warnings[0]
    # A match with no address: NCCL's bootstrap finds nothing there; a gloo-only job never asks. Warned.
    bare = WORKER.model_copy(update={"interfaces": {**WORKER.interfaces, "ib0": []}})
    check = assess_user("NCCL_SOCKET_IFNAME", "ib", MASTER, bare)
    assert check.refusal is None and check.warnings == [
        "NCCL_SOCKET_IFNAME=ib: ib0 holds no IP address: NCCL's bootstrap finds no socket interface there when NCCL "
        "starts"
    ]


def test_multipath_and_policy_routes_carry_traffic() -> None:
    # `ip -j route show table all`: an ECMP route names its devices in `nexthops`; another table says so.
    text = json.dumps(
        [
            {"dst": "198.18.5.0/24", "dev": "d1", "protocol": "kernel", "scope": "link", "flags": []},
            {
                "dst": "198.19.0.0/16",
                "flags": [],
                "nexthops": [
                    {"gateway": "198.18.5.254", "dev": "d1", "weight": 1, "flags": []},
                    {"gateway": "198.18.6.254", "dev": "d2", "weight": 1, "flags": []},
                ],
            },
            {"dst": "default", "gateway": "198.18.6.254", "dev": "d2", "table": "100", "flags": []},
            {"type": "local", "dst": "198.18.5.1", "dev": "d1", "table": "local", "flags": []},
        ]
    )
    routes = parse_ip_routes(text, 4)
    assert [r.text() for r in routes] == [
        "198.18.5.0/24 dev d1",
        "198.19.0.0/16 via 198.18.5.254 dev d1",
        "198.19.0.0/16 via 198.18.6.254 dev d2",
        "default via 198.18.6.254 dev d2 table 100",
    ]
    rules = parse_ip_rules(
        '[{"priority":0,"src":"all","table":"local"},{"priority":100,"src":"198.18.6.1","table":"100"},'
        '{"priority":101,"src":"198.18.7.0","srclen":24,"table":"200"},{"priority":200,"action":"unreachable"},'
        '{"priority":32766,"src":"all","table":"main"},{"priority":32767,"src":"all","table":"default"}]',
        4,
    )
    assert [(r.table, r.source) for r in rules] == [
        ("local", None),
        ("100", "198.18.6.1"),
        ("200", "198.18.7.0/24"),
        ("main", None),
        ("default", None),
    ]
    view = HostView(
        interfaces={"lo": ["127.0.0.1"], "d1": ["198.18.5.1"], "d2": ["198.18.6.1"]}, routes=routes, rules=rules
    )
    assert reaches("d1", "198.19.3.3", view) and reaches("d2", "198.19.3.3", view)  # either next hop
    assert reaches("d2", "203.0.113.9", view)  # table 100's default: traffic from d2's address goes there
    other = view.model_copy(update={"interfaces": {**view.interfaces, "d2": ["198.18.6.2"]}})
    assert not reaches("d2", "203.0.113.9", other)  # no rule sends this address to table 100
    assert reaches("d2", "203.0.113.9", view.model_copy(update={"rules": []}))  # rules unknown: every table
    # `ip route get` of a multipath route: the first next hop, in either form.
    got = parse_ip_json(
        '[{"dst":"198.19.1.1","flags":[],"nexthops":[{"gateway":"198.18.5.254","dev":"d1"}],"uid":0}]', "198.19.1.1"
    )
    assert (got.interface, got.gateway) == ("d1", "198.18.5.254")
    got = parse_ip_text(
        "198.19.1.1 uid 0\n\tnexthop via 198.18.6.254 dev d2 weight 1\n\tnexthop via 198.18.5.254 dev d1 weight 1\n",
        "198.19.1.1",
    )
    assert (got.interface, got.gateway) == ("d2", "198.18.6.254")


def test_the_master_host_on_loopback_binds_the_interface_the_others_reach() -> None:
    p = _plan({}, MASTER_HOST, "127.0.1.1", "lo", nodes=2)
    assert p.to_set() == {"GLOO_SOCKET_IFNAME": "veth0"} and p.warnings == [] and p.interface == "veth0"
    assert p.lines()[0] == (
        "GLOO_SOCKET_IFNAME=veth0 set: gloo would bind 127.0.1.1 on lo (hostname m0 resolves to it): a loopback "
        "address; MASTER_ADDR 127.0.1.1 resolves to 127.0.1.1, a loopback address, on this host (the master's) and "
        "the job spans 2 nodes: they reach this host through veth0 (the one interface of this host with a routable "
        "address)"
    )
    assert p.lines()[1] == "NCCL_SOCKET_IFNAME left unset: NCCL would pick veth0, not a loopback address"
    # One node: loopback is right, nothing is set.
    assert _plan({}, MASTER_HOST, "127.0.1.1", "lo", nodes=1).to_set() == {}
    # Several candidates and no default route: nothing is guessed, a warning says what to set.
    two = MASTER_HOST.model_copy(update={"interfaces": {**MASTER_HOST.interfaces, "eth1": ["198.18.9.1"]}})
    p = _plan({}, two, "127.0.1.1", "lo", nodes=3)
    assert p.to_set() == {} and {c.action for c in p.choices} == {"left"}
    (warning,) = p.warnings
    assert "the job spans 3 nodes: gloo and NCCL left alone would bind loopback here" in warning
    assert "(candidates: veth0, eth1; no default route). Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" in warning
    # The default route, or the hostname's other address, tells which.
    routed = two.model_copy(
        update={"routes": [TableRoute(network="0.0.0.0/0", interface="eth1", gateway="198.18.9.254")]}
    )
    assert outward(routed) == ("eth1", "this host's default route goes through it")
    named = two.model_copy(update={"hostname_addresses": ["127.0.1.1", "198.18.9.1"]})
    assert outward(named) == ("eth1", "the hostname m0 also resolves to 198.18.9.1, which it holds")
    assert _plan({}, routed, "127.0.1.1", "lo", nodes=3).to_set() == {"GLOO_SOCKET_IFNAME": "eth1"}
    # The other nodes' connections to the store say where they reached this host: first of all.
    linked = routed.model_copy(update={"store_links": ["198.18.0.1"]})
    assert outward(linked) == (
        "veth0",
        "the other nodes' connections to the store arrive at 198.18.0.1, which it holds",
    )
    # The count of nodes, from what torchrun gives a rank.
    assert nodes_of({"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert nodes_of({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == 2 and nodes_of({}) is None


_NAMES = st.sampled_from(["lo", "eth0", "eth1", "fab0", "ib0", "docker0"])
_ADDRS = st.lists(st.sampled_from(["127.0.0.1", "198.18.0.2", "198.19.0.2", "198.18.7.9", "::1"]), max_size=2)


@st.composite
def _hosts(draw: st.DrawFn) -> HostView:
    names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    interfaces = {n: draw(_ADDRS) for n in names}
    routes = [
        TableRoute(network=draw(st.sampled_from(["0.0.0.0/0", "198.18.0.0/30", "198.19.0.0/24"])), interface=n)
        for n in draw(st.lists(st.sampled_from(names), max_size=4))
    ]
    return HostView(hostname="h", interfaces=interfaces, routes=routes)


_VALUES = st.lists(st.sampled_from([*"^=,:5 ", "lo", "eth", "eth0", "fab0", "ib", "x"]), max_size=6).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    host=_hosts(),
    variable=st.sampled_from(["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]),
    value=_VALUES,
    address=st.sampled_from([None, MASTER, "203.0.113.9"]),
    nodes=st.sampled_from([None, 1, 2, 4]),
)
def test_only_what_cannot_work_is_refused(host, variable, value, address, nodes) -> None:
    check = assess_user(variable, value, address, host, nodes=nodes)
    if not value.strip():
        assert check.refusal is None and check.warnings == []
        return
    if variable == "NCCL_SOCKET_IFNAME":
        cannot = len(value) > 1 and not nccl_ifname_matches(value, list(host.interfaces))
    else:
        names = [n.strip() for n in value.split(",") if n.strip()]
        missing = any(n not in host.interfaces for n in names)
        bare = any(not host.interfaces.get(n) for n in names)
        loop = any(host.only_loopback(n) for n in names) and nodes is not None and nodes > 1
        cannot = missing or bare or loop
    assert (check.refusal is not None) is cannot, (variable, value, check)
    # Whether a route to the master is seen never decides a refusal: the same host without routes agrees.
    bare_routes = assess_user(variable, value, address, host.model_copy(update={"routes": []}), nodes=nodes)
    assert (bare_routes.refusal is None) is (check.refusal is None)


@settings(max_examples=200, deadline=None)
@given(
    hops=st.lists(
        st.tuples(st.sampled_from(["d1", "d2", "d3"]), st.sampled_from(["198.18.5.254", "198.18.6.254", None])),
        min_size=1,
        max_size=4,
    ),
    table=st.sampled_from([None, "main", "100"]),
)
def test_every_next_hop_of_a_multipath_route_is_read(hops, table) -> None:
    entry: dict[str, object] = {
        "dst": "198.19.0.0/16",
        "flags": [],
        "nexthops": [{"dev": d, **({"gateway": g} if g else {})} for d, g in hops],
    }
    if table is not None:
        entry["table"] = table
    routes = parse_ip_routes(json.dumps([entry]), 4)
    assert [(r.interface, r.gateway) for r in routes] == hops
    assert {r.table for r in routes} == {table or "main"}
    view = HostView(interfaces={d: ["198.18.5.1"] for d, _ in hops}, routes=routes)
    assert all(reaches(d, "198.19.200.1", view) for d, _ in hops)
    assert not any(reaches(d, "203.0.113.1", view) for d, _ in hops)


def test_rules_send_only_their_sources_to_their_tables() -> None:
    view = HostView(
        interfaces={"a": ["198.18.1.1"], "b": ["198.18.2.1"]},
        routes=[TableRoute(network="0.0.0.0/0", interface=n, table="7") for n in ("a", "b")],
        rules=[RouteRule(table="main"), RouteRule(table="7", source="198.18.1.0/24", priority=5)],
    )
    assert reaches("a", "203.0.113.1", view) and not reaches("b", "203.0.113.1", view)
    assert ipaddress.ip_address("198.18.1.1") in ipaddress.ip_network("198.18.1.0/24")


def test_the_stores_connections_from_other_hosts_are_read() -> None:
    if sys.byteorder != "little":
        return  # the words below are written as a little-endian kernel prints them
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    # 198.18.0.1:29533 <- 198.18.0.2 (established), <- 127.0.0.1 (loopback: left out), a listener, another port.
    tcp = head + "".join(
        f"   {i}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
        for i, (local, remote, state) in enumerate(
            [
                ("010012C6:735D", "020012C6:A000", "01"),
                ("0100007F:735D", "0100007F:A001", "01"),
                ("00000000:735D", "00000000:0000", "0A"),
                ("010012C6:1F90", "020012C6:A002", "01"),
            ]
        )
    )
    assert parse_proc_tcp(tcp, 29533) == ["198.18.0.1"]
    # tcp6: the store listens on '::', an IPv4 peer arrives IPv4-mapped.
    mapped = "0000000000000000FFFF0000010012C6"
    tcp6 = head + f"   0: {mapped}:735D 0000000000000000FFFF0000020012C6:A000 01 0 0 0 0 0 1 1\n"
    assert parse_proc_tcp(tcp6, 29533) == ["198.18.0.1"]
