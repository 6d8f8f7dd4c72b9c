"""Network detection, the environment plan, the timeout hierarchy and ncclguard.init_process_group.

Route parsing runs on real `ip` outputs recorded in network namespaces (tests/fixtures/ip/,
see its README) and on this machine's own `ip` and /proc/net. The multi-rank part is one
torchrun launch of 2 gloo ranks on loopback.

Launches (tests/workers/netenv_worker.py):
``inherit`` 2 ranks, no fault: ncclguard.init_process_group("gloo", timeout=20) applies the plan without
    overriding the user's NCCL_IB_DISABLE, subgroups inherit the 20 s until restored, the hierarchy is read
    from the live groups; TORCH_DISTRIBUTED_DEBUG and DEEPSPEED_TIMEOUT, set before Python started, keep
    their values when changed later, and env_warnings says so.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from ncclguard.config import configure
from ncclguard.env.envvars import (
    DEPRECATED,
    IGNORED,
    applied_by_ncclguard,
    audit,
    env_warnings,
    gloo_ifname_matches,
    nccl_ifname_matches,
)
from ncclguard.env.hierarchy import TimeoutHierarchy, backend_default_timeout_s
from ncclguard.env.infiniband import read_infiniband
from ncclguard.env.netenv import NetPlan, apply, detect, parse_host
from ncclguard.env.routes import (
    NoRoute,
    lookup_route,
    parse_ip_json,
    parse_ip_text,
    parse_proc_ipv6_route,
    parse_proc_route,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ip"
CASES = json.loads((FIXTURES / "cases.json").read_text())

# (scenario, query) -> (interface, source, gateway, kind) from `ip route get`.
EXPECTED = {
    ("one_nic", "same_subnet"): ("eth0", "198.18.0.2", None, "unicast"),
    ("one_nic", "via_gateway"): ("eth0", "198.18.0.2", "198.18.0.1", "unicast"),
    ("one_nic", "loopback"): ("lo", "127.0.0.1", None, "local"),
    ("one_nic", "own_address"): ("lo", "198.18.0.2", None, "local"),
    ("bond", "same_subnet"): ("bond0", "198.18.1.2", None, "unicast"),
    ("bond", "via_gateway"): ("bond0", "198.18.1.2", "198.18.1.1", "unicast"),
    ("ib_eth", "ib_subnet"): ("ib0", "198.19.0.2", None, "unicast"),
    ("ib_eth", "eth_subnet"): ("eth0", "198.18.0.2", None, "unicast"),
    ("ipv6", "same_subnet"): ("eth0", "2001:db8:1::2", None, "unicast"),
    ("ipv6", "via_gateway"): ("eth0", "2001:db8:1::2", "2001:db8:1::1", "unicast"),
    ("ipv6", "loopback"): ("lo", "::1", None, "local"),
    ("ipv6", "own_address"): ("lo", "2001:db8:1::2", None, "local"),
    ("docker", "eth_subnet"): ("eth0", "198.18.0.2", None, "unicast"),
    ("docker", "via_gateway"): ("eth0", "198.18.0.2", "198.18.0.1", "unicast"),
    ("docker", "docker_subnet"): ("docker0", "172.17.0.1", None, "unicast"),
}
# The same lookups answered from /proc/net: (interface, gateway, kind). /proc/net/route has no
# local table, so this host's own IPv4 address matches its subnet route (still the right NIC).
EXPECTED_PROC = {
    ("one_nic", "own_address"): ("eth0", None, "unicast"),
    ("ipv6", "own_address"): ("eth0", None, "local"),
}


@pytest.fixture(autouse=True)
def _deepspeed_not_imported(monkeypatch):
    """In-process tests here read DEEPSPEED_TIMEOUT as a fresh process would. Once deepspeed is
    imported its own value wins (it read the variable at import), and another test on the same
    xdist worker may have imported it; the multi-rank worker checks the imported case."""
    monkeypatch.delitem(sys.modules, "deepspeed.constants", raising=False)


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        *IGNORED,
        *DEPRECATED,
        *DEPRECATED.values(),
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "NCCL_SOCKET_FAMILY",
        "MASTER_ADDR",
        "DEEPSPEED_TIMEOUT",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        *(k for k in os.environ if k.startswith("NCCLGUARD_WATCHDOG_")),
    ]:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- parsing the recorded outputs


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda c: f"{c[0]}-{c[1]}")
def test_json_and_text_forms_parse_to_the_same_route(case):
    scenario, query = case
    addr = CASES[scenario][query]
    from_json = parse_ip_json((FIXTURES / scenario / f"{query}.json").read_text(), addr)
    from_text = parse_ip_text((FIXTURES / scenario / f"{query}.txt").read_text(), addr)
    for route in (from_json, from_text):
        assert (route.interface, route.source, route.gateway, route.kind) == EXPECTED[case]
        assert route.destination == addr
    assert (from_json.method, from_text.method) == ("ip -j route get", "ip route get")


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda c: f"{c[0]}-{c[1]}")
def test_proc_tables_give_the_same_interface(case, tmp_path):
    scenario, query = case
    address = ipaddress.ip_address(CASES[scenario][query])
    # An `ip` that does not exist: lookup_route reads the recorded tables as it would /proc/net.
    proc_net = tmp_path
    for name in ("route", "ipv6_route"):
        (proc_net / name).write_text((FIXTURES / scenario / f"proc_net_{name}").read_text())
    route = lookup_route(address, ip="/nonexistent/ip", proc_net=proc_net)
    assert route.method == ("/proc/net/route" if address.version == 4 else "/proc/net/ipv6_route")
    interface, _, gateway, kind = EXPECTED[case]
    assert (route.interface, route.gateway, route.kind) == EXPECTED_PROC.get(case, (interface, gateway, kind))


def test_unreachable_recorded_stderr_and_proc_tables():
    for query in ("off_subnet", "off_subnet_v6"):
        err = json.loads((FIXTURES / "unreachable" / f"{query}.err").read_text())
        assert err == {"rc": 2, "stderr": "RTNETLINK answers: Network is unreachable\n"}
    with pytest.raises(NoRoute, match="Network is unreachable"):
        parse_proc_route(
            (FIXTURES / "unreachable" / "proc_net_route").read_text(), ipaddress.IPv4Address("203.0.113.9")
        )
    # IPv6 without a default route ends on the kernel's ::/0 reject route on lo.
    with pytest.raises(NoRoute, match="Network is unreachable"):
        parse_proc_ipv6_route(
            (FIXTURES / "unreachable" / "proc_net_ipv6_route").read_text(), ipaddress.IPv6Address("2001:db8:77::1")
        )


def test_parsers_refuse_what_is_not_a_route():
    with pytest.raises(ValueError, match="not JSON"):
        parse_ip_json('Option "-j" is unknown, try "ip -help".', "10.0.0.1")
    with pytest.raises(ValueError, match="no route with a device"):
        parse_ip_json("[]", "10.0.0.1")
    with pytest.raises(ValueError, match="no device"):
        parse_ip_text("", "10.0.0.1")
    with pytest.raises(TypeError, match="ipaddress"):
        lookup_route("10.0.0.1")  # type: ignore[arg-type]


def test_text_form_with_a_gateway_of_the_other_family():
    route = parse_ip_text("198.18.5.5 via inet6 fe80::1 dev eth0 src 198.18.0.2 uid 0 \n    cache \n", "198.18.5.5")
    assert (route.interface, route.gateway, route.source) == ("eth0", "fe80::1", "198.18.0.2")


# ---------------------------------------------------------------- this machine's own ip and /proc


def _default_interface_from_proc() -> str:
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[1] == "00000000" and int(cols[3], 16) & 1:
            return cols[0]
    pytest.skip("this machine has no IPv4 default route")


def test_real_ip_json_text_and_proc_agree_on_the_default_route(tmp_path, monkeypatch):
    expected = _default_interface_from_proc()
    probe = ipaddress.IPv4Address("198.51.100.1")
    via_json = lookup_route(probe)
    assert via_json.method == "ip -j route get"
    text = subprocess.run(
        ["ip", "route", "get", str(probe)], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    via_text = parse_ip_text(text, str(probe))
    monkeypatch.setenv("PATH", str(tmp_path))  # `ip` hidden: only /proc/net is left
    assert shutil.which("ip") is None
    via_proc = lookup_route(probe)
    assert via_proc.method == "/proc/net/route"
    assert via_json.interface == via_text.interface == via_proc.interface == expected
    assert via_json.gateway == via_text.gateway == via_proc.gateway
    assert via_json.source == via_text.source


def test_an_ip_without_json_falls_back_to_the_text_form(tmp_path):
    # iproute2 before 4.x rejects -j with exactly this message; no such `ip` is installable here,
    # so a wrapper around the real one stands in for it.
    real = shutil.which("ip")
    old_ip = tmp_path / "ip"
    old_ip.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-j" ]; then echo \'Option "-j" is unknown, try "ip -help".\' >&2; exit 255; fi\n'
        f'exec {real} "$@"\n'
    )
    old_ip.chmod(old_ip.stat().st_mode | stat.S_IEXEC)
    route = lookup_route(ipaddress.IPv4Address("127.0.0.1"), ip=str(old_ip))
    assert (route.method, route.interface, route.kind) == ("ip route get", "lo", "local")


def test_detect_loopback_hostnames_and_ipv6(monkeypatch):
    _clean_env(monkeypatch)
    for target, family in (("127.0.0.1", "ipv4"), ("localhost", "ipv4"), ("::1", "ipv6"), ("[::1]", "ipv6")):
        plan = detect(target)
        assert (plan.interface, plan.family, plan.route.kind) == ("lo", family, "local"), target
        assert plan.environment["NCCL_SOCKET_IFNAME"] == "=lo"
        assert plan.environment["GLOO_SOCKET_IFNAME"] == "lo"
        assert plan.warnings == []
    assert detect("::1").environment["NCCL_SOCKET_FAMILY"] == "AF_INET6"
    assert "NCCL_SOCKET_FAMILY" not in detect("127.0.0.1").environment
    assert "127.0.0.1" in detect("localhost").resolved
    own = detect(socket.gethostname())
    assert own.interface is not None and own.resolved and own.warnings == []


def test_own_address_gives_its_nic_not_lo(monkeypatch):
    """`ip route get <this host's IP>` answers `local ... dev lo`; the master must use the NIC."""
    _clean_env(monkeypatch)
    nic = _default_interface_from_proc()
    own = next(a.address for a in psutil.net_if_addrs()[nic] if a.family == socket.AF_INET)
    plan = detect(own)
    assert (plan.route.kind, plan.route.interface) == ("local", "lo")
    assert (plan.interface, plan.local_address) == (nic, own)
    assert plan.environment["NCCL_SOCKET_IFNAME"] == f"={nic}"


def test_detect_reads_master_addr_then_the_default_route(monkeypatch):
    _clean_env(monkeypatch)
    plan = detect(environ={"MASTER_ADDR": "127.0.0.1"})
    assert (plan.target, plan.target_source, plan.interface) == ("127.0.0.1", "MASTER_ADDR", "lo")
    probe = detect(environ={})
    assert (probe.target, probe.target_source, probe.interface) == (
        None,
        "default route",
        _default_interface_from_proc(),
    )


def test_unresolvable_host_is_a_warning_not_a_crash(monkeypatch):
    _clean_env(monkeypatch)
    plan = detect("no-such-host.invalid")
    assert plan.interface is None and plan.resolved == []
    assert "NCCL_SOCKET_IFNAME" not in plan.environment and "GLOO_SOCKET_IFNAME" not in plan.environment
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("cannot resolve 'no-such-host.invalid'")


def test_loopback_master_in_a_multi_node_job_is_flagged(monkeypatch):
    _clean_env(monkeypatch)
    plan = detect(environ={"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert plan.warnings == [
        "127.0.0.1 is a loopback address but the job spans 2 nodes (WORLD_SIZE=16, LOCAL_WORLD_SIZE=8): other nodes "
        "cannot reach it; set MASTER_ADDR to the master's routable address (a hostname that resolves to 127.x does "
        "the same harm)."
    ]


@pytest.mark.parametrize(
    "bad", ["-h", "10.0.0.1; rm -rf /", "$(reboot)", "a b", "", "x" * 300, "node..1", "1.2.3.4.5/8"]
)
def test_bad_master_address_is_refused_before_any_lookup(bad):
    with pytest.raises(ValueError, match="neither an IP address nor a valid hostname"):
        detect(bad)


def test_master_address_types():
    with pytest.raises(TypeError, match="must be a string"):
        parse_host(10)  # type: ignore[arg-type]
    assert parse_host("[fd00::1]") == ipaddress.IPv6Address("fd00::1")
    assert parse_host("node001.cluster.") == "node001.cluster"


# ---------------------------------------------------------------- InfiniBand


def test_infiniband_ports_and_the_ib_switch(monkeypatch):
    _clean_env(monkeypatch)
    devices = read_infiniband(FIXTURES / "infiniband" / "active")
    assert [(d.name, d.netdevs, d.active) for d in devices] == [
        ("mlx5_0", ["ib0"], True),
        ("mlx5_1", ["ib1"], False),
        ("mlx5_2", ["eth2"], True),
    ]
    assert devices[0].ports[0].model_dump() == {
        "port": 1,
        "state": "ACTIVE",
        "phys_state": "LinkUp",
        "link_layer": "InfiniBand",
        "rate": "200 Gb/sec (4X HDR)",
    }
    assert devices[2].ports[0].link_layer == "Ethernet"  # RoCE
    active = detect("127.0.0.1", infiniband_root=FIXTURES / "infiniband" / "active")
    assert active.environment["NCCL_IB_DISABLE"] == "0" and active.ib_active and active.warnings == []
    down = detect("127.0.0.1", infiniband_root=FIXTURES / "infiniband" / "down")
    assert down.environment["NCCL_IB_DISABLE"] == "1"
    assert down.warnings == [
        "InfiniBand adapters mlx5_0 are present but no port is ACTIVE: NCCL falls back to sockets (check `ibstat`)."
    ]
    none = detect("127.0.0.1", infiniband_root=FIXTURES / "no-such-dir")
    assert none.infiniband == [] and none.environment["NCCL_IB_DISABLE"] == "1"


# ---------------------------------------------------------------- variables that do nothing


def test_nccl_timeout_is_named_as_doing_nothing():
    (w,) = env_warnings({"NCCL_TIMEOUT": "1800"})
    assert w.startswith("NCCL_TIMEOUT=1800 does nothing: neither NCCL nor PyTorch reads it;")
    assert "timeout= argument of init_process_group and new_group" in w and "DEEPSPEED_TIMEOUT in minutes" in w


@pytest.mark.parametrize("old,new", sorted(DEPRECATED.items()))
def test_each_deprecated_name_names_its_replacement(old, new):
    assert env_warnings({old: "1"}) == [
        f"{old} is deprecated: rename it {new} (PyTorch still reads the old name, with a warning)."
    ]
    assert env_warnings({old: "1", new: "3"}) == [f"{old} is deprecated and shadowed: {new}=3 wins; remove {old}."]


def test_torch_distributed_debug_set_after_import_is_flagged():
    level = dist.get_debug_level().name  # what torch read at import
    other = "DETAIL" if level != "DETAIL" else "OFF"
    assert env_warnings({"TORCH_DISTRIBUTED_DEBUG": level.lower()}) == []
    (w,) = env_warnings({"TORCH_DISTRIBUTED_DEBUG": other})
    assert w.startswith(
        f"TORCH_DISTRIBUTED_DEBUG={other} has no effect: torch read it at `import torch` and uses {level};"
    )


def test_deepspeed_timeout_in_seconds_or_not_a_number():
    (w,) = env_warnings({"DEEPSPEED_TIMEOUT": "1800s"})
    assert w.startswith("DEEPSPEED_TIMEOUT=1800s is not a whole number of minutes")
    (w,) = env_warnings({"DEEPSPEED_TIMEOUT": "1800"})
    assert w == (
        "DEEPSPEED_TIMEOUT=1800 means 1800 minutes (30.0 hours): it is read in minutes, not seconds; "
        "for 1800 s write DEEPSPEED_TIMEOUT=30."
    )
    assert env_warnings({"DEEPSPEED_TIMEOUT": "30"}) == []


def test_settings_that_cannot_work():
    (w,) = env_warnings({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert w.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=0 turns off NCCL error handling")
    (w,) = env_warnings({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "0"})
    assert w.startswith("TORCH_NCCL_DUMP_ON_TIMEOUT is on but the flight recorder buffer is 0")
    names = ["eth0", "ib0", "lo"]
    (w,) = env_warnings({"NCCL_SOCKET_IFNAME": "=eth9"}, interfaces=names)
    assert w.startswith("NCCL_SOCKET_IFNAME==eth9 matches no interface of this host (eth0, ib0, lo)")
    (w,) = env_warnings({"GLOO_SOCKET_IFNAME": "eth9"}, interfaces=names)
    assert w.startswith("GLOO_SOCKET_IFNAME=eth9 names no interface of this host (eth0, ib0, lo)")
    assert env_warnings({"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0,ib0"}, interfaces=names) == []


def test_nccl_and_gloo_interface_matching_rules():
    names = ["docker0", "eth0", "eth1", "eth10", "ib0", "lo"]
    assert nccl_ifname_matches("eth", names) == ["eth0", "eth1", "eth10"]
    assert nccl_ifname_matches("=eth1", names) == ["eth1"]
    assert nccl_ifname_matches("=eth0,ib0", names) == ["eth0", "ib0"]
    assert nccl_ifname_matches("^docker,lo", names) == ["eth0", "eth1", "eth10", "ib0"]
    assert nccl_ifname_matches("^=eth1", names) == ["docker0", "eth0", "eth10", "ib0", "lo"]
    assert gloo_ifname_matches("eth1", names) == ["eth1"]
    assert gloo_ifname_matches("eth0,ib0", names) == ["eth0", "ib0"]
    assert gloo_ifname_matches("eth", names) == []


def test_torch_headers_confirm_the_catalogue():
    """The aliases and defaults claimed in envvars.py and docs/environment.md, read from torch's own headers."""
    inc = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    if not (inc / "ProcessGroupNCCL.hpp").exists():
        pytest.skip(f"torch headers not installed under {inc}")
    nccl = (inc / "ProcessGroupNCCL.hpp").read_text()
    lists = {
        m[0]: re.findall(r'"([A-Z_]+)"', m[1])
        for m in re.findall(r"static std::vector<std::string>\s+(\w+)\s*=\s*\{([^}]*)\}", nccl)
    }
    for old, new in DEPRECATED.items():
        if new == "TORCH_FR_BUFFER_SIZE":
            continue
        assert lists[new] == [new, old], new  # current name first: it wins when both are set
    all_names = {n for names in lists.values() for n in names}
    assert "NCCL_TIMEOUT" not in all_names and "TORCH_NCCL_DUMP_ON_TIMEOUT" in all_names
    assert re.search(r"kProcessGroupNCCLDefaultTimeout =\s+std::chrono::milliseconds\(10 \* 60 \* 1000\)", nccl)
    fr = (inc / "FlightRecorder.hpp").read_text()
    assert '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000' in fr
    backend = (inc / "Backend.hpp").read_text()
    assert re.search(r"kBackendDefaultTimeout =\s+std::chrono::milliseconds\(30 \* 60 \* 1000\)", backend)
    assert backend_default_timeout_s("gloo") == 1800.0 and backend_default_timeout_s("nccl") == 600.0


