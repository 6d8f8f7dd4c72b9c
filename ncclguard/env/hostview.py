"""The socket plan on this host: read the host (:func:`observe`), decide (:func:`plan_sockets`, the one
function ``doctor`` and every start path use) and apply it before the process group is made
(:func:`prepare_sockets`, called by ``ncclguard.init_process_group`` and by the start-up hook of
``ncclguard run`` / ``NCCLGUARD_AUTO=1``). The rule itself is in :mod:`ncclguard.env.sockets`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import psutil

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.env.envvars import mark_applied
from ncclguard.env.netenv import NetPlan, _resolve, detect
from ncclguard.env.sockets import (
    GLOO_VAR,
    NCCL_VAR,
    HostView,
    RouteRule,
    SocketPlan,
    TableRoute,
    decide,
    plan_enabled,
)
from ncclguard.errors import BadInterface

__all__ = [
    "check_interfaces",
    "observe",
    "parse_ip_routes",
    "parse_ip_rules",
    "parse_proc_routes",
    "parse_proc_tcp",
    "plan_sockets",
    "prepare_sockets",
]


def parse_ip_routes(text: str, family: int) -> list[TableRoute]:
    """The unicast entries of ``ip -j [-6] route show [table all]``, one per next hop.

    A multipath (ECMP) route has no ``dev`` of its own but ``nexthops``, each with its ``dev``; an
    entry of a table other than main says its ``table``.

    Raises:
        ValueError: the text is not iproute2's JSON list.
    """
    doc = json.loads(text or "[]")
    if not isinstance(doc, list):
        raise ValueError(f"`ip -j route show` printed no list: {text[:200]!r}")
    out = []
    for entry in doc:
        if not isinstance(entry, dict) or entry.get("type", "unicast") != "unicast":
            continue  # local, broadcast, unreachable, blackhole, prohibit: no interface carries them there
        dst = str(entry.get("dst", "default"))
        net = ("0.0.0.0/0" if family == 4 else "::/0") if dst == "default" else dst
        table = str(entry.get("table", "main"))
        hops = entry.get("nexthops") if "dev" not in entry else [entry]
        for hop in hops if isinstance(hops, list) else []:
            if isinstance(hop, dict) and "dev" in hop:
                gateway = hop.get("gateway")
                out.append(TableRoute(network=net, interface=str(hop["dev"]), gateway=gateway, table=table))
    return out


def parse_ip_rules(text: str, family: int) -> list[RouteRule]:
    """The rules of ``ip -j [-6] rule show`` that look up a table (``from all`` has no source).

    Raises:
        ValueError: the text is not iproute2's JSON list.
    """
    doc = json.loads(text or "[]")
    if not isinstance(doc, list):
        raise ValueError(f"`ip -j rule show` printed no list: {text[:200]!r}")
    out = []
    for entry in doc:
        if not isinstance(entry, dict) or "table" not in entry:
            continue  # unreachable, prohibit, blackhole, goto, nop: no table to route by
        src = entry.get("src", "all")
        source = None if src == "all" else f"{src}/{entry['srclen']}" if "srclen" in entry else str(src)
        priority = entry.get("priority", 0)
        out.append(
            RouteRule(
                priority=int(priority) if isinstance(priority, int) else 0,
                table=str(entry["table"]),
                source=source,
                family=family,
            )
        )
    return out


def parse_proc_routes(text: str) -> list[TableRoute]:
    """The up routes of ``/proc/net/route`` (IPv4), for hosts without ``ip``."""
    out = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8 or not int(cols[3], 16) & 0x0001:
            continue

        def addr(word: str) -> ipaddress.IPv4Address:
            raw = bytes.fromhex(word)  # the kernel prints the network-order word as a host-order integer
            return ipaddress.IPv4Address(raw[::-1] if sys.byteorder == "little" else raw)

        mask = bin(int(addr(cols[7]))).count("1")
        gateway = str(addr(cols[2])) if int(cols[3], 16) & 0x0002 else None
        out.append(TableRoute(network=f"{addr(cols[1])}/{mask}", interface=cols[0], gateway=gateway))
    return out


def _proc_address(word: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as ``/proc/net/tcp[6]`` prints it: 32-bit words, each in host order."""
    order = -1 if sys.byteorder == "little" else 1
    raw = b"".join(bytes.fromhex(word[i : i + 8])[::order] for i in range(0, len(word), 8))
    return ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw)


