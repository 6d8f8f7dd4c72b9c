"""A rank's verdict on itself (:mod:`ncclguard.recovery._verdict.verdict`): the peers wait in an op it
never reached and nothing of it moves, or the peers already judged it stuck.

A rank whose threads run (asleep in Python, blocked in a lock) sees this as early as its peers:
it acts only once the peers waiting for it judge it stuck too (their heartbeats' ``judged``, the same
agreement as theirs: :mod:`~ncclguard.watching.judge.agreement`), never on its own samples alone.
Then, where the engine heals under a supervisor with restarts, it asks its own supervisor to end it
and restart it (one decision point, where the peers' asks go too), and ends itself as below if
nothing ended it :data:`SELF_ASK_S` later; otherwise it posts its own death as stuck and exits 0,
which ends its peers' op on any host. A rank the peers judged stuck that runs again (SIGCONT) finds
their notice and exits 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.exits import exit_now
from ncclguard.recovery._verdict.levers import ask_supervisor, post_stuck_death, stuck_notices
from ncclguard.recovery._verdict.seen import Seen
from ncclguard.watching.judge.agreement import agreement
from ncclguard.watching.judge.rules import rule_self
from ncclguard.world import current_world

__all__ = ["POLL_S", "SELF_ASK_S", "SelfCheck"]

POLL_S = 1.0  # the verdict's look
# A rank that judged itself stuck and asked its supervisor to end it, still running this long after
# (the supervisor reads its asks every second; the store may not answer), ends itself as without one.
SELF_ASK_S = 10.0


class SelfCheck:
    """The verdict's look at its own rank (see the module doc).

    Args:
        name: how logs name the engine's adapter.
        exits: a rank its peers judged stuck exits 0 once it runs again (the left-out policy ``"exit"``).
        restarts: whether a stuck rank is ended and restarted by its supervisor (heal under restarts).
        event: records what was done (the verdict's events).
    """

    def __init__(self, name: str, exits: bool, restarts: Callable[[], bool], event: Callable[..., None]) -> None:
        self.name, self.exits, self.restarts, self._event = name, exits, restarts, event
        self._asked = 0.0  # when the store was last asked whether the peers judged this rank stuck

    def judged_by_peers(self, world: Any, now: float) -> None:
        """Exits 0 when the peers posted this process's death as stuck (it was SIGSTOPped, then
        continued): they went on without it, and its own rebuild would only come late."""
        if not self.exits or now - self._asked < 2 * POLL_S:
            return
        self._asked = now
        notices = stuck_notices(world)
        me = world.origin(dist.get_rank())
        if any(n.origin == me and n.pid == os.getpid() for n in notices):
            log.critical(
                "%s: verdict: the peers judged this rank stuck and went on without it; exiting with status 0",
                self.name,
            )
            exit_now(0)

    def check(
        self,
        seen: Seen,
        ahead: list[int],
        now: float,
        beats: Mapping[int, tuple[Any, float]],
        fresh_s: float,
        about: str | None = None,
    ) -> None:
        """Past the judge bound, with ranks ``ahead`` of this one and none behind: acts when this rank
        is stuck and the waiting ranks agree.

        Args:
            seen: the step's look.
            ahead: the ranks ahead of this one (they wait in an op it never reached).
            now: ``time.monotonic()``.
            beats: each peer's newest heartbeat and its age.
            fresh_s: a heartbeat older than this has no say.
            about: the step judged (``"<generation>/<step>"``): only the peers' votes about it count.
        """
        assert seen.own is not None
        j = seen.own.judge(now)
        if j.state != "stuck":
            return
        me = dist.get_rank()  # the world's rank is not known to the World in generation 0
        agreed = agreement(me, me, beats, fresh_s, about)
        # Called under the driver's lock while this step's look is the open one: ``about`` is open.
        ruling = rule_self(j.state, j.evidence, agreed, about, about)
        if not ruling.acts:  # one rank's judgment, even of itself, is no verdict
            if not seen.self_awaiting:
                seen.self_awaiting = True
                self._event("self-awaiting", me, j, ahead=ahead, why=ruling.why)
            return
        world = current_world()
        if self.restarts() and seen.self_asked is None:
            # Its supervisor ends it and restarts it (or, with no restart left, posts it as stuck
            # and ends it): one decision, where the peers' asks go too. Said to the peers by the
            # supervisor; this process goes on looking, and falls back below if nothing ends it.
            seen.self_asked = now
            asked = ask_supervisor(
                world.origin(me), (os.getpid(), ""), "stuck", True, seen.still_s, world.origin(me), ruling
            )
            self._event("self-asked", me, j, ahead=ahead, posted=asked)
            log.critical(
                "%s: verdict: ranks %s wait in an op this rank never reached, and this rank is stuck (%s); "
                "its supervisor is asked to end and restart it",
                self.name,
                ahead,
                j.evidence,
            )
            return
        if seen.self_asked is not None and now - seen.self_asked < SELF_ASK_S:
            return
        posted = post_stuck_death(world, me, os.getpid(), HOSTNAME, ruling)
        self._event("self-fenced", me, j, ahead=ahead, death_notice=posted)
        log.critical(
            "%s: verdict: ranks %s wait in an op this rank never reached, and this rank is stuck (%s); "
            "exiting with status 0 so that they rebuild without it",
            self.name,
            ahead,
            j.evidence,
        )
        exit_now(0)
