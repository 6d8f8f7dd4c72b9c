"""Which interface the kernel would use to reach an address, asked three ways.

In order: ``ip -j route get ADDR`` (iproute2 with JSON output), the text of ``ip route get
ADDR`` (older iproute2, BusyBox), and the kernel's own tables ``/proc/net/route`` and
``/proc/net/ipv6_route`` when there is no ``ip`` at all. A route lookup is a question to the
kernel over netlink: it sends no packet. ``ip`` gets a list of arguments, never a shell, and
only an address that :mod:`ipaddress` accepted.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ncclguard._log import log
from ncclguard.errors import NoRoute

__all__ = [
    "IPAddress",
    "NoRoute",
    "Route",
    "RouteMethod",
    "lookup_route",
    "parse_ip_json",
    "parse_ip_text",
    "parse_proc_ipv6_route",
    "parse_proc_route",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
RouteMethod = Literal["ip -j route get", "ip route get", "/proc/net/route", "/proc/net/ipv6_route"]

# Route types `ip route get` prints before the destination (rtnetlink's RTN_* names).
_ROUTE_TYPES = {
    "unicast",
    "local",
    "broadcast",
    "anycast",
    "multicast",
    "blackhole",
    "unreachable",
    "prohibit",
    "throw",
    "nat",
}
# Keys of the text form that are followed by a value; anything else is a bare flag.
_VALUED_KEYS = {
    "dev",
    "src",
    "from",
    "via",
    "proto",
    "metric",
    "table",
    "uid",
    "pref",
    "mtu",
    "iif",
    "oif",
    "expires",
    "error",
    "hoplimit",
    "realms",
    "advmss",
    "rtt",
    "rttvar",
    "ssthresh",
    "cwnd",
    "window",
    "tos",
    "mark",
}
# Flags of the kernel's route tables (include/uapi/linux/route.h and ipv6_route.h).
_RTF_UP, _RTF_GATEWAY, _RTF_REJECT, _RTF_LOCAL = 0x0001, 0x0002, 0x0200, 0x80000000


class Route(BaseModel):
    """The kernel's answer for one destination.

    Attributes:
        destination: the address asked about.
        interface: the outgoing interface (``lo`` for an address of this host).
        source: the source address the kernel would use, when the method reports it.
        gateway: the next hop, or None for a destination on a directly connected subnet.
        kind: ``"unicast"``, or ``"local"`` for an address of this host.
        method: which of the three lookups answered.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    destination: str
    interface: str
    source: str | None = None
    gateway: str | None = None
    kind: str = "unicast"
    method: RouteMethod


