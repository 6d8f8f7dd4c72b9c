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

The cut is gloo's release. On NCCL an op is not woken by a socket (its data moves over NVLink or
InfiniBand), and an error on one of NCCL's own sockets would tear the survivor's process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default, 3:
https://pytorch.org/docs/stable/torch_nccl_environment_variables.html): there the release aborts this
process's groups instead (:func:`~ncclguard.recovery._verdict.levers.abort_world`), which fails the op
in flight and every later one on them; the rebuild makes new ones. Which one is the backend's rule
(:mod:`ncclguard.backend_rules`), run on CPU by the NCCL stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncclguard._log import log
from ncclguard.backend_rules import BackendRules, ReleaseBy
from ncclguard.deadlines import Deadline
from ncclguard.incidents.model import Heartbeat
from ncclguard.recovery._verdict.levers import (
    STORE_BOUND_S,
    abort_world,
    cut_connections,
    job_store,
    on_this_host,
)
from ncclguard.store.deaths import STUCK_RC, DeathWatch

__all__ = ["Release", "Released"]


@dataclass(frozen=True)
class Released:
    """What one release did.

    Attributes:
        dead: the members known dead, with how each is known.
        stuck: those of them whose notice was posted as stuck (``STUCK_RC``: alive, judged stuck).
        cut: the connections shut down, by the live peer's rank (gloo; the stand-in's abort cuts
            them all, counted under this rank's own number).
        aborted: the groups aborted (NCCL's rules), by name.
    """

    dead: dict[int, str]
    stuck: frozenset[int]
    cut: dict[int, int]
    aborted: tuple[str, ...] = ()


class Release:
    """One step attempt's watch on the death notices of its world (see the module doc).

    Args:
        world: the world the attempt runs in (its members' launch ranks, the notices read before it).
        me: this rank's number in it.
        size: its number of ranks.
        rules: its default group's backend rules: a cut on gloo, an abort on NCCL (and its stand-in).
    """

    def __init__(self, world: Any, me: int, size: int, rules: BackendRules) -> None:
        self._world, self._me, self._size, self._rules = world, me, size, rules
        self._watch: DeathWatch | None = None
        self.done = False

    @property
    def aborts(self) -> bool:
        """True where the release aborts the groups rather than cutting sockets."""
        return self._rules.release is ReleaseBy.ABORT

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
        """Shuts down this process's connections to every live peer of this host (gloo), or aborts
        its groups (NCCL's rules); once.

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
        if self._rules.release is ReleaseBy.ABORT:
            aborted, failed, cut = abort_world(self._rules)
            if failed:
                log.warning("verdict: aborting the groups: %s", "; ".join(failed))
            return Released(dict(dead), stuck, {self._me: cut} if cut else {}, tuple(aborted))
        return Released(dict(dead), stuck, {r: cut_connections(hb.pid) for r, hb in sorted(live.items())})
