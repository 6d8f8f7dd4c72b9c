"""InfiniBand / RoCE devices and their port states, read from ``/sys/class/infiniband``.

Each device folder holds ``ports/<n>/{state,phys_state,link_layer,rate}`` (e.g. ``4: ACTIVE``,
``5: LinkUp``, ``InfiniBand`` or ``Ethernet`` for RoCE, ``200 Gb/sec (4X HDR)``) and
``device/net/<ifname>`` for the network interfaces on the same adapter (``ib0`` for IPoIB).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

__all__ = ["IbDevice", "IbPort", "SYSFS_INFINIBAND", "read_infiniband"]

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


class IbPort(BaseModel):
    """One port of an InfiniBand/RoCE adapter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED
    phys_state: str  # LinkUp, Polling, Disabled, ...
    link_layer: str  # InfiniBand, or Ethernet for RoCE
    rate: str

    @property
    def active(self) -> bool:
        """True when the port is ACTIVE (linked and configured by the subnet manager)."""
        return self.state == "ACTIVE"


class IbDevice(BaseModel):
    """An adapter (``mlx5_0``), its ports and the network interfaces on it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    ports: list[IbPort]
    netdevs: list[str]

    @property
    def active(self) -> bool:
        """True when any port of the adapter is ACTIVE."""
        return any(p.active for p in self.ports)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _state_name(text: str) -> str:
    # sysfs writes "4: ACTIVE"; keep the name.
    return text.split(":", 1)[1].strip() if ":" in text else text


def read_infiniband(root: Path = SYSFS_INFINIBAND) -> list[IbDevice]:
    """Lists the adapters under ``root`` (none when the folder does not exist), sorted by name."""
    if not root.is_dir():
        return []
    devices = []
    for dev in sorted(root.iterdir(), key=lambda p: p.name):
        ports = []
        ports_dir = dev / "ports"
        if ports_dir.is_dir():
            for port in sorted(ports_dir.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                if not port.name.isdigit():
                    continue
                ports.append(
                    IbPort(
                        port=int(port.name),
                        state=_state_name(_read(port / "state")),
                        phys_state=_state_name(_read(port / "phys_state")),
                        link_layer=_read(port / "link_layer"),
                        rate=_read(port / "rate"),
                    )
                )
        net = dev / "device" / "net"
        netdevs = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
        devices.append(IbDevice(name=dev.name, ports=ports, netdevs=netdevs))
    return devices
