"""Releasing the survivors that a live peer holds, once a member of the world is known dead.

A member the job knows dead (its launcher's death notice, :mod:`ncclguard.store.deaths`, or a
peer's verdict that judged it stuck) leaves every op of the world unable to finish, and a survivor
can be held in one by a *live* peer. Seen in CI (3 gloo ranks, the HF Trainer on DeepSpeed): rank 2
was SIGKILLed as a step began; rank 1's op failed at once ("Connection closed by peer") and it went
to the commit; rank 0 stayed in an ``all_reduce`` waiting on rank 1, whose side of the op was gone.
The commit waited for rank 0's statement, rank 0 for rank 1: with every default both wait out the
step bound (300 s), and the restarted rank 2 gave up joining first (``rebuild_timeout``, 60 s).

So, once per step attempt, a rank that reads such a notice shuts down its own connections to the
world's live peers on this host, never the store's (:func:`~ncclguard.recovery._verdict.levers.store_ports`).
A peer held in an op of the world fails it at once and comes to the commit, which settles without the
dead rank; a peer not in an op fails its next one. Nothing is lost: a member is gone, so the step fails
and the world is rebuilt in any case. A peer on another host is not reached from here (its sockets
cannot be told apart from others by address alone): it waits for the step bound, or for a rank of its
own host that reads the same notice.

Only in a world on gloo alone: an NCCL op is not woken by a socket (its data moves over NVLink or
InfiniBand), and an error on one of NCCL's own sockets would tear the survivor's process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default, 3:
https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncclguard.deadlines import Deadline
from ncclguard.incidents.model import Heartbeat
from ncclguard.recovery._verdict.levers import STORE_BOUND_S, cut_connections, job_store, on_this_host
from ncclguard.store.deaths import STUCK_RC, DeathWatch

__all__ = ["Release", "Released"]


@dataclass(frozen=True)
class Released:
    """What one release did.

    Attributes:
        dead: the members known dead, with how each is known.
        stuck: those of them whose notice was posted as stuck (``STUCK_RC``: alive, judged stuck).
        cut: the connections shut down, by the live peer's rank.
    """

    dead: dict[int, str]
    stuck: frozenset[int]
    cut: dict[int, int]


class Release:
    """One step attempt's watch on the death notices of its world (see the module doc).

    Args:
        world: the world the attempt runs in (its members' launch ranks, the notices read before it).
        me: this rank's number in it.
        size: its number of ranks.
        backend: its default group's backend (``dist.get_backend()``): nothing is done but on ``gloo``.
    """

    def __init__(self, world: Any, me: int, size: int, backend: str) -> None:
        self._world, self._me, self._size = world, me, size
        self._watch: DeathWatch | None = None
        self.done = backend != "gloo"  # see the module doc: never on NCCL's sockets

    def dead(self) -> dict[int, str]:
        """The members known dead so far (read within :data:`STORE_BOUND_S`; empty with no store)."""
        if self._watch is None:
            store = job_store()
            if store is None:
                return {}
            origins = {r: self._world.origin(r) for r in range(self._size)}
            self._watch = DeathWatch(store, self._world.deaths_seen, origins, self._me)
        return self._watch.look_within(Deadline.within(STORE_BOUND_S))

    def release(self, dead: dict[int, str], beats: dict[int, tuple[Heartbeat, float]]) -> Released:
        """Shuts down this process's connections to every live peer of this host; once.

        Args:
            dead: the members known dead (:meth:`dead`).
            beats: the peers' last heartbeats (their pids and hosts), by rank.

        Returns:
            What was done.
        """
        self.done = True
        live = {r: hb for r, (hb, _) in beats.items() if r not in dead and r != self._me and on_this_host(hb)}
        notices = self._watch.notices if self._watch is not None else {}
        stuck = frozenset(r for r in dead if r in notices and notices[r].returncode == STUCK_RC)
        return Released(dict(dead), stuck, {r: cut_connections(hb.pid) for r, hb in sorted(live.items())})
