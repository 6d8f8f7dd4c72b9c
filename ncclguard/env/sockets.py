"""The socket plan: which interface gloo and NCCL bind, decided from what this host looks like.

Pure functions over a :class:`HostView` (interfaces, routing table, what the hostname resolves to),
so that the rule can be tested without a network: :func:`decide` is the one place that says, for
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``,

- **kept**: the user set it (and it is checked: an interface that does not exist, or has no route
  to ``MASTER_ADDR``, is refused with the routes that do exist);
- **set**: unset, and the default would bind a loopback or unroutable address: the interface the
  kernel routes to ``MASTER_ADDR`` through is set;
- **left**: unset, and the default already binds an address the peers can reach;
- **off**: the plan is switched off (``NCCLGUARD_NET_PLAN=0``, ``--ncclguard-no-net-plan``).

The defaults are modelled on the libraries' own rules. gloo (torch's ``ProcessGroupGloo``
``createDefaultDevice``): resolve the hostname and bind the first address that binds, else
127.0.0.1. NCCL (``ncclFindInterfaces`` in ``src/misc/socket.cc``): an ``ib`` interface first, else
the first that is neither ``docker`` nor ``lo``, else ``docker``, else ``lo``.
:mod:`ncclguard.env.hostview` reads the host and applies the plan.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ncclguard.env.hostmodel import HostView, TableRoute

__all__ = [
    "GLOO_VAR",
    "NCCL_VAR",
    "NET_PLAN_VAR",
    "HostView",
    "SocketChoice",
    "SocketPlan",
    "TableRoute",
    "check_user",
    "decide",
    "gloo_default",
    "nccl_default",
    "plan_enabled",
    "reaches",
]

GLOO_VAR, NCCL_VAR = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
NET_PLAN_VAR = "NCCLGUARD_NET_PLAN"  # 0/false/no/off: ncclguard neither sets nor checks the interface
_OFF = ("0", "false", "no", "off")


class SocketChoice(BaseModel):
    """What the plan does with one variable: ``action`` (set, kept, left, off), the value, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variable: str
    action: Literal["set", "kept", "left", "off"]
    value: str | None = None
    why: str


class SocketPlan(BaseModel):
    """The socket plan of this rank.

    Attributes:
        enabled: False when switched off (nothing set, nothing checked).
        master: the master as given (``MASTER_ADDR``), or None.
        address: the address it resolved to.
        interface: the interface the kernel routes to it through, or None.
        choices: one per variable (gloo's, NCCL's).
        refusal: why the user's own interface cannot work, with this host's routes; None when fine.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool
    master: str | None = None
    address: str | None = None
    interface: str | None = None
    choices: list[SocketChoice] = []
    refusal: str | None = None

    def to_set(self) -> dict[str, str]:
        """The variables the plan sets, with their values."""
        return {c.variable: c.value for c in self.choices if c.action == "set" and c.value is not None}

    def lines(self) -> list[str]:
        """One line per variable: ``GLOO_SOCKET_IFNAME=veth0 set: <why>``, ``NCCL_SOCKET_IFNAME left unset: <why>``."""
        heads = {"set": "set", "kept": "kept", "left": "left unset", "off": "not touched"}
        out = []
        for c in self.choices:
            name = f"{c.variable}={c.value}" if c.value and c.action in ("set", "kept") else c.variable
            out.append(f"{name} {heads[c.action]}: {c.why}")
        return out


def plan_enabled(environ: Mapping[str, str]) -> bool:
    """False when ``NCCLGUARD_NET_PLAN`` is 0, false, no or off."""
    return environ.get(NET_PLAN_VAR, "").strip().lower() not in _OFF


def gloo_default(view: HostView) -> tuple[str, str]:
    """The address gloo binds when ``GLOO_SOCKET_IFNAME`` is unset, and its interface.

    Returns:
        The first address the hostname resolves to that this host can bind, else 127.0.0.1.
    """
    for addr in view.hostname_addresses:
        owner = view.owner(addr)
        if owner is not None:
            return addr, owner
        if ipaddress.ip_address(addr).is_loopback:  # all of 127/8 binds on lo
            return addr, view.loopback()
    return "127.0.0.1", view.loopback()


def nccl_default(view: HostView, family: int = 4) -> str | None:
    """The interface NCCL's bootstrap picks when ``NCCL_SOCKET_IFNAME`` is unset (the first it finds).

    Args:
        view: the host.
        family: 4 or 6, the master's address family.
    """
    usable = []
    for name, addrs in view.interfaces.items():
        for a in addrs:
            ip = ipaddress.ip_address(a)
            if ip.version == family and not ip.is_link_local:
                usable.append(name)
                break
    for rule in (
        lambda n: n.startswith("ib"),
        lambda n: not n.startswith(("docker", "lo")),
        lambda n: n.startswith("docker"),
        lambda n: n.startswith("lo"),
    ):
        found = [n for n in usable if rule(n)]
        if found:
            return found[0]
    return None


def reaches(interface: str, address: str, view: HostView) -> bool:
    """True when ``interface`` can carry traffic to ``address``.

    An address of this host counts as reached by every interface (the master's own host binds
    where it likes); else a routing-table entry through ``interface`` must contain the address.
    """
    if view.is_local(address):
        return True
    ip = ipaddress.ip_address(address)
    for r in view.routes:
        if r.interface != interface:
            continue
        try:
            if ip in ipaddress.ip_network(r.network, strict=False):
                return True
        except ValueError:
            continue
    return False


def _names(variable: str, value: str, view: HostView) -> tuple[list[str], str | None]:
    """The interfaces a user's value matches, or why it matches none."""
    text = value.strip()
    if variable == GLOO_VAR:  # gloo: a comma-separated list of exact names
        wanted = [n.strip() for n in text.split(",") if n.strip()]
        missing = [n for n in wanted if n not in view.interfaces]
        if missing:
            return [], f"{variable}={value} names no interface of this host ({', '.join(missing)})"
        return wanted, None
    exact = text.startswith("=")  # NCCL: '=name,...' exact names, else prefixes
    parts = [p.strip() for p in text.lstrip("=").split(",") if p.strip()]
    found = [n for n in view.interfaces if any(n == p if exact else n.startswith(p) for p in parts)]
    if not found:
        return [], f"{variable}={value} matches no interface of this host"
    return found, None


