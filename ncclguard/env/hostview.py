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
from ncclguard.env.sockets import GLOO_VAR, NCCL_VAR, HostView, SocketPlan, TableRoute, decide, plan_enabled
from ncclguard.errors import BadInterface

__all__ = ["check_interfaces", "observe", "parse_ip_routes", "parse_proc_routes", "plan_sockets", "prepare_sockets"]


def parse_ip_routes(text: str, family: int) -> list[TableRoute]:
    """The unicast entries of ``ip -j [-6] route show``.

    Raises:
        ValueError: the text is not iproute2's JSON list.
    """
    doc = json.loads(text or "[]")
    if not isinstance(doc, list):
        raise ValueError(f"`ip -j route show` printed no list: {text[:200]!r}")
    out = []
    for entry in doc:
        if not isinstance(entry, dict) or "dev" not in entry or entry.get("type", "unicast") != "unicast":
            continue  # unreachable, blackhole, prohibit: no interface carries them
        dst = str(entry.get("dst", "default"))
        net = ("0.0.0.0/0" if family == 4 else "::/0") if dst == "default" else dst
        out.append(TableRoute(network=net, interface=str(entry["dev"]), gateway=entry.get("gateway")))
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


def _routes(proc_net: Path) -> list[TableRoute]:
    ip = shutil.which("ip")
    if ip is not None:
        try:
            out: list[TableRoute] = []
            for family in (4, 6):
                done = subprocess.run(
                    [ip, "-j", f"-{family}", "route", "show"], capture_output=True, text=True, timeout=5, check=False
                )
                if done.returncode == 0:
                    out += parse_ip_routes(done.stdout, family)
            return out
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            log.debug("ip -j route show failed (%s); reading /proc/net/route", exc)
    try:
        return parse_proc_routes((proc_net / "route").read_text())
    except OSError:
        return []


def observe(*, resolve_timeout_s: float = 5.0, proc_net: Path = Path("/proc/net")) -> HostView:
    """Reads this host: its interfaces and addresses, its routing table, what its hostname resolves to."""
    interfaces: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        interfaces[name] = [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    try:
        resolved = [str(a) for a in _resolve(HOSTNAME, resolve_timeout_s)]
    except OSError as exc:
        log.debug("hostname %s does not resolve (%s): gloo would bind 127.0.0.1", HOSTNAME, exc)
        resolved = []
    return HostView(hostname=HOSTNAME, hostname_addresses=resolved, interfaces=interfaces, routes=_routes(proc_net))


def plan_sockets(
    environ: Mapping[str, str] | None = None,
    *,
    master_addr: str | None = None,
    net: NetPlan | None = None,
    view: HostView | None = None,
) -> SocketPlan:
    """The socket plan of this rank (what ``doctor`` shows and the start paths apply).

    Args:
        environ: the environment to read (default ``os.environ``).
        master_addr: the master (default ``MASTER_ADDR``).
        net: the route to the master, when already detected.
        view: this host, when already read.

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
        return decide(env, view or observe(), master=None, address=None, interface=None)
    return decide(env, view or observe(), master=net.target, address=net.address, interface=net.interface)


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
        The plan applied.

    Raises:
        BadInterface: an interface the user named does not exist or has no route to the master.
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
        if environ is None:
            _PREPARED.plan = plan
    return plan


def check_interfaces(endpoint: str | None, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, before any rank starts, an interface the user named that cannot reach the master.

    Args:
        endpoint: the master as the launcher has it (``HOST``, ``HOST:PORT``, ``[V6]:PORT``).
        environ: the environment the ranks will inherit (default ``os.environ``).

    Raises:
        BadInterface: with the interfaces and routes of this host.
        ValueError: the master is not a valid host.
    """
    env = os.environ if environ is None else environ
    if not plan_enabled(env) or not any(env.get(v, "").strip() for v in (GLOO_VAR, NCCL_VAR)):
        return
    host = (endpoint or "").strip()
    if host.startswith("["):
        host = host[1 : host.index("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    plan = plan_sockets(env, master_addr=host or None)
    if plan.refusal is not None:
        raise BadInterface(plan.refusal)
