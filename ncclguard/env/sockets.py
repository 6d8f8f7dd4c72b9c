"""The socket plan: which interface gloo and NCCL bind, decided from what this host looks like.

Pure functions over a :class:`HostView` (interfaces, routing tables and rules, what the hostname
resolves to), so that the rule can be tested without a network: :func:`decide` is the one place that
says, for ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``,

- **kept**: the user set it. It is refused only when it cannot work (:func:`assess_user`): a name
  that matches no interface of this host, and for gloo an interface with no IP address or, on a job
  of several nodes, one with only loopback addresses. No route to ``MASTER_ADDR`` through it is a
  **warning**, never a refusal: NCCL never connects to ``MASTER_ADDR`` (only the c10d store does),
  and gloo connects to the peers' own gloo addresses, so a fabric network of its own works;
- **set**: unset, and the default would bind a loopback or unroutable address: the interface the
  kernel routes to ``MASTER_ADDR`` through is set. On the master's own host, where ``MASTER_ADDR``
  resolves to a loopback address (a hostname mapped to 127.0.1.1) and the job spans several nodes,
  the interface the other nodes reach (:func:`outward`) is set instead, or a warning says why none is;
- **left**: unset, and the default already binds an address the peers can reach;
- **off**: the plan is switched off (``NCCLGUARD_NET_PLAN=0``, ``--ncclguard-no-net-plan``).

The defaults are modelled on the libraries' own rules. gloo (torch's ``ProcessGroupGloo``
``createDefaultDevice``): resolve the hostname and bind the first address that binds, else
127.0.0.1. NCCL (``ncclFindInterfaces`` in ``src/misc/socket.cc``): an ``ib`` interface first, else
the first that is neither ``docker`` nor ``lo``, else ``docker``, else ``lo``; a ``NCCL_SOCKET_IFNAME``
of one character is ignored. :mod:`ncclguard.env.hostview` reads the host and applies the plan.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ncclguard.env.envvars import nccl_ifname_matches
from ncclguard.env.hostmodel import HostView, RouteRule, TableRoute

__all__ = [
    "BRIDGE_PREFIXES",
    "GLOO_VAR",
    "NCCL_VAR",
    "NET_PLAN_VAR",
    "HostView",
    "RouteRule",
    "SocketChoice",
    "SocketPlan",
    "TableRoute",
    "UserCheck",
    "assess_user",
    "check_user",
    "decide",
    "gloo_default",
    "nccl_default",
    "nodes_of",
    "outward",
    "plan_enabled",
    "reaches",
]

GLOO_VAR, NCCL_VAR = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
NET_PLAN_VAR = "NCCLGUARD_NET_PLAN"  # 0/false/no/off: ncclguard neither sets nor checks the interface
_OFF = ("0", "false", "no", "off")
# Container bridges: an address there is this host's own, the other nodes do not reach it.
BRIDGE_PREFIXES = ("docker", "br-", "virbr", "cni", "podman", "lxcbr")


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
        warnings: what may not work and is let through (a user's interface with no route to the
            master, a master on loopback with no interface found for the other nodes).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool
    master: str | None = None
    address: str | None = None
    interface: str | None = None
    choices: list[SocketChoice] = []
    refusal: str | None = None
    warnings: list[str] = []

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


class UserCheck(BaseModel):
    """What :func:`assess_user` found of a user's own variable: why it cannot work, or what may not."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refusal: str | None = None
    warnings: list[str] = []


def plan_enabled(environ: Mapping[str, str]) -> bool:
    """False when ``NCCLGUARD_NET_PLAN`` is 0, false, no or off."""
    return environ.get(NET_PLAN_VAR, "").strip().lower() not in _OFF