def check_user(variable: str, value: str, address: str | None, view: HostView) -> str | None:
    """Why the user's own ``variable=value`` cannot work on this host, or None when it can.

    A NCCL exclusion list (``^docker,lo``) is not checked: it names what NCCL must not use.

    Returns:
        One sentence with the interfaces and the routes that do exist, or None.
    """
    if not value.strip() or (variable == NCCL_VAR and value.strip().startswith("^")):
        return None
    names, problem = _names(variable, value, view)
    if problem is None and address is not None:
        carriers = [n for n in names if reaches(n, address, view)]
        if variable == GLOO_VAR and len(carriers) < len(names):
            bad = [n for n in names if n not in carriers]
            problem = f"{variable}={value}: {', '.join(bad)} has no route to MASTER_ADDR {address}"
        elif not carriers:
            problem = f"{variable}={value}: no interface it matches has a route to MASTER_ADDR {address}"
    if problem is None:
        return None
    routes = "; ".join(r.text() for r in view.routes) or "none"
    return (
        f"{problem}. Interfaces here: {', '.join(view.interfaces) or 'none'}; routes here: {routes}. "
        f"Name an interface with a route to the master, or unset {variable} and ncclguard picks it."
    )


def _family(address: str | None) -> int:
    return 4 if address is None else ipaddress.ip_address(address).version


def _choice(variable: str, address: str | None, interface: str | None, view: HostView) -> SocketChoice:
    """The choice for an unset variable, the plan on."""
    if address is None or interface is None:
        why = "no route to MASTER_ADDR" if address is not None else "no MASTER_ADDR to route to"
        return SocketChoice(variable=variable, action="left", why=f"{why}: the library's default is left")
    if variable == GLOO_VAR:
        bound, on = gloo_default(view)
        default = f"gloo would bind {bound} on {on} (hostname {view.hostname or '?'} resolves to it)"
        value = interface
    else:
        on = nccl_default(view, _family(address)) or view.loopback()
        default = f"NCCL would pick {on}"
        value = f"={interface}"  # '=': exactly this interface, not every name it prefixes
    loopback = on == view.loopback()
    if on == interface or (not loopback and reaches(on, address, view)):
        why = f"{default}, which reaches MASTER_ADDR {address}"
        return SocketChoice(variable=variable, action="left", why=why)
    what = "a loopback address" if loopback else f"an interface with no route to {address}"
    why = f"{default}: {what}; the route to MASTER_ADDR {address} goes through {interface}"
    return SocketChoice(variable=variable, action="set", value=value, why=why)


def decide(
    environ: Mapping[str, str],
    view: HostView,
    *,
    master: str | None,
    address: str | None,
    interface: str | None,
) -> SocketPlan:
    """The socket plan: for gloo's and NCCL's variable, kept (the user's, checked), set, left or off.

    Args:
        environ: the environment the rank starts with (the user's variables, ``NCCLGUARD_NET_PLAN``).
        view: this host.
        master: ``MASTER_ADDR`` as given.
        address: the address it resolved to (None: unresolved or not given).
        interface: the interface the kernel routes to ``address`` through (None: no route).

    Returns:
        The plan; ``refusal`` says why a user's interface cannot work.
    """
    enabled = plan_enabled(environ)
    choices, refusals = [], []
    for variable in (GLOO_VAR, NCCL_VAR):
        user = environ.get(variable, "")
        if not enabled:
            off = f"the network plan is off ({NET_PLAN_VAR}=0)"
            choices.append(SocketChoice(variable=variable, action="off", value=user or None, why=off))
        elif user.strip():
            problem = check_user(variable, user, address, view)
            if problem is not None:
                refusals.append(problem)
            choices.append(SocketChoice(variable=variable, action="kept", value=user, why="set by the user"))
        else:
            choices.append(_choice(variable, address, interface, view))
    return SocketPlan(
        enabled=enabled,
        master=master,
        address=address,
        interface=interface,
        choices=choices,
        refusal=" ".join(refusals) or None,
    )