# ---------------------------------------------------------------- apply


def _plan(**environment: str) -> NetPlan:
    return NetPlan(target="127.0.0.1", target_source="argument", interface="lo", environment=environment)


def test_apply_sets_what_is_unset_and_returns_it():
    env: dict[str, str] = {}
    plan = _plan(NCCL_SOCKET_IFNAME="=lo", GLOO_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    assert apply(plan, environ=env) == {"NCCL_SOCKET_IFNAME": "=lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    assert env == {"NCCL_SOCKET_IFNAME": "=lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def test_apply_never_overrides_the_user(caplog):
    env = {"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "16384"}
    plan = _plan(
        NCCL_SOCKET_IFNAME="=lo",
        GLOO_SOCKET_IFNAME="lo",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="3",
        TORCH_FR_BUFFER_SIZE="2000",
    )
    with caplog.at_level("INFO", logger="ncclguard"):
        assert apply(plan, environ=env) == {"GLOO_SOCKET_IFNAME": "lo"}
    # The user's values, their deprecated aliases included, are untouched and reported.
    assert env == {
        "NCCL_SOCKET_IFNAME": "=eth1",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "16384",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    assert (
        "NCCL_SOCKET_IFNAME==eth1 is set by the user; ncclguard recommends NCCL_SOCKET_IFNAME==lo and leaves it"
        in caplog.text
    )
    assert apply(plan, override=True, environ=env) == {
        "NCCL_SOCKET_IFNAME": "=lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": "2000",
    }
    with pytest.raises(TypeError, match="NetPlan"):
        apply({"NCCL_SOCKET_IFNAME": "=lo"})  # type: ignore[arg-type]


def test_apply_to_the_process_and_the_audit_rows(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")
    monkeypatch.setenv("NCCL_TIMEOUT", "1800")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")
    plan = detect("127.0.0.1")
    for name in set(plan.environment) - set(os.environ):  # so that monkeypatch removes what apply() sets
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    done = apply(plan)
    assert set(done) == {
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_BUFFER_SIZE",
    }
    assert applied_by_ncclguard()["GLOO_SOCKET_IFNAME"] == "lo"
    rows = {r.name: (r.value, r.recommended, r.status) for r in audit(plan.environment)}
    assert rows == {
        "NCCL_SOCKET_IFNAME": ("=lo", "=lo", "set by ncclguard"),
        "GLOO_SOCKET_IFNAME": ("lo", "lo", "set by ncclguard"),
        "NCCL_IB_DISABLE": ("0", "1", "set by user"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": (None, "3", "set by user"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", "1", "set by ncclguard"),
        "TORCH_FR_BUFFER_SIZE": ("2000", "2000", "set by ncclguard"),
        "NCCL_ASYNC_ERROR_HANDLING": ("1", None, "deprecated"),
        "NCCL_TIMEOUT": ("1800", None, "ignored by NCCL and PyTorch"),
    }


# ---------------------------------------------------------------- timeout hierarchy


def test_hierarchy_in_order_and_each_broken_rule():
    ok = TimeoutHierarchy(
        op_deadline_s=300,
        watchdog_hang_s=300,
        group_timeout_s=600,
        heartbeat_timeout_s=900,
        eval_timeout_s=200,
        barrier_deadline_s=300,
        peer_liveness_s=30,
    )
    assert ok.problems() == [] and ok.notes() == []
    broken = {
        "per-op deadline (600 s) is not below the process-group timeout (600 s)": dict(op_deadline_s=600),
        "watchdog hang timeout (600 s) is not below the process-group timeout (600 s)": dict(watchdog_hang_s=600),
        "heartbeat timeout (600 s) is not above the process-group timeout (600 s)": dict(heartbeat_timeout_s=600),
        "evaluation deadline (700 s) is not below the process-group timeout (600 s)": dict(
            eval_timeout_s=700, barrier_deadline_s=800
        ),
        "barrier deadline (100 s) is shorter than the evaluation deadline (200 s)": dict(barrier_deadline_s=100),
    }
    for message, change in broken.items():
        values = {**ok.model_dump(exclude={"sources", "subgroup_timeouts_s"}), **change}
        with pytest.raises(ValueError, match=re.escape(message)):
            TimeoutHierarchy(**values)
    with pytest.raises(ValueError, match=r"per-op deadline \(300 s\) is not below group 5's timeout \(300 s\)"):
        TimeoutHierarchy(op_deadline_s=300, group_timeout_s=600, subgroup_timeouts_s={"5": 300})
    with pytest.raises(ValueError, match="greater than 0"):
        TimeoutHierarchy(group_timeout_s=0)


def test_hierarchy_in_force_without_a_group(monkeypatch):
    _clean_env(monkeypatch)
    configure(timeout_large_s=1800.0, barrier_timeout_s=300.0, eval_timeout_s=250.0)
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S", "120")  # the watchdog's own settings, read too
    gloo = TimeoutHierarchy.in_force(backend="gloo", validate=False)
    # ncclguard's default deadlines are capped below the group's timeout (1800 x 0.9 - 0.5), as a call gets them.
    assert (gloo.op_deadline_s, gloo.group_timeout_s, gloo.eval_timeout_s, gloo.barrier_deadline_s) == (
        1619.5,
        1800,
        250,
        300,
    )
    assert (gloo.watchdog_hang_s, gloo.peer_liveness_s, gloo.heartbeat_timeout_s) == (120, 30, None)
    assert gloo.sources["watchdog_hang_s"] == "WatchdogConfig (NCCLGUARD_WATCHDOG_*)"
    assert gloo.sources["group_timeout_s"] == "gloo default (no group yet)"
    assert gloo.sources["op_deadline_s"].endswith(", capped (Config)")
    assert gloo.problems() == []
    small = TimeoutHierarchy.in_force(backend="gloo", group_timeout_s=3, eval_timeout_s=1, validate=False)
    assert (small.op_deadline_s, small.barrier_deadline_s) == (pytest.approx(2.2), pytest.approx(2.2))
    # The rule still holds for deadlines given by hand (they are refused at the call, see test_collectives_faults).
    with pytest.raises(ValueError, match="timeout hierarchy out of order"):
        TimeoutHierarchy(op_deadline_s=1800, group_timeout_s=1800)
    configure(heartbeat_timeout_s=600.0)  # a supervisor that gives up before NCCL's 600 s would
    with pytest.raises(
        ValueError, match=re.escape("heartbeat timeout (600 s) is not above the process-group timeout (600 s)")
    ):
        TimeoutHierarchy.in_force(backend="nccl", op_numel=1000)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "20")
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "900")
    nccl = TimeoutHierarchy.in_force(backend="nccl", group_timeout_s=3600, heartbeat_timeout_s=7200)
    assert (nccl.group_timeout_s, nccl.heartbeat_timeout_s, nccl.deepspeed_timeout_s, nccl.nccl_heartbeat_s) == (
        3600,
        7200,
        1200,
        900,
    )
    rows = {r["name"]: (r["seconds"], r["source"]) for r in nccl.rows()}
    assert rows["DeepSpeed default timeout"] == (1200, "DEEPSPEED_TIMEOUT=20 (minutes)")
    assert rows["NCCL watchdog heartbeat"] == (900, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    assert rows["process-group timeout"] == (3600, "given")
    text = nccl.render()
    assert text.splitlines()[0].startswith("timeout") and "PROBLEM" not in text
    configure(timeout_policy="bandwidth", timeout_base_s=60.0, min_bandwidth_gbps=1.0, heartbeat_timeout_s=None)
    bw = TimeoutHierarchy.in_force(backend="gloo", op_numel=250_000_000)
    assert bw.op_deadline_s == pytest.approx(61.0)  # 60 s + 1e9 bytes at 1 GB/s


# ---------------------------------------------------------------- init_process_group on real ranks


@pytest.fixture(scope="module")
def inherit():
    return run_ranks(
        "netenv_worker",
        2,
        "inherit",
        timeout_s=120,
        env={"TORCH_DISTRIBUTED_DEBUG": "INFO", "DEEPSPEED_TIMEOUT": "20", "NCCL_IB_DISABLE": "0"},
    )


@pytest.mark.multirank
def test_init_applies_the_plan_but_not_over_the_user(inherit):
    for r in (0, 1):
        init = inherit[r]["init"]
        assert (init["backend"], init["timeout_s"], init["subgroups_inherit"]) == ("gloo", 20.0, True)
        assert init["plan"]["interface"] == "lo" and init["plan"]["target_source"] == "MASTER_ADDR"
        # NCCL_IB_DISABLE came from the user, TORCH_NCCL_ASYNC_ERROR_HANDLING=1 from torchrun. The socket
        # interfaces stay unset: on one host with a loopback master, the defaults reach it (the socket plan).
        assert init["applied"] == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
        assert {c["variable"]: c["action"] for c in init["sockets"]["choices"]} == {
            "GLOO_SOCKET_IFNAME": "left",
            "NCCL_SOCKET_IFNAME": "left",
        }
        assert inherit[r]["env_after"] == {
            "GLOO_SOCKET_IFNAME": None,
            "NCCL_SOCKET_IFNAME": None,
            "NCCL_IB_DISABLE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_FR_BUFFER_SIZE": "2000",
        }
        assert inherit[r]["sum"] == 3.0


@pytest.mark.multirank
def test_subgroups_inherit_the_world_timeout_until_restored(inherit):
    for r in (0, 1):
        assert inherit[r]["inherited"] == {"default": 20.0, "new_group": 20.0, "new_group_explicit": 90.0}
        assert inherit[r]["restored"] == {"default": 1800.0, "new_group": 1800.0, "new_group_explicit": 90.0}


@pytest.mark.multirank
def test_hierarchy_reads_the_live_groups(inherit):
    for r in (0, 1):
        assert (inherit[r]["hierarchy_pg"], inherit[r]["hierarchy_pg_source"]) == (20.0, "live gloo group")
        assert inherit[r]["hierarchy_subgroups"] == [20.0, 90.0]
        assert inherit[r]["hierarchy_deepspeed"] == 1200.0
        assert len(inherit[r]["hierarchy_notes"]) == 2
        assert [
            n
            for n in inherit[r]["hierarchy_notes"]
            if n.startswith("group ") and "(90 s) differs from the world group's (20 s)" in n
        ], inherit[r]["hierarchy_notes"]


@pytest.mark.multirank
def test_import_time_variables_changed_after_import(inherit):
    for r in (0, 1):
        res = inherit[r]
        assert (res["debug_level"], res["debug_level_after"], res["deepspeed_minutes"]) == ("INFO", "INFO", 20.0)
        assert res["warnings_before"] == []
        assert res["warnings_after"] == [
            "TORCH_DISTRIBUTED_DEBUG=DETAIL has no effect: torch read it at `import torch` and uses INFO; set it before "
            "Python starts (export it, or in the launcher's environment).",
            "DEEPSPEED_TIMEOUT=30 has no effect: deepspeed read it at import and uses 20 min; set it before "
            "`import deepspeed`, or pass timeout= to deepspeed.init_distributed.",
        ]


def test_init_process_group_refuses_bad_input_before_changing_anything(monkeypatch):
    import ncclguard

    _clean_env(monkeypatch)
    before = dict(os.environ)
    with pytest.raises(ValueError, match="positive duration"):
        ncclguard.init_process_group("gloo", timeout=-1)
    with pytest.raises(TypeError, match="seconds"):
        ncclguard.init_process_group("gloo", timeout="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="neither an IP address nor a valid hostname"):
        ncclguard.init_process_group("gloo", master_addr="a b")
    assert dict(os.environ) == before and not dist.is_initialized()