def parse_ip_json(text: str, destination: str) -> Route:
    """Parses the stdout of ``ip -j route get`` (a multipath answer: its first ``nexthops`` entry).

    Raises:
        ValueError: the text is not the JSON list of one route that iproute2 prints.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON from `ip -j route get`: {text[:200]!r}") from exc
    entry = doc[0] if isinstance(doc, list) and doc and isinstance(doc[0], dict) else {}
    hop = entry
    if "dev" not in entry:  # a multipath answer names its devices in `nexthops`: the first is taken
        hops = entry.get("nexthops")
        hop = hops[0] if isinstance(hops, list) and hops and isinstance(hops[0], dict) else {}
    if "dev" not in hop:
        raise ValueError(f"`ip -j route get` printed no route with a device: {text[:200]!r}")
    return Route(
        destination=str(entry.get("dst", destination)),
        interface=str(hop["dev"]),
        source=entry.get("prefsrc"),
        gateway=hop.get("gateway"),
        kind=str(entry.get("type", "unicast")),
        method="ip -j route get",
    )


def parse_ip_text(text: str, destination: str) -> Route:
    """Parses the stdout of ``ip route get`` (first line, or its first ``nexthop`` line for a multipath
    answer; the ``cache`` line is ignored).

    Raises:
        ValueError: the line has no ``dev``.
    """
    lines = text.strip().splitlines()
    tokens = lines[0].split() if lines else []
    kind = "unicast"
    if tokens and tokens[0] in _ROUTE_TYPES:
        kind, tokens = tokens[0], tokens[1:]
    fields: dict[str, str] = {}
    i = 1  # tokens[0] is the destination
    while i < len(tokens):
        key = tokens[i]
        if key == "via" and i + 2 < len(tokens) and tokens[i + 1] in ("inet", "inet6"):
            fields["via"] = tokens[i + 2]  # `via inet6 fe80::1`: a gateway of the other family
            i += 3
        elif key in _VALUED_KEYS and i + 1 < len(tokens):
            fields[key] = tokens[i + 1]
            i += 2
        else:
            i += 1
    if "dev" not in fields:  # a multipath answer: `nexthop via GW dev DEV weight 1` lines, the first taken
        for line in lines[1:]:
            hop = line.split()
            if hop[:1] == ["nexthop"] and "dev" in hop[:-1]:
                fields["dev"] = hop[hop.index("dev") + 1]
                if "via" in hop[:-1]:
                    at = hop.index("via") + 1
                    at += 1 if hop[at] in ("inet", "inet6") and at + 1 < len(hop) else 0
                    fields["via"] = hop[at]
                break
    if "dev" not in fields:
        raise ValueError(f"`ip route get` printed no device: {text[:200]!r}")
    return Route(
        destination=tokens[0] if tokens else destination,
        interface=fields["dev"],
        source=fields.get("src"),
        gateway=fields.get("via"),
        kind=kind,
        method="ip route get",
    )


def _ipv4_from_proc(hex_text: str) -> ipaddress.IPv4Address:
    raw = bytes.fromhex(hex_text)
    # /proc/net/route prints the network-order word as a host-order integer.
    return ipaddress.IPv4Address(raw[::-1] if sys.byteorder == "little" else raw)


def parse_proc_route(text: str, address: ipaddress.IPv4Address) -> Route:
    """Longest-prefix match of ``address`` in the text of ``/proc/net/route``.

    Raises:
        NoRoute: no route matches, or the best match is a reject route.
    """
    best: tuple[int, int, str, str | None, int] | None = None  # (prefix, -metric, iface, gateway, flags)
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8:
            continue
        iface, dest_hex, gw_hex, flags_hex, metric, mask_hex = cols[0], cols[1], cols[2], cols[3], cols[6], cols[7]
        flags = int(flags_hex, 16)
        if not flags & _RTF_UP:
            continue
        dest, mask = int(_ipv4_from_proc(dest_hex)), int(_ipv4_from_proc(mask_hex))
        if int(address) & mask != dest:
            continue
        gateway = str(_ipv4_from_proc(gw_hex)) if flags & _RTF_GATEWAY else None
        key = (bin(mask).count("1"), -int(metric), iface, gateway, flags)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None or best[4] & _RTF_REJECT:
        raise NoRoute(f"no route to {address} in /proc/net/route (Network is unreachable)")
    return Route(destination=str(address), interface=best[2], gateway=best[3], method="/proc/net/route")


def parse_proc_ipv6_route(text: str, address: ipaddress.IPv6Address) -> Route:
    """Longest-prefix match of ``address`` in the text of ``/proc/net/ipv6_route``.

    Raises:
        NoRoute: no route matches, or the best match is a reject route.
    """
    best: tuple[int, int, str, str | None, int] | None = None
    for line in text.splitlines():
        cols = line.split()
        if len(cols) != 10:
            continue
        dest_hex, plen_hex, _, _, hop_hex, metric_hex, _, _, flags_hex, iface = cols
        flags, plen = int(flags_hex, 16), int(plen_hex, 16)
        if not flags & _RTF_UP:
            continue
        network = ipaddress.IPv6Network((int(dest_hex, 16), plen), strict=False)
        if address not in network:
            continue
        hop = ipaddress.IPv6Address(int(hop_hex, 16))
        gateway = str(hop) if flags & _RTF_GATEWAY and int(hop) else None
        key = (plen, -int(metric_hex, 16), iface, gateway, flags)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None or best[4] & _RTF_REJECT:
        raise NoRoute(f"no route to {address} in /proc/net/ipv6_route (Network is unreachable)")
    kind = "local" if best[4] & _RTF_LOCAL else "unicast"
    return Route(destination=str(address), interface=best[2], gateway=best[3], kind=kind, method="/proc/net/ipv6_route")


def _refused(stderr: str) -> bool:
    # The kernel's own refusal (unreachable, prohibit, blackhole routes); anything else is `ip` failing.
    return stderr.startswith("RTNETLINK answers") or "unreachable" in stderr.lower()


def _run_ip(ip: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ip, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def lookup_route(
    address: IPAddress,
    *,
    ip: str | None = None,
    proc_net: Path = Path("/proc/net"),
    timeout_s: float = 5.0,
) -> Route:
    """Asks the kernel which route it would use for ``address``.

    Args:
        address: the destination, already validated by :mod:`ipaddress`.
        ip: path of the ``ip`` program; default: ``ip`` found on ``PATH`` now (none: skip to /proc).
        proc_net: where the kernel's tables are (a folder with ``route`` and ``ipv6_route``).
        timeout_s: bound for each ``ip`` call.

    Returns:
        The route, with ``method`` saying which lookup answered.

    Raises:
        TypeError: ``address`` is not an ``ipaddress`` address (validate text first).
        NoRoute: the kernel has no route to ``address``.
    """
    if not isinstance(address, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        raise TypeError(f"address must be an ipaddress.IPv4Address or IPv6Address, got {type(address).__name__}")
    dest = str(address)
    ip = ip or shutil.which("ip")
    if ip is not None:
        try:
            done = _run_ip(ip, ["-j", "route", "get", dest], timeout_s)
            if done.returncode == 0:
                try:
                    return parse_ip_json(done.stdout, dest)
                except ValueError as exc:  # an `ip` without -j prints text or complains
                    log.debug("ip -j route get gave no JSON (%s); trying the text form", exc)
            elif _refused(done.stderr):
                raise NoRoute(f"no route to {dest}: {done.stderr.strip()}")
            done = _run_ip(ip, ["route", "get", dest], timeout_s)
            if done.returncode == 0:
                return parse_ip_text(done.stdout, dest)
            if _refused(done.stderr):
                raise NoRoute(f"no route to {dest}: {done.stderr.strip()}")
            log.debug("ip route get %s failed (%s); reading /proc/net", dest, done.stderr.strip())
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            log.debug("ip route get %s failed (%s); reading /proc/net", dest, exc)
    if isinstance(address, ipaddress.IPv4Address):
        if address.is_loopback:  # 127/8 lives in the kernel's local table, which /proc/net/route omits
            return Route(destination=dest, interface="lo", kind="local", source=dest, method="/proc/net/route")
        return parse_proc_route((proc_net / "route").read_text(), address)
    return parse_proc_ipv6_route((proc_net / "ipv6_route").read_text(), address)
