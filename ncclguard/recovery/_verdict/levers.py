"""The levers of the engine's verdict (:mod:`ncclguard.recovery._verdict.verdict`): the user's judge
bound, the world groups' sequence numbers, the job's store, where a peer runs, ending a peer's op from
this side, and asking a peer's supervisor to judge and end it (:mod:`ncclguard.store.asks`).

A gloo op in flight ends only when its peer's connection fails: ``ProcessGroup.abort()`` wakes
nothing (docs/reference/recovery-stuck-ranks.md). Shutting down this process's TCP connections to a stuck peer of this
host makes the op fail at once ("Connection closed by peer"; measured 2.0 s after the cut on 3
ranks, each waiting rank cutting its own).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import HOSTNAME, node_address
from ncclguard.backend_rules import BackendRules
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable, TorchCompatError
from ncclguard.incidents.model import Heartbeat
from ncclguard.store.asks import JudgeAnswer, JudgeAsk, post_ask, read_answer
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import store_for_this_thread, unprefixed
from ncclguard.store.deaths import STUCK_RC, DeathNotice, notice_now, post_death, read_deaths
from ncclguard.watching.judge.rules import Ruling
from ncclguard.world import Slot, current_world

__all__ = [
    "DEFAULT_JUDGE_S",
    "STUCK_AFTER_VAR",
    "abort_world",
    "ask_supervisor",
    "cut_connections",
    "cut_job_connections",
    "job_peer_pids",
    "job_store",
    "judge_after",
    "on_this_host",
    "pick_world_group",
    "post_stuck_death",
    "standing",
    "store_ports",
    "stuck_notices",
    "supervisor_answer",
    "unprefixed",
    "world_groups",
    "world_seq",
]

DEFAULT_JUDGE_S = 30.0  # before the warm-up: a stuck rank still needs stuck evidence to be acted on
STUCK_AFTER_VAR = "NCCLGUARD_STUCK_AFTER_S"
STORE_BOUND_S = 5.0


def judge_after() -> float | None:
    """The user's judge bound from ``NCCLGUARD_STUCK_AFTER_S``: seconds, None when unset; 0 for ``off``.

    Raises:
        ValueError: a value that is neither ``off`` nor a positive number of seconds.
    """
    raw = os.environ.get(STUCK_AFTER_VAR, "").strip()
    if not raw:
        return None
    if raw.lower() == "off":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise ValueError(f"{STUCK_AFTER_VAR} must be a positive number of seconds or 'off', got {raw!r}")
    return value


ACTIVE_S = 120.0  # a group whose number stood this much longer than the newest one's is out of use


@dataclass
class _Looks:
    """What one world's looks remember of its whole-world groups (a rebuild starts afresh).

    Attributes:
        picked: the group the last look compared in: kept while nothing tells another apart.
        moved: whole-world group -> (this rank's number, when it last changed).
    """

    picked: str | None = None
    moved: dict[str, tuple[int, float]] = field(default_factory=dict)


LOOKS: Slot[_Looks] = Slot("the verdict's whole-world groups", lambda world: _Looks())


def world_groups(names: dict[dist.ProcessGroup, str] | None = None) -> tuple[str, dict[str, int]] | None:
    """The default group's name, and this rank's backend sequence number in every group whose
    membership is the whole world (the default group, and copies of it such as the one DeepSpeed's
    ``deepspeed.comm`` clones at ``initialize`` and runs its collectives on); None without a group."""
    try:
        names = names or compat.group_names()
        default = names[compat.default_group()]
        size = dist.get_world_size()
        ranks = compat.group_ranks()
        out = {default: compat.sequence_number(compat.default_group())}
        for pg, name in names.items():
            if name != default and len(ranks.get(pg, {})) == size and not compat.rank_not_in_group(pg):
                try:
                    out[name] = compat.sequence_number(pg)
                except (TorchCompatError, RuntimeError):
                    continue  # a group being destroyed, or a backend without the counter
        return default, out
    except (TorchCompatError, RuntimeError, KeyError, ValueError):
        return None


def pick_world_group(
    mine: dict[str, int], peers: list[dict[str, int] | None], default: str, last: str | None = None
) -> str:
    """The whole-world group to tell peers behind and ahead by: the one with the most peers behind
    this rank (a peer behind in any such group is behind), else the one with the most ahead, else
    ``last`` (so that this rank's own op count does not jump between looks), else ``default``.
    Ties go to ``last``, then ``default``, then the name.

    Args:
        mine: this rank's sequence number per whole-world group (:func:`world_groups`).
        peers: each peer's ``backend_seq`` from its heartbeat (None where it carries none).
        default: the default group's name.
        last: the group picked at the previous look.
    """

    def count(g: str, sign: int) -> int:
        return sum(1 for p in peers if p and g in p and (mine[g] - p[g]) * sign > 0)

    def rank(g: str) -> tuple[int, int, str]:
        return (0 if g == last else 1, 0 if g == default else 1, g)

    for sign in (1, -1):
        best = max((count(g, sign) for g in mine), default=0)
        if best:
            return min((g for g in mine if count(g, sign) == best), key=rank)
    return last if last in mine else default


def world_seq(names: dict[dist.ProcessGroup, str] | None = None) -> tuple[str, int] | None:
    """The whole-world group the verdict tells "behind" by (:func:`pick_world_group`, over the
    watched peers' heartbeats) and this rank's backend sequence number in it, or None.

    A copy of the world whose number here stood still :data:`ACTIVE_S` longer than the most recently
    used one is out of use (an evaluation group that timed out, kept unreleased): a difference there
    says nothing of now, so only the default group and the copies in use are compared."""
    got = world_groups(names)
    if got is None:
        return None
    default, mine = got
    looks = current_world().get(LOOKS)
    now = time.monotonic()
    for g, seq in mine.items():
        if looks.moved.get(g, (None, 0.0))[0] != seq:
            looks.moved[g] = (seq, now)
    newest = max(looks.moved[g][1] for g in mine)
    mine = {g: seq for g, seq in mine.items() if g == default or newest - looks.moved[g][1] <= ACTIVE_S}
    peers: list[dict[str, int] | None] = []
    if len(mine) > 1:
        from ncclguard.watching.watchdog import current_watchdog

        wd = current_watchdog()
        if wd is not None:
            peers = [hb.backend_seq for hb, _ in wd.peer_beats()[1].values()]
    group = pick_world_group(mine, peers, default, looks.picked)
    if group != looks.picked and looks.picked is not None:
        log.debug("verdict: ranks behind and ahead are told by group %s now (was %s)", group, looks.picked)
    looks.picked = group
    return group, mine[group]


@dataclass(frozen=True)
class Standing:
    """Where the peers stand against this rank in the compared group, by their heartbeats.

    Attributes:
        behind: peers whose count is lower (they have not reached this rank's op).
        ahead: peers whose count is higher (they wait in an op this rank has not reached).
        uncounted: peers whose heartbeat carries no count in that group (one published while the
            group was being made, inside a rebuild's ``init_process_group``): it tells nothing, so they
            are judged as peers with no heartbeat in this world (from ``/proc``, or by their supervisor).
        furthest: the peers behind at the lowest count any peer's newest heartbeat carries, a stale
            one's too. Only they are judged: a peer behind this rank but ahead of another may be
            waiting for that one (a victim: a broadcast relayed through a stopped rank holds its
            receivers at a lower count than the ranks that went on into the backward), and two
            waiting ranks that judged it in the same look, before its own vote was in its heartbeat,
            agreed on a healthy rank (the stuck drill, 4 ranks, the culprit SIGSTOPped: 1 launch of 4).
    """

    behind: frozenset[int]
    ahead: frozenset[int]
    uncounted: frozenset[int]
    furthest: frozenset[int] = frozenset()


def standing(counts: dict[int, dict[str, int] | None], group: str, seq: int) -> Standing:
    """Sorts the peers by their count in ``group`` against this rank's ``seq``.

    Args:
        counts: each peer's ``backend_seq`` from its heartbeat (None where it carries none).
        group: the whole-world group compared (:func:`world_seq`).
        seq: this rank's count in it.

    Returns:
        The :class:`Standing`.
    """
    known = {r: c[group] for r, c in counts.items() if c and group in c}
    behind = frozenset(r for r, n in known.items() if n < seq)
    lowest = min((known[r] for r in behind), default=None)
    return Standing(
        behind=behind,
        ahead=frozenset(r for r, n in known.items() if n > seq),
        uncounted=frozenset(set(counts) - set(known)),
        furthest=frozenset(r for r in behind if known[r] == lowest),
    )


def store_ports() -> set[int]:
    """The ports of the job's store (``MASTER_PORT``, and the TCPStore under this world's store):
    its connections are never cut, since the commit and the rebuild meet there. Under ncclguard's
    own launcher rank 0 hosts the store, so a cut toward rank 0 by pid alone would take a peer's
    store away."""
    ports: set[int] = set()
    raw = os.environ.get("MASTER_PORT", "")
    if raw.isdigit():
        ports.add(int(raw))
    store = job_store()
    port = getattr(store, "port", None) if store is not None else None
    if isinstance(port, int):
        ports.add(port)
    return ports


def cut_connections(pid: int) -> int:
    """Shuts down this process's TCP connections to process ``pid`` (on this host), but those of the
    job's store (:func:`store_ports`).

    Returns:
        How many were shut down.
    """
    import psutil

    keep = store_ports()
    try:
        theirs = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr}
        mine = [c for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.fd >= 0]
    except (psutil.Error, OSError) as exc:
        log.warning("verdict: cannot read the connections to pid %d (%s)", pid, exc)
        return 0
    return sum(
        _shut(c.fd)
        for c in mine
        if (c.raddr.ip, c.raddr.port) in theirs and c.laddr.port not in keep and c.raddr.port not in keep
    )


def abort_world(rules: BackendRules) -> tuple[list[str], list[str], int]:
    """Aborts every process group of this process (NCCL's release and step bound,
    :mod:`ncclguard.backend_rules`): an op in flight fails, and so does every later op on them.

    On the NCCL stand-in (a gloo world) ``abort()`` wakes nothing, so this process's connections to
    the job's other processes on this host are shut down first, never the store's
    (:func:`cut_job_connections`): the op in flight then fails at once, as NCCL's abort makes it,
    with or without a watchdog to name the peers.

    Args:
        rules: the world's backend rules.

    Returns:
        The groups aborted, ``"name: error"`` for each abort that raised, and the connections cut.
    """
    cut = cut_job_connections() if rules.stand_in else 0
    aborted, failed = compat.abort_all_groups()
    return aborted, failed, cut


def job_peer_pids() -> set[int]:
    """The other processes of this host in this process's job: those whose environment has this
    one's ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun and ncclguard's launchers give both to every
    rank). Empty without ``MASTER_PORT``."""
    import psutil

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not port:
        return set()
    me, found = os.getpid(), set()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read
        if env.get("MASTER_PORT") == port and env.get("MASTER_ADDR") == addr:
            found.add(proc.pid)
    return found


def cut_job_connections() -> int:
    """Shuts down this process's TCP connections to the job's other processes on this host
    (:func:`job_peer_pids`), never the store's: the NCCL stand-in's abort. A connection to anything
    outside the job (a test runner, an exporter, a download) is left alone.

    Returns:
        How many were shut down.
    """
    return sum(cut_connections(pid) for pid in sorted(job_peer_pids()))


def _shut(fd: int) -> int:
    """Shuts down the socket ``fd`` (both ways); 1 when it was, 0 when it could not be."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)  # the socket itself, not the dup alone: gloo's pair sees it
        return 1
    except OSError:
        return 0


def job_store() -> dist.Store | None:
    """The job's store, unprefixed: the current world's, or the default group's in generation 0."""
    store = current_world().store
    if store is not None:
        return store
    try:
        return unprefixed(compat.default_store()) if dist.is_available() and dist.is_initialized() else None
    except (TorchCompatError, RuntimeError, ValueError):
        return None


def on_this_host(hb: Heartbeat) -> bool:
    """Whether the rank of heartbeat ``hb`` runs on this host: its hostname, and its address toward
    the master where both are known (two hosts may share a name: containers, namespaces; reading a
    pid of the other one in this host's ``/proc`` would judge the wrong process)."""
    if hb.host != HOSTNAME:
        return False
    mine = node_address()
    return hb.address is None or mine is None or hb.address == mine


def ask_supervisor(
    origin: int,
    hb: Heartbeat | tuple[int, str],
    judged: Literal["unknown", "stuck", "confirm"],
    heal: bool,
    still_s: float,
    asker: int,
    ruling: Ruling,
) -> bool:
    """Asks the supervisor of launch rank ``origin`` to judge (``unknown``), confirm and end
    (``confirm``) or end (``stuck``) its process (:mod:`ncclguard.store.asks`), within :data:`STORE_BOUND_S`.

    Args:
        origin: the launch rank asked about.
        hb: its last heartbeat, or (pid, site) for this rank's own process.
        judged: ``unknown`` (judge it), ``confirm`` (the only waiting rank judged it stuck: end it
            if you see it stuck too) or ``stuck`` (the waiting ranks agreed: end it).
        heal: the engine heals: a process ended on this ask may be restarted to rejoin (with
            ``stuck``: its death is the supervisor's to post, the asker posted none).
        still_s: the verdict's window.
        asker: the asking launch rank.
        ruling: the judge's ruling that allows the ask (:mod:`ncclguard.watching.judge.rules`).

    Returns:
        Whether the ask was posted (a failure is logged).

    Raises:
        UnjudgedAction: the ruling allows no ask (``stuck`` needs an acting one); nothing was posted.
    """
    ruling.require(f"an ask ({judged}) about launch rank {origin}", asking=judged != "stuck")
    pid, site = (hb.pid, hb.site) if isinstance(hb, Heartbeat) else hb
    ask = JudgeAsk(
        origin=origin,
        pid=pid,
        judged=judged,
        heal=heal,
        still_s=min(max(still_s, 1.0), 3600.0),
        asker=asker,
        site=site[:300],
        at=time.time(),
    )
    try:
        job = job_store()
        if job is None:
            raise ValueError("no store")
        deadline = Deadline.within(STORE_BOUND_S)
        store = store_for_this_thread(job, deadline)
        bounded_store_call(store, lambda: post_ask(unprefixed(store), ask), deadline, "an ask to a supervisor")
    except (StoreUnreachable, RuntimeError, dist.DistStoreError, ValueError) as exc:
        log.warning("verdict: could not ask launch rank %d's supervisor (%s)", origin, exc)
        return False
    return True


def supervisor_answer(origin: int) -> JudgeAnswer | None:
    """The last answer of launch rank ``origin``'s supervisor, or None (none yet, or unreadable now)."""
    try:
        job = job_store()
        if job is None:
            return None
        deadline = Deadline.within(STORE_BOUND_S)
        store = store_for_this_thread(job, deadline)
        return bounded_store_call(store, lambda: read_answer(unprefixed(store), origin), deadline, "an answer")
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("verdict: launch rank %d's supervisor's answer is unreadable now (%s)", origin, exc)
        return None


def post_stuck_death(world: Any, r: int, pid: int, host: str, ruling: Ruling) -> bool:
    """Posts the death notice (``STUCK_RC``) of rank ``r`` of ``world``, process ``pid`` on ``host``,
    on the judge's acting ``ruling``.

    Returns:
        Whether it was posted (a failure is logged).

    Raises:
        UnjudgedAction: the ruling does not act; nothing was posted.
    """
    ruling.require(f"the death notice of rank {r}")
    deadline = Deadline.within(STORE_BOUND_S)
    try:
        job = job_store()
        if job is None:
            raise ValueError("no store")
        store = store_for_this_thread(job, deadline)
        notice = notice_now(world.origin(r), pid, STUCK_RC, 0, host)
        bounded_store_call(
            store, lambda: post_death(unprefixed(store), notice), deadline, "a stuck rank's death notice"
        )
    except (StoreUnreachable, RuntimeError, dist.DistStoreError, ValueError) as exc:
        log.warning("verdict: could not post rank %d's death notice (%s)", r, exc)
        return False
    return True


def stuck_notices(world: Any) -> list[DeathNotice]:
    """The death notices posted as stuck (``STUCK_RC``) since ``world`` began; empty when unreadable now."""
    job, deadline = job_store(), Deadline.within(STORE_BOUND_S)
    if job is None:
        return []
    try:
        store = store_for_this_thread(job, deadline)
        _, notices = bounded_store_call(
            store, lambda: read_deaths(unprefixed(store), world.deaths_seen), deadline, "the death notices"
        )
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("verdict: the death notices are unreadable now (%s)", exc)
        return []
    return [n for n in notices if n.returncode == STUCK_RC]
