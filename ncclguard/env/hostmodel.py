"""What the socket plan knows of a host (:mod:`ncclguard.env.sockets` decides over it;
:func:`ncclguard.env.hostview.observe` reads it from this host)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict

__all__ = ["HostView", "RouteRule", "TableRoute"]


class TableRoute(BaseModel):
    """One unicast entry of a routing table: ``network`` (``0.0.0.0/0`` for a default route) via ``interface``.

    A multipath (ECMP) route is one entry per next hop, each with its own interface.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    network: str
    interface: str
    gateway: str | None = None
    table: str = "main"

    def text(self) -> str:
        """``198.18.0.0/30 dev veth`` (``default via 10.0.0.1 dev eth0 table 100``), as ``ip route`` prints it."""
        net = "default" if self.network in ("0.0.0.0/0", "::/0") else self.network
        via = f" via {self.gateway}" if self.gateway else ""
        table = "" if self.table == "main" else f" table {self.table}"
        return f"{net}{via} dev {self.interface}{table}"


class RouteRule(BaseModel):
    """One policy-routing rule (``ip rule``) of ``family`` (4 or 6) that looks up a table: traffic from
    ``source`` (None: from all) is routed by ``table``. Rules with other selectors (fwmark, iif, uid...) are kept as if they
    could match: the plan asks whether a route *can* carry the traffic, never refuses on it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    priority: int = 0
    table: str
    source: str | None = None
    family: int = 4


class HostView(BaseModel):
    """What :func:`decide` needs to know about this host.

    Attributes:
        hostname: this host's name.
        hostname_addresses: what the hostname resolves to, in the resolver's order.
        interfaces: each interface's addresses, in the kernel's order (``getifaddrs``).
        routes: the unicast routes of every table (IPv4 and IPv6), one entry per next hop.
        rules: the policy-routing rules that look up a table (IPv4 and IPv6); empty when unknown
            (then every table counts).
        store_links: this host's addresses at which other hosts' connections to the job's store
            (``MASTER_PORT``) arrive; read only on the master's host when ``MASTER_ADDR`` is loopback there.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hostname: str = ""
    hostname_addresses: list[str] = []
    interfaces: dict[str, list[str]] = {}
    routes: list[TableRoute] = []
    rules: list[RouteRule] = []
    store_links: list[str] = []

    def owner(self, address: str) -> str | None:
        """The interface that holds ``address``, or None."""
        want = ipaddress.ip_address(address)
        for name, addrs in self.interfaces.items():
            for a in addrs:
                try:
                    if ipaddress.ip_address(a) == want:
                        return name
                except ValueError:
                    continue
        return None

    def loopback(self) -> str:
        """The loopback interface's name (``lo`` on Linux)."""
        return self.owner("127.0.0.1") or self.owner("::1") or "lo"

    def is_local(self, address: str) -> bool:
        """True for a loopback address or one an interface of this host holds."""
        return ipaddress.ip_address(address).is_loopback or self.owner(address) is not None

    def only_loopback(self, interface: str) -> bool:
        """True when ``interface`` is the loopback interface, or holds addresses and all are loopback."""
        if interface == self.loopback():
            return True
        addrs = [ipaddress.ip_address(a) for a in self.interfaces.get(interface, [])]
        return bool(addrs) and all(a.is_loopback for a in addrs)

    def tables_for(self, interface: str, version: int) -> set[str] | None:
        """The tables the rules send traffic from ``interface``'s addresses to (``version``: 4 or 6).

        Returns:
            The table names, or None when no rule of that family is known (every table counts).
        """
        rules = [r for r in self.rules if r.family == version]
        if not rules:
            return None
        own = [ipaddress.ip_address(a) for a in self.interfaces.get(interface, [])]
        own = [a for a in own if a.version == version]
        tables = set()
        for r in rules:
            if r.source is None:
                tables.add(r.table)
                continue
            try:
                net = ipaddress.ip_network(r.source, strict=False)
            except ValueError:
                tables.add(r.table)  # a selector not understood: as if it could match
                continue
            if any(a in net for a in own):
                tables.add(r.table)
        return tables