def nodes_of(environ: Mapping[str, str]) -> int | None:
    """How many nodes the job spans, from what torchrun gives a rank.

    Returns:
        ``GROUP_WORLD_SIZE``, else ``WORLD_SIZE // LOCAL_WORLD_SIZE``, else None (unknown).
    """
    group = environ.get("GROUP_WORLD_SIZE", "")
    if group.isdigit() and int(group) > 0:
        return int(group)
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, int(world) // int(local))
    return None


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

    Returns:
        The interface's name, or None when no interface has an address of ``family``.
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
    where it likes); else a route through ``interface`` (a next hop of a multipath route counts)
    must contain the address, in a table that a policy rule sends traffic from the interface's
    addresses to (every table when no rule is known). Lenient on purpose: it answers "can", so that
    a warning is not given where a route exists.

    Args:
        interface: the interface's name.
        address: the destination.
        view: the host.

    Returns:
        Whether some route carries it.
    """
    if view.is_local(address):
        return True
    ip = ipaddress.ip_address(address)
    tables = view.tables_for(interface, ip.version)
    for r in view.routes:
        if r.interface != interface or (tables is not None and r.table not in tables):
            continue
        try:
            if ip in ipaddress.ip_network(r.network, strict=False):
                return True
        except ValueError:
            continue
    return False


def _usable(address: str, family: int) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.version == family and not ip.is_loopback and not ip.is_link_local


def outward(view: HostView, family: int = 4) -> tuple[str, str] | None:
    """The interface the other nodes reach this host through, for a master whose address is loopback here.

    In order: the interface holding the address at which the other nodes' connections to the store
    arrive (they reached this host there); the interface holding an address of the hostname that is not
    loopback; the interface of the main table's default route; the one interface with a routable
    address (container bridges aside).

    Args:
        view: the host.
        family: 4 or 6.

    Returns:
        (the interface, how it was found), or None when none of the three answers.
    """
    for addr in view.store_links:
        owner = view.owner(addr) if _usable(addr, family) else None
        if owner is not None:
            return owner, f"the other nodes' connections to the store arrive at {addr}, which it holds"
    for addr in view.hostname_addresses:
        owner = view.owner(addr) if _usable(addr, family) else None
        if owner is not None:
            return owner, f"the hostname {view.hostname or '?'} also resolves to {addr}, which it holds"
    default = "0.0.0.0/0" if family == 4 else "::/0"
    via = [r.interface for r in view.routes if r.network == default and r.table == "main"]
    via = [n for n in dict.fromkeys(via) if not view.only_loopback(n)]
    if via:
        return via[0], "this host's default route goes through it"
    routable = [
        name
        for name, addrs in view.interfaces.items()
        if not name.startswith(BRIDGE_PREFIXES) and any(_usable(a, family) for a in addrs)
    ]
    if len(routable) == 1:
        return routable[0], "the one interface of this host with a routable address"
    return None


def _example(view: HostView, address: str | None) -> str:
    """An interface to name in a hint: one that reaches ``address``, else one that is not loopback."""
    others = [n for n in view.interfaces if not view.only_loopback(n)]
    reaching = [n for n in others if address is not None and reaches(n, address, view)]
    return (reaching or others or [view.loopback()])[0]


def _refused(variable: str, problem: str, address: str | None, view: HostView) -> str:
    """The refusal: what is wrong, this host's interfaces and routes, and what to set."""
    routes = "; ".join(r.text() for r in view.routes) or "none"
    example = _example(view, address)
    if variable == NCCL_VAR:
        syntax = (
            f"a comma list of name prefixes; '=' first for exact names, '^' first to exclude: "
            f"e.g. {variable}=={example}"
        )
    else:
        syntax = f"a comma list of exact names: e.g. {variable}={example}"
    return (
        f"{problem}. Interfaces here: {', '.join(view.interfaces) or 'none'}; routes here: {routes}. "
        f"Set {variable} to interfaces of this host that the other nodes reach ({syntax}), or unset "
        f"{variable} and ncclguard picks the one that routes to MASTER_ADDR."
    )


