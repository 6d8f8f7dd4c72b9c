"""What the socket plan knows of a host (:mod:`ncclguard.env.sockets` decides over it;
:func:`ncclguard.env.hostview.observe` reads it from this host)."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict

__all__ = ["HostView", "TableRoute"]


class TableRoute(BaseModel):
    """One entry of the main routing table: ``network`` (``0.0.0.0/0`` for a default route) via ``interface``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    network: str
    interface: str
    gateway: str | None = None

    def text(self) -> str:
        """``198.18.0.0/30 dev veth`` (``default via 10.0.0.1 dev eth0``), as ``ip route`` prints it."""
        net = "default" if self.network in ("0.0.0.0/0", "::/0") else self.network
        via = f" via {self.gateway}" if self.gateway else ""
        return f"{net}{via} dev {self.interface}"


class HostView(BaseModel):
    """What :func:`decide` needs to know about this host.

    Attributes:
        hostname: this host's name.
        hostname_addresses: what the hostname resolves to, in the resolver's order.
        interfaces: each interface's addresses, in the kernel's order (``getifaddrs``).
        routes: the main routing table (IPv4 and IPv6).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hostname: str = ""
    hostname_addresses: list[str] = []
    interfaces: dict[str, list[str]] = {}
    routes: list[TableRoute] = []

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
