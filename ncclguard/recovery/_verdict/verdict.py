"""The verdict drives the engine: a step whose peers wait for a *stuck* rank fails now, not at the bound.

gloo fixes an op's timeout when the op starts, and a short bound would fail every rank waiting for a
peer that is slow but moving. So while a step runs, a thread (``ncclguard-verdict``) looks every
:data:`POLL_S` seconds. Past the *judge* bound (learned, :mod:`ncclguard.recovery._step.guards`)
it judges the watched peers behind this rank (a lower world-group backend sequence number) from
their progress (:mod:`ncclguard.watching.sensors.progress`). A moving one is reported once per step. A
stuck one is acted on only once every other waiting rank judges it stuck too
(:mod:`~ncclguard.watching.judge.agreement`). Where the engine heals under a supervisor with
restarts, its supervisor is asked to end it at once and restart it (it rejoins and is healed: the
full world back); otherwise it gets a death notice (``STUCK_RC``: the commit and the rebuild meeting
settle without it). Either way, on this host, this process's connections to it are shut down (its
op ends at once). A stuck rank whose threads run (asleep in Python, in a lock) judges itself: it
asks its own supervisor the same (heal under restarts), or exits 0; one its peers judged stuck
exits 0 once it runs again (SIGCONT), and its supervisor, if any, ends it. A peer behind on
another host with no heartbeat for two periods past the bound (SIGSTOPped, the GIL held in C) cannot
be judged nor cut from here: its supervisor is asked (:mod:`ncclguard.store.asks`), judges it from
``/proc`` on its host and ends it when stuck (:mod:`ncclguard.supervise.judge`); its sockets close and
the op here fails at once. A member known dead (a death notice) leaves the world's ops unable to
finish: at the first one, this rank shuts down its connections to the live peers of its host, so that
none stays held in an op by a peer that left it (:mod:`~ncclguard.recovery._verdict.release`). Without
a watchdog nothing is judged; without a supervisor such a rank is left to the step bound, the hard
cap (docs/recovery.md).
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Any

import torch.distributed as dist

from ncclguard._log import log
from ncclguard.backend_rules import rules_for
from ncclguard.exits import EXITING, poller
from ncclguard.incidents.model import Heartbeat
from ncclguard.recording.steps import steps
from ncclguard.recovery._rebuild.restarts import supervised, supervised_restarts
from ncclguard.recovery._verdict.levers import (
    DEFAULT_JUDGE_S,
    STUCK_AFTER_VAR,
    ask_supervisor,
    cut_connections,
    judge_after,
    on_this_host,
    post_stuck_death,
    standing,
    supervisor_answer,
    world_seq,
)
from ncclguard.recovery._verdict.release import Release
from ncclguard.recovery._verdict.seen import Seen
from ncclguard.recovery._verdict.self_check import POLL_S, SelfCheck
from ncclguard.watching.judge.agreement import Agreement, agreement
from ncclguard.watching.judge.rules import rule_peer, rule_silent
from ncclguard.watching.sensors.progress import (
    JUDGED,
    JUDGED_ABOUT,
    MAX_JUDGED_CHARS,
    Judgment,
    Progress,
    Sample,
    beat_sample,
    own_sample,
    sample_process,
)
from ncclguard.watching.watchdog import current_watchdog
from ncclguard.world import current_world

__all__ = ["DEFAULT_JUDGE_S", "POLL_S", "STUCK_AFTER_VAR", "Seen", "VerdictDriver", "judge_after"]


class VerdictDriver:
    """The ``ncclguard-verdict`` thread of one recovery engine (see the module doc).

    Args:
        judge_s: returns the judge bound now (the learned one, or the user's).
        name: how logs name the engine's adapter.
        exits: a rank its peers judged stuck exits 0 once it runs again (the left-out policy ``"exit"``).
        heals: the engine heals restarted ranks: a supervisor that ends its stuck rank restarts it.
    """

    def __init__(self, judge_s: Any, name: str, exits: bool = True, heals: bool = False) -> None:
        self.judge_s, self.name, self.exits, self.heals = judge_s, name, exits, heals
        self._own = SelfCheck(name, exits, self._restarts, self._event)
        self.events: list[dict[str, Any]] = []  # what was reported and done (a test reads them)
        self._cond = threading.Condition()
        self._seen: Seen | None = None
        self._thread: threading.Thread | None = None
        self._procs: dict[int, Heartbeat] = {}  # the last heartbeat seen of each launch rank

    def arm(self) -> None:
        """A step (or its redo) starts: looks afresh (a rebuild renumbers the ranks)."""
        judge = self.judge_s()
        if not judge:
            return
        hb = _heartbeat_s()
        world = current_world()
        about = f"{world.generation}/{steps.step}"  # what this step's votes are about, on every rank alike
        with self._cond:
            still = max(2.0 * hb, min(judge, 60.0) / 2)
            before, self._seen = self._seen, Seen(time.monotonic(), still, generation=world.generation, about=about)
            world.get(JUDGED).clear()  # votes of another step, if a disarm was missed
            world.get(JUDGED_ABOUT).key = about
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="ncclguard-verdict", daemon=True)
                self._thread = poller(thread, wake=partial(_notify, self._cond))
            self._cond.notify_all()
        self._settle(before)

    def disarm(self) -> None:
        """The step is over: nothing is judged until the next one."""
        with self._cond:
            before, self._seen = self._seen, None
            current_world().get(JUDGED).clear()  # under the lock: no look of the step writes after this
            current_world().get(JUDGED_ABOUT).key = None
        self._settle(before)

    def _run(self) -> None:
        idle = 0.0
        while idle < 60.0 and not EXITING.is_set():  # it ends after a minute without a step, and at exit
            with self._cond:
                self._cond.wait(POLL_S)
                seen = None if EXITING.is_set() else self._seen  # at exit no look starts a store call
            if seen is None:
                idle += POLL_S
                continue
            idle = 0.0
            try:
                self._look(seen)
            except Exception:  # noqa: BLE001 - the verdict must never take training down
                log.exception("verdict: a look failed; going on")
        with self._cond:
            self._thread = None

    def _look(self, seen: Seen) -> None:
        wd = current_watchdog()
        world = current_world()
        if wd is None or not dist.is_initialized():
            return
        if world.generation != seen.generation:
            # The step's attempt failed and the world was rebuilt: the re-wrap and the heal or restore
            # are bounded by their own timeouts, and this look's progress and numbers are the old
            # world's (a peer idle since the step began, waiting in the restore, looked stuck).
            # The redo, or the next step, arms afresh in the new world.
            return
        gen, beats = wd.peer_beats()
        mine = world_seq()
        if gen != world.generation or mine is None:
            return  # the watchdog has not followed the new world yet
        self._release(seen, world, beats)
        now = time.monotonic()
        if (gap := seen.stood(now, max(3 * POLL_S, 2 * _heartbeat_s()), 2 * _heartbeat_s() + POLL_S)) is not None:
            self.events.append({"what": "stood", "rank": dist.get_rank(), "state": "unknown", "gap_s": round(gap, 3)})
            log.warning(
                "%s: verdict: this rank stood %.1f s (its views of its peers are that old); judging afresh",
                self.name,
                gap,
            )
        cpu, io = own_sample()
        if seen.own is None:
            seen.own = Progress(seen.still_s)
        seen.own.observe(Sample(now, "self", ops=mine[1], cpu_s=cpu, io_bytes=io))
        # Its threads, children and sockets too: a rank blocked in send() to a slow receiver moves
        # there only, and must never judge itself stuck.
        whole = sample_process(os.getpid(), now)
        if whole is not None:
            seen.own.observe(whole)
        for r, (hb, age) in beats.items():
            self._procs[world.origin(r)] = hb  # its process, by launch rank: known in later worlds too
            _sample(seen, r, hb, age, now)
        group, seq = mine
        where = standing({r: hb.backend_seq for r, (hb, _) in beats.items()}, group, seq)
        # A beat without a count in the group (published inside the rebuild's init_process_group, then
        # the rank stopped) tells neither behind nor level: with no beat since for two periods, such a
        # peer is judged as one with no beat in this world (a live rank's next beat carries its count).
        mute = {r for r in where.uncounted if beats[r][1] >= 2 * _heartbeat_s()}
        silent = _silent(seen, world, set(beats) - mute, now, self._procs)
        if now - seen.started < self.judge_s() or now < seen.stood_until:
            return
        self._own.judged_by_peers(world, now)
        behind = {r: beats[r][0] for r in where.furthest}  # a peer ahead of another behind may wait for it
        if where.ahead and not behind:
            with self._cond:  # a look that raced the step's end acts on nothing
                if self._seen is seen:
                    self._own.check(seen, sorted(where.ahead), now, beats, 2 * _heartbeat_s(), seen.about)
        if now - seen.started >= 2 * _heartbeat_s() + self.judge_s():
            behind.update(silent)  # no counted beat in this world for two periods past the bound: only /proc judges
            behind.update({r: beats[r][0] for r in mute if not on_this_host(beats[r][0])})  # its supervisor is asked
        for r, hb in behind.items():
            if r not in seen.acted:
                self._judge(seen, r, hb, seen.peers[r].judge(now), now, beats)
        self._ask_remote(seen, world, {r: (hb, beats[r][1]) for r, hb in behind.items() if r in beats}, now)

    def _release(self, seen: Seen, world: Any, beats: dict[int, tuple[Heartbeat, float]]) -> None:
        """A member known dead: this rank's connections to the live peers of its host are shut down,
        once per attempt, so that none stays held in an op (:mod:`~ncclguard.recovery._verdict.release`)."""
        if seen.release is None:
            seen.release = Release(world, dist.get_rank(), dist.get_world_size(), rules_for())
        if seen.release.done or not (dead := seen.release.dead()):
            return
        with self._cond:  # not once the attempt is over: the rebuild's connections are the new world's
            if self._seen is not seen or current_world().generation != seen.generation:
                return
            done = seen.release.release(dead, beats)
        for r, how in sorted(dead.items()):  # one event per dead member, as for every other judgement
            state = "stuck" if r in done.stuck else "dead"
            event = {"what": "released", "rank": r, "state": state, "evidence": how, "cut": done.cut}
            self.events.append(event | ({"aborted": list(done.aborted)} if done.aborted else {}))
        how_released = (
            f"aborts its groups ({', '.join(done.aborted) or 'none'})"
            if seen.release.aborts
            else "shuts down its connections to the live peers of this host "
            f"({', '.join(f'rank {r}: {n}' for r, n in done.cut.items()) or 'none here'})"
        )
        log.warning(
            "%s: verdict: rank(s) %s of this world are dead (%s); its ops cannot finish, so this rank %s, "
            "that none stays held in one",
            self.name,
            sorted(dead),
            "; ".join(f"rank {r}: {how}" for r, how in sorted(dead.items())),
            how_released,
        )

    def _restarts(self) -> bool:
        """A stuck rank is restarted by its supervisor: the engine heals, under restarts (every rank alike)."""
        return self.heals and supervised_restarts() > 0

    def _judge(
        self,
        seen: Seen,
        r: int,
        hb: Heartbeat,
        j: Judgment,
        now: float,
        beats: dict[int, tuple[Heartbeat, float]] | None = None,
    ) -> None:
        if j.state != "unknown":  # what the heartbeat carries and `ncclguard status` shows
            text = f"{j.state}: {j.evidence}; at {hb.site}, its peers waiting {now - seen.started:.0f} s"
            with self._cond:  # never after disarm: the next step's heartbeats would carry it as a stale vote
                if self._seen is not seen:
                    return
                current_world().get(JUDGED)[str(r)] = text[:MAX_JUDGED_CHARS]
        if j.state == "moving" and r not in seen.reported:
            seen.reported.add(r)
            behind = round(now - seen.started, 3)
            self._event("busy", r, j, site=hb.site, behind_s=behind)
            log.warning(
                "%s: verdict: rank %d is behind (at %s, this step %.1f s old) but moving (%s); no action until the "
                "step bound",
                self.name, r, hb.site, behind, j.evidence,
            )  # fmt: skip
        if j.state == "stuck":  # published above: the other waiting ranks read it in the next heartbeat
            self._stuck(seen, r, hb, j, now, agreement(r, dist.get_rank(), beats or {}, 2 * _heartbeat_s(), seen.about))

    def _stuck(self, seen: Seen, r: int, hb: Heartbeat, j: Judgment, now: float, agreed: Agreement) -> None:
        """Peer ``r``, judged stuck here: what the one judge allows (:func:`~ncclguard.watching.judge.rules.rule_peer`)."""
        with self._cond:  # a look that raced the step's end acts on nothing; disarm waits for an act begun
            ruling = rule_peer(
                dist.get_rank(), j.state, j.evidence, agreed, seen.about, seen.about if self._seen is seen else None,
                supervised(),
            )  # fmt: skip
            # Asked to confirm: the supervisor's for this step (an agreement now would post a second death).
            if ruling.kind == "stale" or r in seen.acted or r in seen.confirming:
                return
            world = current_world()
            asker, origin, restarts = world.origin(dist.get_rank()), world.origin(r), self._restarts()
            if ruling.kind == "confirm":  # the only rank waiting: its supervisor's look is the second view
                seen.asked[r], seen.confirming = (hb.pid, origin, hb.site), seen.confirming | {r}
                posted = ask_supervisor(origin, hb, "confirm", restarts, seen.still_s, asker, ruling)
            elif ruling.acts:
                seen.acted.add(r)
                # Healing under a supervisor: its supervisor ends it now and restarts it, and posts its death
                # as a kill, so that the rebuild waits for the restart (the full world back). Otherwise its
                # death is posted as stuck here (the rebuild settles without it) and its supervisor, if any,
                # ends it where it does not exit by itself (SIGSTOPped, the GIL held in C).
                posted = False if restarts else post_stuck_death(world, r, hb.pid, hb.host, ruling)
                ask_supervisor(origin, hb, "stuck", restarts, seen.still_s, asker, ruling)
                cut = cut_connections(hb.pid) if on_this_host(hb) else 0
            elif r in seen.awaiting or ruling.kind not in ("await", "victim"):
                return
            else:
                seen.awaiting.add(r)
        waited = round(now - seen.started, 3)
        if ruling.kind == "confirm":
            self._event("asked", r, j, site=hb.site, posted=posted, confirm=True, waited_s=waited)
            log.warning(
                "%s: verdict: rank %d (pid %d on %s, at %s) looks stuck here (%s); %s",
                self.name, r, hb.pid, hb.host, hb.site, j.evidence, ruling.why,
            )  # fmt: skip
        elif not ruling.acts:
            self._event("awaiting", r, j, site=hb.site, why=ruling.why)
            log.warning(
                "%s: verdict: rank %d looks stuck here (%s), but no action: %s", self.name, r, j.evidence, ruling.why
            )
        else:
            self._event(
                "acted", r, j, site=hb.site, death_notice=posted, cut=cut, waited_s=waited, agreed=agreed.why,
                restart=restarts, views=list(ruling.views),
            )  # fmt: skip
            log.error(
                "%s: verdict: rank %d (pid %d on %s, at %s) is stuck: %s; %s; %s%s, the step fails now",
                self.name, r, hb.pid, hb.host, hb.site, j.evidence, ruling.why,
                "its supervisor is asked to end and restart it" if restarts else "its death is posted",
                f" and {cut} connection(s) to it are shut down" if cut else "",
            )  # fmt: skip

    def _ask_remote(self, seen: Seen, world: Any, behind: dict[int, tuple[Heartbeat, float]], now: float) -> None:
        """Peers behind on another host with no beat for two periods: neither their heartbeats nor
        this host's ``/proc`` can judge them, so their supervisor is asked, once per step; its answer
        is reported (a busy rank stays a report; a stuck one was ended there)."""
        for r, (hb, age) in behind.items():
            if r in seen.acted or (r not in seen.asked and (on_this_host(hb) or age < 2 * _heartbeat_s())):
                continue
            origin = world.origin(r)
            if r not in seen.asked:
                with self._cond:  # a look that raced the step's end asks nothing
                    ruling = rule_silent(age, seen.about, seen.about if self._seen is seen else None)
                    if not ruling.asks:
                        return
                    seen.asked[r] = (hb.pid, origin, hb.site)
                    posted = ask_supervisor(
                        origin, hb, "unknown", self.heals, seen.still_s, world.origin(dist.get_rank()), ruling
                    )
                j = Judgment("unknown", round(age, 3), f"no heartbeat for {age:.1f} s, on another host")
                self._event("asked", r, j, site=hb.site, posted=posted, waited_s=round(now - seen.started, 3))
                log.warning(
                    "%s: verdict: rank %d (pid %d on %s, at %s) is behind with no heartbeat for %.1f s; its "
                    "supervisor is asked to judge it",
                    self.name,
                    r,
                    hb.pid,
                    hb.host,
                    hb.site,
                    age,
                )
                continue
            self._answered(seen, r, now)

    def _answered(self, seen: Seen, r: int, now: float, settling: bool = False) -> None:
        """Reads the answer of the supervisor asked about rank ``r``, and reports it once."""
        pid, origin, site = seen.asked[r]
        ans = supervisor_answer(origin)
        if ans is None or ans.pid != pid or r in seen.acted or (ans.state == "moving" and r in seen.reported):
            return
        j = Judgment(ans.state, 0.0, f"its supervisor on {ans.host}: {ans.evidence}")
        with self._cond:  # the world is still the one this rank was numbered in, and the step still open
            if not settling and self._seen is seen:
                current_world().get(JUDGED)[str(r)] = f"{ans.state}: {j.evidence}"[:MAX_JUDGED_CHARS]
        if ans.state == "moving":
            seen.reported.add(r)
            self._event("busy", r, j, site=site, behind_s=round(now - seen.started, 3))
            log.warning("%s: verdict: rank %d is behind but moving (%s); no action", self.name, r, j.evidence)
        else:
            seen.acted.add(r)
            self._event("ended", r, j, site=site, restarted=ans.restarted, waited_s=round(now - seen.started, 3))
            log.error("%s: verdict: rank %d was stuck and its supervisor ended it (%s)", self.name, r, j.evidence)

    def _settle(self, seen: Seen | None) -> None:
        """A step's look ends (its op failed when a supervisor ended the rank, or it committed): the
        answers to its asks are read once more, so that what was decided is reported. The supervisor
        answers before it ends the process, so the answer is there when the op fails."""
        if seen is None:
            return
        for r in [r for r in seen.asked if r not in seen.acted]:
            try:
                self._answered(seen, r, time.monotonic(), settling=True)
            except Exception:  # noqa: BLE001 - the verdict must never take training down
                log.exception("verdict: reading a supervisor's answer failed; going on")

    def _event(self, what: str, rank: int, j: Judgment, **extra: Any) -> None:
        self.events.append({"what": what, "rank": rank, "state": j.state, "evidence": j.evidence, **extra})


def _silent(seen: Seen, world: Any, beating: set[int], now: float, procs: dict[int, Heartbeat]) -> dict[int, Heartbeat]:
    """Members on this host with no counted heartbeat in this world yet (one stopped right after
    a rebuild), sampled from /proc by the process their last heartbeat named."""
    out = {}
    me = dist.get_rank()
    for r in range(dist.get_world_size()):
        hb = procs.get(world.origin(r))
        if r == me or r in beating or hb is None or not on_this_host(hb):
            continue
        if r in seen.peers and seen.peers[r].last_at == now:  # sampled from /proc by this look already
            out[r] = hb
            continue
        sample = sample_process(hb.pid, now)
        if sample is not None:
            seen.peers.setdefault(r, Progress(seen.still_s)).observe(sample)
            out[r] = hb
    return out


def _sample(seen: Seen, r: int, hb: Heartbeat, age: float, now: float) -> None:
    """Takes in what this look knows of peer ``r``: its heartbeat, and ``/proc`` where it is on this host."""
    prog = seen.peers.setdefault(r, Progress(seen.still_s))
    here = on_this_host(hb)
    # When it was published, not when the watchdog read it: a beat from before the step is no baseline.
    age = max(age, time.time() - hb.time)
    if seen.beats.get(r) != hb.beat and now - age >= seen.started:  # a beat from before the step: no baseline
        seen.beats[r] = hb.beat
        at = max(now - age, prog.last_at or 0.0)
        if here:  # /proc gives the rest (every look); a beat gives its ops and stack
            ops = sum((hb.backend_seq or {}).values()) if hb.backend_seq else None
            prog.observe(Sample(at, "heartbeat", ops, hb.site))
        else:  # on another host, the beat is all there is: what the rank read of itself
            prog.observe(beat_sample(hb, at))
    if here:  # read from /proc between beats, and when its beats stop
        sample = sample_process(hb.pid, now)
        if sample is not None:
            prog.observe(sample)


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


def _heartbeat_s() -> float:
    wd = current_watchdog()
    return wd.config.heartbeat_s if wd is not None else 5.0
