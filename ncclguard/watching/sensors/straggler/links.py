"""Links: what each TCP connection of this rank moved over a window, and how fast, from the kernel.

Timing a collective from Python says that the transfer slowed, not where: in a ring every rank waits
for the slowest link. The kernel knows more. For each connected TCP socket of the process (gloo's
pairs among them) Linux's ``TCP_INFO`` tells the bytes the peer acknowledged (``tcpi_bytes_acked``)
and how long the socket had data in flight (``tcpi_busy_time``), of which how long the receiver's
window held it back (``tcpi_rwnd_limited``: a slow reader, not a slow link). Their ratio over a window
is the rate the link achieved while it had something to carry: a slow link, or a host whose link is
slow, shows in its own connections' rates, whatever the collective's algorithm. The sender's CPU
starvation does not slow it (a socket with nothing queued is not busy), which is what makes it usable
on a loaded host. Busy times tick in jiffies (4 ms at HZ=250); summed over many transfers the error
averages out.

:class:`LinkMeter` (the edge: ``/proc/self/fd``, ``getsockopt``) gives a window's samples
``(local address, peer address, bytes, busy seconds)``, summed per address pair; the rest is pure.
Linux only; elsewhere, and for transports that are not TCP (InfiniBand, NVLink), no samples.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence

from ncclguard.incidents.straggler_model import MAX_LINKS, LinkSample

__all__ = [
    "LINK_MIN_BYTES",
    "Link",
    "LinkMeter",
    "culprit",
    "link_rates",
    "named",
    "one_pair",
    "slow_links",
    "top_links",
]

LINK_MIN_BYTES = 256 * 1024  # a link that moved less in a window says nothing about its rate
_BUSY_MIN_S = 0.02  # ... or was busy for less (5 jiffies at HZ=250)
# struct tcp_info (include/uapi/linux/tcp.h): offsets of the fields read, and the length needed.
_BYTES_ACKED, _BUSY, _RWND_LIMITED, _NEED = 120, 168, 176, 192


def _tcp_info(fd: int) -> tuple[str, str, int, float] | None:
    """(local ip, peer ip, bytes acked, busy seconds less receive-window-limited) of socket ``fd``;
    None for anything else than a connected TCP socket, or a kernel that does not tell."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        peer = sock.getpeername()[0]
        local = sock.getsockname()[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None
    finally:
        sock.close()
    if len(info) < _NEED:
        return None
    (acked,) = struct.unpack_from("Q", info, _BYTES_ACKED)
    busy, rwnd = struct.unpack_from("QQ", info, _BUSY)[0], struct.unpack_from("Q", info, _RWND_LIMITED)[0]
    return local, peer, acked, max(0, busy - rwnd) / 1e6


class LinkMeter:
    """This process's TCP connections, read once per window: what each address pair moved since the
    last read. Keeps the counters of the connections it saw (by file descriptor and addresses)."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str, str], tuple[int, float]] = {}

    def read(self, everything: bool = False) -> list[LinkSample]:
        """The samples since the last read, summed per (local, peer) address, the busiest first (at
        most :data:`MAX_LINKS`, each of at least :data:`LINK_MIN_BYTES`; ``everything``: all of
        them, whatever they moved); the first read gives none."""
        try:
            fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
        except (OSError, ValueError):
            return []
        now: dict[tuple[int, str, str], tuple[int, float]] = {}
        for fd in fds:
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    continue
            except OSError:
                continue
            got = _tcp_info(fd)
            if got is not None:
                now[(fd, got[0], got[1])] = (got[2], got[3])
        pairs: dict[tuple[str, str], list[float]] = {}
        for key, (acked, busy) in now.items():
            before = self._last.get(key)
            if before is None or acked < before[0] or busy < before[1]:
                continue  # a new connection (or a reused descriptor): counted from the next read
            sums = pairs.setdefault((key[1], key[2]), [0.0, 0.0])
            sums[0] += acked - before[0]
            sums[1] += busy - before[1]
        self._last = now
        samples = [(local, peer, b, s) for (local, peer), (b, s) in pairs.items()]
        return samples if everything else top_links(samples)


def top_links(samples: Iterable[LinkSample], limit: int = MAX_LINKS) -> list[LinkSample]:
    """The samples that moved at least :data:`LINK_MIN_BYTES` while busy at least 20 ms, the busiest first."""
    kept = [s for s in samples if s[2] >= LINK_MIN_BYTES and s[3] >= _BUSY_MIN_S]
    return sorted(kept, key=lambda s: -s[2])[:limit]


Link = tuple[str, str]  # (source address, destination address)


def link_rates(windows: Iterable[Sequence[LinkSample]]) -> dict[Link, tuple[float, float]]:
    """Every link the windows tell between two different addresses (a rank's connection to a rank of
    its own host is another kind of link), summed: ``(bytes, busy seconds)``. A link is told by its
    sender (the bytes its peer acknowledged), so each comes from one rank's window."""
    out: dict[Link, list[float]] = {}
    for samples in windows:
        for local, peer, moved, busy in samples:
            if local == peer:
                continue
            sums = out.setdefault((local, peer), [0.0, 0.0])
            sums[0] += moved
            sums[1] += busy
    return {k: (b, s) for k, (b, s) in out.items() if b >= LINK_MIN_BYTES and s >= _BUSY_MIN_S}


def one_pair(links: Iterable[Link]) -> bool:
    """Whether every link runs between the same two addresses (a world of two hosts: one link, both ways)."""
    return len({frozenset(k) for k in links}) <= 1


FROM_START = 1.25  # how much more a link slow from the start must cost than ``straggler_link_threshold``
LOCATE_MIN, LOCATE_MARGIN = 1.5, 2.0  # a link is located as slow at 1.5x, and within the square root of the slowest


def _speeds(rates: Mapping[Link, tuple[float, float]]) -> dict[Link, float]:
    return {k: b / s for k, (b, s) in rates.items()}


def _best_other(speed: Mapping[Link, float], k: Link) -> float:
    """The rate the other links achieve: the fastest, or the best but one where there are four others or
    more (one freakishly fast path does not make every other link slow); 0.0 without another link."""
    others = sorted((v for q, v in speed.items() if q != k), reverse=True)
    return (others[1] if len(others) >= 4 else others[0]) if others else 0.0


def slow_links(
    rates: Mapping[Link, tuple[float, float]],
    threshold: float,
    min_share: float,
    length_s: float,
    transfer_s: float = 0.0,
    ops: int = 0,
) -> dict[Link, float]:
    """The links slow *from the start*: judged against the transfer time the sizes predict from the
    other links, with no past of their own. Each slow link with the rate it is judged against.

    A link is slow when the other links carry its bytes ``threshold`` times faster, that difference
    costs ``min_share`` of the window or more (its busy time less its bytes at their rate), and it is
    what the collective waits for: at their rate an op would take ``FROM_START * threshold`` times
    less than ``transfer_s`` (the op's time for the last rank to reach it, over ``ops`` ops). On this
    loaded 2-core machine healthy links vary 2x and more against each other (docs/stragglers.md): the
    last condition is what keeps that from reading as a slow link. Without the op's time (a loop whose
    collectives are issued from C++), the link must be ``2 * FROM_START * threshold`` times slower.
    None where every link runs between the same two hosts (nothing else to compare with).

    Args:
        rates: ``(bytes, busy seconds)`` per link (:func:`link_rates`).
        threshold: the slowdown that counts (``straggler_link_threshold``).
        min_share: the least share of the window the slowdown must cost.
        length_s: the window's length.
        transfer_s, ops: the op's transfer time and the ops in the window (0: unknown).
    """
    speed = _speeds(rates)
    if one_pair(speed):
        return {}
    out: dict[Link, float] = {}
    need = FROM_START * threshold
    for k, (moved, busy) in rates.items():
        ref = _best_other(speed, k)
        excess = busy - moved / ref if ref > 0 else 0.0
        if ref <= 0 or excess < min_share * length_s:
            continue
        if transfer_s > 0 and ops > 0:
            waited = ref >= threshold * speed[k] and transfer_s >= need * (transfer_s - min(transfer_s, excess / ops))
        else:
            waited = ref >= 2 * need * speed[k]
        if waited:
            out[k] = ref
    return out


def locate(
    rates: Mapping[Link, tuple[float, float]], baselines: Mapping[Link, float] | None = None
) -> dict[Link, float]:
    """The links to blame once the transfer is known to be slow: each link's slowness is the geometric
    mean of its drop against its own past rate (``baselines``) and its rate against the other links'
    (a missing one counts as 1); the slow ones are those at :data:`LOCATE_MIN` or more and at least
    the square root (:data:`LOCATE_MARGIN`) of the slowest's slowness: a host's two links slowed alike
    do not read alike on a loaded host (13x and 8x in one drill run). Each with its slowness."""
    speed = _speeds(rates)
    score = {}
    for k, v in speed.items():
        drop = (baselines or {}).get(k, 0.0) / v if v > 0 else 0.0
        other = _best_other(speed, k) / v if v > 0 else 0.0
        score[k] = (max(drop, 1.0) * max(other, 1.0)) ** 0.5
    top = max(score.values(), default=0.0)
    return {k: x for k, x in score.items() if x >= max(LOCATE_MIN, top ** (1 / LOCATE_MARGIN))}


def culprit(slow: Iterable[Link]) -> str:
    """Who the slow links name: ``"host <addr>"`` where every one of them touches that address and no
    other address is common to them; ``"the link <a> <-> <b>"`` (``->`` one way only) where they all
    run between the same two addresses; ``""`` where the evidence names no one."""
    return named(slow)[0]


def named(slow: Iterable[Link]) -> tuple[str, set[str]]:
    """:func:`culprit`'s text and the addresses it names (every address of the slow links where it
    names no one)."""
    links = sorted(set(slow))
    if not links:
        return "", set()
    if one_pair(links):
        a, b = links[0]
        return (f"the link {a} <-> {b}" if len(links) > 1 else f"the link {a} -> {b}"), {a, b}
    common = set(links[0]).intersection(*(set(k) for k in links[1:]))
    if len(common) == 1:
        (addr,) = common
        return f"host {addr}", {addr}
    return "", {a for k in links for a in k}