def parse_proc_tcp(text: str, port: int) -> list[str]:
    """This host's addresses at which established connections from other hosts arrive on local ``port``.

    Args:
        text: ``/proc/net/tcp`` or ``/proc/net/tcp6``.
        port: the local port (the store's, ``MASTER_PORT``).

    Returns:
        The local addresses, first seen first (an IPv4-mapped IPv6 address as IPv4); connections
        from a loopback address left out.
    """
    out: list[str] = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 4 or cols[3] != "01":  # 01: TCP_ESTABLISHED
            continue
        try:
            (local, lport), (remote, _) = (c.split(":") for c in cols[1:3])
            if int(lport, 16) != port:
                continue
            here, there = _proc_address(local), _proc_address(remote)
        except ValueError:
            continue
        here = getattr(here, "ipv4_mapped", None) or here
        there = getattr(there, "ipv4_mapped", None) or there
        if not there.is_loopback and str(here) not in out:
            out.append(str(here))
    return out


def _store_links(proc_net: Path, port: int) -> list[str]:
    out: list[str] = []
    for name in ("tcp", "tcp6"):
        try:
            out += [a for a in parse_proc_tcp((proc_net / name).read_text(), port) if a not in out]
        except OSError:
            continue
    return out


def _ip_json(ip: str, args: list[str]) -> str | None:
    """The stdout of ``ip -j ARGS`` (a list of arguments, no shell), or None when it failed."""
    done = subprocess.run([ip, "-j", *args], capture_output=True, text=True, timeout=5, check=False)
    return done.stdout if done.returncode == 0 else None


def _routes(proc_net: Path) -> tuple[list[TableRoute], list[RouteRule]]:
    """Every table's unicast routes and the rules (``ip``), else the main table of ``/proc/net/route``."""
    ip = shutil.which("ip")
    if ip is not None:
        try:
            routes: list[TableRoute] = []
            rules: list[RouteRule] = []
            for family in (4, 6):
                text = _ip_json(ip, [f"-{family}", "route", "show", "table", "all"])
                if text is None:  # an `ip` that knows no `table all`: the main table
                    text = _ip_json(ip, [f"-{family}", "route", "show"])
                routes += parse_ip_routes(text or "[]", family)
                rules += parse_ip_rules(_ip_json(ip, [f"-{family}", "rule", "show"]) or "[]", family)
            return routes, rules
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            log.debug("ip -j route/rule show failed (%s); reading /proc/net/route", exc)
    try:
        return parse_proc_routes((proc_net / "route").read_text()), []
    except OSError:
        return [], []