def _gloo(value: str, address: str | None, view: HostView, nodes: int | None) -> UserCheck:
    """gloo's variable: exact names, each must exist and hold an address; loopback only on one node."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    missing = [n for n in names if n not in view.interfaces]
    if missing:
        problem = f"{GLOO_VAR}={value} names no interface of this host ({', '.join(missing)})"
        return UserCheck(refusal=_refused(GLOO_VAR, problem, address, view))
    bare = [n for n in names if not view.interfaces.get(n)]
    if bare:
        problem = f"{GLOO_VAR}={value}: {', '.join(bare)} has no IP address, which gloo binds"
        return UserCheck(refusal=_refused(GLOO_VAR, problem, address, view))
    loop = [n for n in names if view.only_loopback(n)]
    if loop and nodes is not None and nodes > 1:
        problem = (
            f"{GLOO_VAR}={value}: {', '.join(loop)} holds only loopback addresses, which the other nodes of "
            f"this {nodes}-node job cannot reach (gloo connects every rank to the others at that address)"
        )
        return UserCheck(refusal=_refused(GLOO_VAR, problem, address, view))
    bad = [n for n in names if address is not None and not reaches(n, address, view)]
    if not bad:
        return UserCheck()
    return UserCheck(
        warnings=[
            f"{GLOO_VAR}={value}: no route to MASTER_ADDR {address} through {', '.join(bad)} here; kept: gloo "
            f"connects to the other ranks' own {GLOO_VAR} addresses, never to MASTER_ADDR, so this works when "
            f"theirs share a network with {', '.join(bad)}. If the job stops at its first collective, set "
            f"{GLOO_VAR} to the interface the other nodes reach, or unset it"
        ]
    )


def _nccl(value: str, address: str | None, view: HostView) -> UserCheck:
    """NCCL's variable: it must match an interface; everything else is a warning."""
    if len(value) <= 1:  # ncclFindInterfaces: `if (env && strlen(env) > 1)`
        return UserCheck(warnings=[f"{NCCL_VAR}={value}: NCCL ignores a value of one character and picks its own"])
    names = [n for n in view.interfaces if n in nccl_ifname_matches(value, list(view.interfaces))]
    if not names:
        problem = f"{NCCL_VAR}={value} matches no interface of this host"
        return UserCheck(refusal=_refused(NCCL_VAR, problem, address, view))
    warnings = []
    if not any(view.interfaces.get(n) for n in names):
        warnings.append(
            f"{NCCL_VAR}={value}: {', '.join(names)} holds no IP address: NCCL's bootstrap finds no socket "
            "interface there when NCCL starts"
        )
    elif address is not None and not any(reaches(n, address, view) for n in names):
        warnings.append(
            f"{NCCL_VAR}={value}: no route to MASTER_ADDR {address} through {', '.join(names)} here; kept: "
            "NCCL never connects to MASTER_ADDR (only the c10d store does), its bootstrap and data go between "
            f"the nodes' own {NCCL_VAR} interfaces, so a fabric network of its own works. If NCCL's "
            f"bootstrap times out, check that {', '.join(names)} reach the other nodes' interfaces"
        )
    return UserCheck(warnings=warnings)


def assess_user(
    variable: str, value: str, address: str | None, view: HostView, *, nodes: int | None = None
) -> UserCheck:
    """Whether the user's own ``variable=value`` can work on this host.

    Refused only what cannot work: a name that matches no interface (NCCL's syntax: comma list,
    ``^`` exclusion, ``=`` exact names, ``name:port``), and for gloo an interface with no address or,
    when the job spans several nodes, one with only loopback addresses. No route to ``MASTER_ADDR``
    is a warning.

    Args:
        variable: ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME``.
        value: what the user set.
        address: the master's address (None: not known).
        view: this host.
        nodes: how many nodes the job spans (None: not known).

    Returns:
        The refusal (one sentence with this host's interfaces and routes and what to set), or the warnings.
    """
    if not value.strip():
        return UserCheck()
    if variable == GLOO_VAR:
        return _gloo(value, address, view, nodes)
    return _nccl(value, address, view)


def check_user(
    variable: str, value: str, address: str | None, view: HostView, *, nodes: int | None = None
) -> str | None:
    """Why the user's own ``variable=value`` cannot work on this host, or None when it can (see :func:`assess_user`).

    Returns:
        One sentence with the interfaces and the routes that do exist, or None.
    """
    return assess_user(variable, value, address, view, nodes=nodes).refusal


def _family(address: str | None) -> int:
    return 4 if address is None else ipaddress.ip_address(address).version


