"""Peer liveness: the heartbeats of the peers a rank watches, and which of them went stale.

Each rank watches the next ``watch_peers`` ranks in ring order (so every rank is watched by as
many), which bounds the store traffic of a large job. A peer is *stale* once its heartbeat has
not changed for ``peer_timeout`` seconds (``startup_grace_s`` for a peer never heard from) and its
last heartbeat does not say it finished (its watchdog stopped on purpose); the
watchdog raises one incident per peer that goes stale (:meth:`Liveness.newly_stale`). No clock is
read here: every method takes ``now`` (``time.monotonic()``), so it is tested with synthetic beats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ncclguard._naming import rank_ranges
from ncclguard.incidents.model import Heartbeat, PeerView
from ncclguard.watching.sensors.detect import SeqView

__all__ = ["Liveness", "PeerState", "SeqClock", "store_host_text", "watched_peers"]


def watched_peers(rank: int, world_size: int, watch_peers: int) -> list[int]:
    """The ranks ``rank`` watches: the next ``watch_peers`` in ring order, never itself."""
    n = min(watch_peers, world_size - 1)
    return [(rank + i) % world_size for i in range(1, n + 1)]


class SeqClock:
    """When each group's backend sequence number of one rank last changed."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.since: dict[str, float] = {}

    def update(self, seqs: Mapping[str, int] | None, now: float, still: Mapping[str, float] | None = None) -> None:
        """Takes in the rank's numbers read at ``now``.

        Args:
            seqs: its number per group.
            now: ``time.monotonic()``.
            still: how long each number had stood still where the rank itself measured it (its
                heartbeat says so): a new number is dated back by as much, so a peer's stillness
                is not counted from when this rank happened to read it.
        """
        for group, seq in (seqs or {}).items():
            if self.seq.get(group) != seq:
                self.seq[group], self.since[group] = seq, now - max(0.0, (still or {}).get(group, 0.0))

    def still(self, now: float) -> dict[str, float]:
        """How long each group's number has stood still, in seconds."""
        return {g: round(now - since, 3) for g, since in self.since.items()}

    def views(self, now: float) -> dict[str, SeqView]:
        """Each group's number and how long it has stood still."""
        return {g: SeqView(seq, now - self.since[g]) for g, seq in self.seq.items()}


@dataclass
class PeerState:
    """What this rank knows of one watched peer."""

    beat: int = -1  # its last beat number seen; -1: never heard from
    changed: float = 0.0  # now() when its beat last changed (or when watching began)
    heartbeat: Heartbeat | None = None
    announced: bool = False  # an incident was raised for its silence; cleared when it beats again
    clock: SeqClock = field(default_factory=SeqClock)  # its backend sequence numbers


class Liveness:
    """The watched peers' heartbeats and who among them is stale.

    Args:
        rank: this rank.
        world_size: ranks in the job.
        watch_peers: how many next ranks to watch.
        peer_timeout: seconds without a new beat after which a peer is stale.
        startup_grace_s: the same for a peer never heard from.
    """

    def __init__(self, rank: int, world_size: int, watch_peers: int, peer_timeout: float, startup_grace_s: float):
        self.watched = watched_peers(rank, world_size, watch_peers)
        self.peer_timeout = peer_timeout
        self.startup_grace_s = startup_grace_s
        self.peers: dict[int, PeerState] = {}

    def observe(self, beats: Mapping[int, Heartbeat], now: float) -> list[int]:
        """Takes in the heartbeats just read of the watched peers.

        Args:
            beats: the heartbeats found, by rank (a missing rank: nothing new from it).
            now: ``time.monotonic()`` of the read.

        Returns:
            The announced peers that are beating again.
        """
        back = []
        for r in self.watched:
            peer = self.peers.setdefault(r, PeerState(changed=now))
            hb = beats.get(r)
            if hb is not None and hb.beat != peer.beat:
                if peer.announced:
                    peer.announced = False
                    back.append(r)
                peer.beat, peer.changed, peer.heartbeat = hb.beat, now, hb
                peer.clock.update(hb.backend_seq, now, hb.backend_still)
        return back

    def stale(self, now: float) -> dict[int, float]:
        """Watched peers whose heartbeat stopped without saying it was the last, with seconds since
        it last changed."""
        out = {}
        for r, peer in self.peers.items():
            if peer.heartbeat is not None and peer.heartbeat.finished:
                continue  # its watchdog stopped on purpose: silence is what it said would come
            age = now - peer.changed
            limit = self.peer_timeout if peer.beat >= 0 else max(self.startup_grace_s, self.peer_timeout)
            if age >= limit:
                out[r] = age
        return out

    def newly_stale(self, now: float) -> dict[int, float]:
        """Stale peers not announced yet, with their ages; marks them announced."""
        fresh = {r: age for r, age in self.stale(now).items() if not self.peers[r].announced}
        for r in fresh:
            self.peers[r].announced = True
        return fresh

    def views(self, now: float) -> dict[str, PeerView]:
        """How this rank sees each watched peer (a statement's ``peers``)."""
        stale = self.stale(now)
        return {
            str(r): PeerView(age_s=round(now - p.changed, 3), stale=r in stale, seen=p.beat >= 0)
            for r, p in sorted(self.peers.items())
        }

    def seq_views(self, now: float) -> dict[int, dict[str, SeqView]]:
        """The live watched peers' backend sequence numbers per group, with how long each stood still."""
        stale = self.stale(now)
        return {r: p.clock.views(now) for r, p in self.peers.items() if r not in stale and p.clock.seq}

    def heartbeats(self) -> dict[int, Heartbeat]:
        """The last heartbeat seen of each watched peer that has beaten."""
        return {r: p.heartbeat for r, p in self.peers.items() if p.heartbeat is not None}


def store_host_text(addr: str, liveness: Liveness) -> str:
    """``the store's host 10.0.0.1 (node0, ranks 0-7 as last seen)``: the host of ``addr`` and the
    watched ranks whose last heartbeat came from it."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    beats = liveness.heartbeats()
    there = sorted(r for r, hb in beats.items() if hb.address == host)
    names = sorted({hb.host for r, hb in beats.items() if r in there})
    known = f" ({', '.join(names)}, {'rank' if len(there) == 1 else 'ranks'} {rank_ranges(there)} as last seen)"
    return f"the store's host is {host}{known if there else ''}"