def observe(
    *, resolve_timeout_s: float = 5.0, proc_net: Path = Path("/proc/net"), store_port: int | None = None
) -> HostView:
    """Reads this host: its interfaces and addresses, its routing tables and rules, what its hostname resolves to.

    Args:
        resolve_timeout_s: bound for resolving the hostname.
        proc_net: the kernel's tables, read when there is no ``ip``.
        store_port: the store's port (``MASTER_PORT``): the addresses other hosts' connections to it
            arrive at are read (None: not read).

    Returns:
        The view the socket plan decides over.
    """
    interfaces: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        interfaces[name] = [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    try:
        resolved = [str(a) for a in _resolve(HOSTNAME, resolve_timeout_s)]
    except OSError as exc:
        log.debug("hostname %s does not resolve (%s): gloo would bind 127.0.0.1", HOSTNAME, exc)
        resolved = []
    routes, rules = _routes(proc_net)
    links = _store_links(proc_net, store_port) if store_port is not None else []
    return HostView(
        hostname=HOSTNAME,
        hostname_addresses=resolved,
        interfaces=interfaces,
        routes=routes,
        rules=rules,
        store_links=links,
    )


def plan_sockets(
    environ: Mapping[str, str] | None = None,
    *,
    master_addr: str | None = None,
    net: NetPlan | None = None,
    view: HostView | None = None,
    nodes: int | None = None,
) -> SocketPlan:
    """The socket plan of this rank (what ``doctor`` shows and the start paths apply).

    Args:
        environ: the environment to read (default ``os.environ``).
        master_addr: the master (default ``MASTER_ADDR``).
        net: the route to the master, when already detected.
        view: this host, when already read.
        nodes: how many nodes the job spans (default: torchrun's variables in ``environ``).

    Returns:
        The plan (nothing is changed).

    Raises:
        TypeError, ValueError: the master address is not a valid host.
    """
    env = os.environ if environ is None else environ
    if not plan_enabled(env):
        return decide(env, HostView(), master=master_addr or env.get("MASTER_ADDR"), address=None, interface=None)
    net = net or detect(master_addr, environ=env)
    if net.target_source == "default route":  # no master: nothing to route to
        return decide(env, view or observe(), master=None, address=None, interface=None, nodes=nodes)
    port = env.get("MASTER_PORT", "")
    loopback = net.address is not None and ipaddress.ip_address(net.address).is_loopback
    host = view or observe(store_port=int(port) if loopback and port.isdigit() else None)
    return decide(env, host, master=net.target, address=net.address, interface=net.interface, nodes=nodes)


class _Prepared:
    """The plan this process applied (it is applied, and logged, once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plan: SocketPlan | None = None


_PREPARED = _Prepared()


def prepare_sockets(
    *,
    master_addr: str | None = None,
    net: NetPlan | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> SocketPlan:
    """Applies the socket plan before the process group is made; once per process.

    Sets the variables the plan sets (never one the user set) and logs, once, what it set and why.

    Args:
        master_addr: the master (default ``MASTER_ADDR``).
        net: the route to the master, when already detected.
        environ: the environment to change (default ``os.environ``; then applied once per process).

    Returns:
        The plan applied (its ``warnings`` logged, once).

    Raises:
        BadInterface: an interface the user named cannot work (it does not exist; for gloo, it has no
            address, or only loopback ones on a job of several nodes).
    """
    env = os.environ if environ is None else environ
    with _PREPARED.lock:
        if environ is None and _PREPARED.plan is not None:
            return _PREPARED.plan
        plan = plan_sockets(env, master_addr=master_addr, net=net)
        if plan.refusal is not None:
            raise BadInterface(plan.refusal)
        done = plan.to_set()
        if done.get(NCCL_VAR) and plan.address and ipaddress.ip_address(plan.address).version == 6:
            done.setdefault("NCCL_SOCKET_FAMILY", "AF_INET6")
        for name, value in done.items():
            if name not in env:
                env[name] = value
                if environ is None:
                    mark_applied(name, value)
        if plan.enabled:
            log.info("network plan (to reach MASTER_ADDR %s): %s", plan.master, " | ".join(plan.lines()))
            for warning in plan.warnings:
                log.warning("network plan: %s", warning)
        if environ is None:
            _PREPARED.plan = plan
    return plan


def check_interfaces(
    endpoint: str | None, environ: Mapping[str, str] | None = None, *, nodes: int | None = None
) -> list[str]:
    """Refuses, before any rank starts, an interface the user named that cannot work; returns the warnings.

    Args:
        endpoint: the master as the launcher has it (``HOST``, ``HOST:PORT``, ``[V6]:PORT``).
        environ: the environment the ranks will inherit (default ``os.environ``).
        nodes: how many nodes the job spans at least (``--nnodes``), when known.

    Returns:
        What may not work and is let through (no route to the master through the user's interface).

    Raises:
        BadInterface: with the interfaces and routes of this host, and what to set.
        ValueError: the master is not a valid host.
    """
    env = os.environ if environ is None else environ
    if not plan_enabled(env) or not any(env.get(v, "").strip() for v in (GLOO_VAR, NCCL_VAR)):
        return []
    host = (endpoint or "").strip()
    if host.startswith("["):
        host = host[1 : host.index("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    plan = plan_sockets(env, master_addr=host or None, nodes=nodes)
    if plan.refusal is not None:
        raise BadInterface(plan.refusal)
    return list(plan.warnings)