def _choice(
    variable: str, address: str | None, interface: str | None, view: HostView, lifted: str | None = None
) -> SocketChoice:
    """The choice for an unset variable, the plan on; ``lifted``: why ``interface`` is the one the other
    nodes reach, when the master is on loopback here and the job spans several nodes."""
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
    loopback = view.only_loopback(on)
    if lifted is not None:
        if not loopback:
            return SocketChoice(variable=variable, action="left", why=f"{default}, not a loopback address")
        why = f"{default}: a loopback address; {lifted}"
        return SocketChoice(variable=variable, action="set", value=value, why=why)
    if on == interface or (not loopback and reaches(on, address, view)):
        why = f"{default}, which reaches MASTER_ADDR {address}"
        return SocketChoice(variable=variable, action="left", why=why)
    what = "a loopback address" if loopback else f"an interface with no route to {address}"
    why = f"{default}: {what}; the route to MASTER_ADDR {address} goes through {interface}"
    return SocketChoice(variable=variable, action="set", value=value, why=why)


def _lift(master: str | None, address: str, nodes: int, view: HostView) -> tuple[str | None, str]:
    """For a master on loopback here and a job of ``nodes`` nodes: (the interface the others reach,
    the reason), or (None, the warning)."""
    head = f"MASTER_ADDR {master or address} resolves to {address}, a loopback address, on this host (the master's)"
    found = outward(view, _family(address))
    if found is not None:
        return found[0], f"{head} and the job spans {nodes} nodes: they reach this host through {found[0]} ({found[1]})"
    candidates = [n for n in view.interfaces if not view.only_loopback(n)]
    return None, (
        f"{head} and the job spans {nodes} nodes: gloo and NCCL left alone would bind loopback here, which "
        f"the other nodes cannot reach, and ncclguard found no one interface that reaches them (candidates: "
        f"{', '.join(candidates) or 'none'}; no default route). Set {GLOO_VAR} and {NCCL_VAR} to the "
        "interface the other nodes reach, or MASTER_ADDR to this host's routable address"
    )


def decide(
    environ: Mapping[str, str],
    view: HostView,
    *,
    master: str | None,
    address: str | None,
    interface: str | None,
    nodes: int | None = None,
) -> SocketPlan:
    """The socket plan: for gloo's and NCCL's variable, kept (the user's, checked), set, left or off.

    Args:
        environ: the environment the rank starts with (the user's variables, ``NCCLGUARD_NET_PLAN``,
            torchrun's ``GROUP_WORLD_SIZE``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``).
        view: this host.
        master: ``MASTER_ADDR`` as given.
        address: the address it resolved to (None: unresolved or not given).
        interface: the interface the kernel routes to ``address`` through (None: no route).
        nodes: how many nodes the job spans (default: read from ``environ``).

    Returns:
        The plan; ``refusal`` says why a user's interface cannot work, ``warnings`` what may not.
    """
    enabled = plan_enabled(environ)
    nodes = nodes_of(environ) if nodes is None else nodes
    choices: list[SocketChoice] = []
    refusals: list[str] = []
    warnings: list[str] = []
    lifted: str | None = None
    if enabled and address is not None and ipaddress.ip_address(address).is_loopback and (nodes or 1) > 1:
        interface, lifted = _lift(master, address, nodes or 1, view)
    for variable in (GLOO_VAR, NCCL_VAR):
        user = environ.get(variable, "")
        if not enabled:
            off = f"the network plan is off ({NET_PLAN_VAR}=0)"
            choices.append(SocketChoice(variable=variable, action="off", value=user or None, why=off))
        elif user.strip():
            check = assess_user(variable, user, address, view, nodes=nodes)
            refusals += [check.refusal] if check.refusal is not None else []
            warnings += check.warnings
            why = "set by the user" + (" (kept despite a warning: see below)" if check.warnings else "")
            choices.append(SocketChoice(variable=variable, action="kept", value=user, why=why))
        elif lifted is not None and interface is None:
            if lifted not in warnings:
                warnings.append(lifted)
            why = "MASTER_ADDR is loopback here and no interface is known to reach the other nodes: left (see the warning)"
            choices.append(SocketChoice(variable=variable, action="left", why=why))
        else:
            choices.append(_choice(variable, address, interface, view, lifted))
    return SocketPlan(
        enabled=enabled,
        master=master,
        address=address,
        interface=interface,
        choices=choices,
        refusal=" ".join(refusals) or None,
        warnings=warnings,
    )
