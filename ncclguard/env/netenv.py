"""Which network interface this rank should use, and the environment that makes NCCL and gloo use it.

:func:`detect` asks the kernel for the route to the master (``MASTER_ADDR``, or the address
given), reads the InfiniBand ports and checks the variables already set; :func:`apply` sets
the recommended variables without touching any the user set. Route lookups send no packet;
the only traffic is the DNS query when the master is given as a hostname.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.backend_rules import NCCL_ERROR_HANDLING
from ncclguard.config import Config, get_config
from ncclguard.env.envvars import DEPRECATED, env_warnings, mark_applied
from ncclguard.env.infiniband import SYSFS_INFINIBAND, IbDevice, read_infiniband
from ncclguard.env.routes import IPAddress, NoRoute, Route, lookup_route
from ncclguard.env.sockets import BRIDGE_PREFIXES

__all__ = ["NetPlan", "apply", "detect", "parse_host"]

# Documentation addresses (RFC 5737, RFC 3849): routed only by a default route, never answered.
# Asking the kernel for the route to one reveals the default interface without sending anything.
_PROBE_V4 = ipaddress.IPv4Address("198.51.100.1")
_PROBE_V6 = ipaddress.IPv6Address("2001:db8::1")
# RFC 1123 labels (letters, digits, inner hyphens; underscores tolerated), dot-separated, 253 chars at most.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")


class NetPlan(BaseModel):
    """What :func:`detect` found and recommends for this rank.

    Attributes:
        target: the peer as given (hostname or address), or None for the default-route probe.
        target_source: where ``target`` came from: ``"argument"``, ``"MASTER_ADDR"`` or ``"default route"``.
        address: the address the route was looked up for.
        resolved: every address the hostname resolved to (the first one is used).
        family: ``"ipv4"`` or ``"ipv6"``, or None when nothing was resolved.
        interface: the interface to use, or None when there is no route.
        local_address: this host's address on ``interface``.
        route: the kernel's answer (method, gateway, kind).
        infiniband: InfiniBand/RoCE adapters with their port states.
        environment: the recommended variables (NCCL's ``=name`` exact-match form for NCCL).
        warnings: one sentence per problem found.
        hostname: this host's name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str | None
    target_source: Literal["argument", "MASTER_ADDR", "default route"]
    address: str | None = None
    resolved: list[str] = []
    family: Literal["ipv4", "ipv6"] | None = None
    interface: str | None = None
    local_address: str | None = None
    route: Route | None = None
    infiniband: list[IbDevice] = []
    environment: dict[str, str] = {}
    warnings: list[str] = []
    hostname: str = ""

    @property
    def ib_active(self) -> bool:
        """True when some InfiniBand/RoCE port is ACTIVE."""
        return any(d.active for d in self.infiniband)


def parse_host(text: str) -> IPAddress | str:
    """Validates a master address: an IP address (IPv6 may be ``[bracketed]``) or a hostname.

    Returns:
        The address as an ``ipaddress`` object, or the hostname (to be resolved).

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: it is neither an IP address nor a valid hostname.
    """
    if not isinstance(text, str):
        raise TypeError(f"master address must be a string such as '10.0.0.1' or 'node001', got {type(text).__name__}")
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _HOSTNAME.match(host):
        raise ValueError(
            f"master address {text!r} is neither an IP address nor a valid hostname; "
            "pass e.g. '10.0.0.1', 'fd00::1' or 'node001.cluster'"
        )
    return host.rstrip(".")


def _resolve(host: str, timeout_s: float) -> list[IPAddress]:
    """The addresses ``host`` resolves to, in the resolver's order; bounded by ``timeout_s``."""
    found: list[IPAddress] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            for *_, sockaddr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
                addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
                if addr not in found:
                    found.append(addr)
        except (OSError, UnicodeError) as exc:
            error.append(exc)

    # A daemon thread: a resolver stuck on an unreachable DNS server must not hold the caller.
    thread = threading.Thread(target=work, name="ncclguard-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise OSError(f"resolving {host!r} took longer than {timeout_s:g} s")
    if error:
        raise OSError(f"cannot resolve {host!r}: {error[0]}")
    return found


def _owner_of(address: IPAddress) -> str | None:
    """The interface that holds ``address`` on this host."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%", 1)[0]) == address:
                        return name
                except ValueError:
                    continue
    return None


def _address_on(interface: str, family: int) -> str | None:
    for a in psutil.net_if_addrs().get(interface, []):
        if a.family == family and not a.address.lower().startswith("fe80"):
            return a.address.split("%", 1)[0]
    return None


def _nodes(env: Mapping[str, str]) -> int | None:
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, int(world) // int(local))
    return None


def _recommend(interface: str | None, family: str | None, ib_active: bool, config: Config) -> dict[str, str]:
    env: dict[str, str] = {}
    if interface is not None:
        env["NCCL_SOCKET_IFNAME"] = f"={interface}"  # '=': exactly this one, not every name it prefixes
        env["GLOO_SOCKET_IFNAME"] = interface
        if family == "ipv6":
            env["NCCL_SOCKET_FAMILY"] = "AF_INET6"
    env["NCCL_IB_DISABLE"] = "0" if ib_active else "1"
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERROR_HANDLING  # why: backend_rules
    env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    env["TORCH_FR_BUFFER_SIZE"] = str(config.flight_records)
    return env


def _route(
    host: IPAddress | str | None,
    target: str | None,
    source: str,
    proc_net: Path,
    resolve_timeout_s: float,
    warnings: list[str],
) -> tuple[list[IPAddress], IPAddress | None, Route | None]:
    """Resolves ``host`` and asks the kernel for the route to it (or to the default route)."""
    origin = "the address given" if source == "argument" else source
    if host is None:
        for probe in (_PROBE_V4, _PROBE_V6):
            try:
                return [], probe, lookup_route(probe, proc_net=proc_net)
            except NoRoute:
                continue
        warnings.append("this host has no default route; set MASTER_ADDR or pass --master-addr to pick the peer.")
        return [], None, None
    if isinstance(host, str):
        try:
            resolved = _resolve(host, resolve_timeout_s)
        except OSError as exc:
            warnings.append(f"{exc}; check {origin} and /etc/hosts or DNS on this host.")
            return [], None, None
    else:
        resolved = [host]
    address = resolved[0]
    try:
        return resolved, address, lookup_route(address, proc_net=proc_net)
    except NoRoute as exc:
        warnings.append(f"{target} is unreachable from this host ({exc}); check {origin} and the routing table.")
        return resolved, address, None


def _interface_warnings(interface: str, target: str | None, env: Mapping[str, str]) -> list[str]:
    out = []
    peer = target or "the default gateway"
    stats = psutil.net_if_stats().get(interface)
    if stats is not None and not stats.isup:
        out.append(f"interface {interface} is down: the route to {peer} uses it.")
    if interface.startswith(BRIDGE_PREFIXES):
        out.append(
            f"the route to {peer} goes through {interface}, a container bridge: other hosts cannot reach this rank "
            "there; check MASTER_ADDR."
        )
    nodes = _nodes(env)
    if interface == "lo" and nodes is not None and nodes > 1:
        out.append(
            f"{target} is a loopback address but the job spans {nodes} nodes (WORLD_SIZE={env['WORLD_SIZE']}, "
            f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}): other nodes cannot reach it; set MASTER_ADDR to "
            "the master's routable address (a hostname that resolves to 127.x does the same harm)."
        )
    return out


def detect(
    master_addr: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config: Config | None = None,
    infiniband_root: Path = SYSFS_INFINIBAND,
    proc_net: Path = Path("/proc/net"),
    resolve_timeout_s: float = 5.0,
) -> NetPlan:
    """Finds the interface and environment this rank should use to reach the master.

    Args:
        master_addr: the peer to reach (hostname or IP); default ``MASTER_ADDR``, else the
            default route.
        environ: the environment to read (default ``os.environ``; nothing is written).
        config: the configuration (flight recorder size); default the one in force.
        infiniband_root: where the InfiniBand adapters are listed.
        proc_net: the kernel's tables, used when ``ip`` is missing.
        resolve_timeout_s: bound for resolving a hostname.

    Returns:
        The plan; problems are in ``warnings``, never raised.

    Raises:
        TypeError, ValueError: ``master_addr`` (or ``MASTER_ADDR``) is not a valid host.
    """
    env = os.environ if environ is None else environ
    cfg = config or get_config()
    warnings: list[str] = []
    if master_addr is not None:
        target, source = master_addr, "argument"
    elif env.get("MASTER_ADDR"):
        target, source = env["MASTER_ADDR"], "MASTER_ADDR"
    else:
        target, source = None, "default route"
    host = parse_host(target) if target is not None else None
    resolved, address, route = _route(host, target, source, proc_net, resolve_timeout_s, warnings)

    interface = local = family = None
    if route is not None and address is not None:
        family = "ipv4" if address.version == 4 else "ipv6"
        interface, local = route.interface, route.source
        if route.kind == "local":
            local = str(address)
            if not address.is_loopback:
                # The kernel answers `local ... dev lo` for this host's own address; the peers reach
                # it through the interface that holds it, which is the one NCCL and gloo must use.
                interface = _owner_of(address) or route.interface
        local = local or _address_on(interface, socket.AF_INET if family == "ipv4" else socket.AF_INET6)
        warnings.extend(_interface_warnings(interface, target, env))

    ib = read_infiniband(infiniband_root)
    ib_active = any(d.active for d in ib)
    if ib and not ib_active:
        warnings.append(
            f"InfiniBand adapters {', '.join(d.name for d in ib)} are present but no port is ACTIVE: "
            "NCCL falls back to sockets (check `ibstat`)."
        )
    warnings.extend(env_warnings(env, interfaces=list(psutil.net_if_addrs())))
    for w in warnings:
        log.debug("netenv: %s", w)
    return NetPlan(
        target=target,
        target_source=source,
        address=None if address is None else str(address),
        resolved=[str(a) for a in resolved],
        family=family,
        interface=interface,
        local_address=local,
        route=route,
        infiniband=ib,
        environment=_recommend(interface, family, ib_active, cfg),
        warnings=warnings,
        hostname=HOSTNAME,
    )


def apply(plan: NetPlan, override: bool = False, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets the plan's recommended variables; a variable the user set is left alone and reported.

    A variable counts as set by the user when it, or its deprecated alias (e.g.
    ``NCCL_ASYNC_ERROR_HANDLING`` for ``TORCH_NCCL_ASYNC_ERROR_HANDLING``), is in the environment.

    Args:
        plan: from :func:`detect`.
        override: also replace variables the user set (logged as a warning each).
        environ: the environment to change (default ``os.environ``).

    Returns:
        The variables this call set, with their values.

    Raises:
        TypeError: ``plan`` is not a :class:`NetPlan`.
    """
    if not isinstance(plan, NetPlan):
        raise TypeError(f"plan must be a NetPlan from ncclguard.env.netenv.detect(), got {type(plan).__name__}")
    env = os.environ if environ is None else environ
    aliases = {new: old for old, new in DEPRECATED.items()}
    done: dict[str, str] = {}
    for name, value in plan.environment.items():
        alias = aliases.get(name)
        user = name if name in env else (alias if alias is not None and alias in env else None)
        if user is not None and not override:
            if env[user] != value:
                log.info(
                    "%s=%s is set by the user; ncclguard recommends %s=%s and leaves it", user, env[user], name, value
                )
            continue
        if user is not None:
            log.warning("overriding %s=%s with %s=%s (override=True)", user, env[user], name, value)
        env[name] = value
        done[name] = value
        if environ is None:
            mark_applied(name, value)
    if done:
        log.info("netenv: set %s", " ".join(f"{k}={v}" for k, v in done.items()))
    return done
