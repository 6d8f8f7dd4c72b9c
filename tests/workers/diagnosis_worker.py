"""Rank side of tests/watching/test_watchdog_multirank.py. Usage: diagnosis_worker.py SCENARIO.

Scenarios (each one launch):
    desync     torchrun, 3 ranks, ladder report then a custom rung (Marker): the instrumented
               ops recorded alike on every rank; rank 2 skips one dist.all_reduce (in eval),
               later rank 1 freezes in Python; then SIGALRM against a blocked gloo collective
               while the watchdog catches it.
    raise_lost spawn, 4 ranks, action raise: a frozen rank ended by CollectiveTimeout; rank 3
               SIGKILLed and reported lost; rank 0 (the store's host) killed, the store reported.
    exit       spawn, 2 ranks, action exit: the ladder climbs to os._exit(75).
    gil        torchrun, 2 ranks, action report: rank 1 holds the GIL in a C call (its watchdog
               thread stops too) while rank 0 waits in an all_reduce; rank 0's watchdog dumps
               rank 1's stacks from outside with py-spy.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import kill, put, skip_collective

from ncclguard import phase, safe_barrier, sigalrm_timeout, start_watchdog
from ncclguard.errors import CollectiveTimeout
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.recording.flight import recorder
from ncclguard.watching.ladder.actions import Action, ActionContext, IncidentRef, Outcome

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
INCIDENTS = OUT / "incidents"
HEARTBEAT_S = 0.3
HANG_S = 1.5
# When a silent peer counts as lost. No scenario but raise_lost's kill loses a rank, so this is far
# above the 1.9 s a loaded machine once starved a watchdog thread: a lost incident beside the ones a
# scenario raises would change what the test counts. raise_lost's kill is reported within it + beats.
PEER_S = 4.0
# The desync scenario's: rank 0 merges its incidents and draws each one's timeline.png in a thread
# (the default, incident_plot=True), and matplotlib's rendering holds the GIL. On a loaded 2-core
# host (a CI run, load 5-7) that stood rank 0's watchdog, heartbeat included, for ~10 s while its
# main thread waited in the slow group's all_reduce: its peers called it lost, and incident 3 was
# told as a lost rank instead of the desync the test checks. Over 3x that: no rank is lost here.
DESYNC_PEER_S = 30.0
SLOW_S = 25  # the desync scenario's "slow" group: its gloo timeout (see where it is made)


class Marker(Action):
    """A user's own rung: leaves a file per incident and rank (say, where a checkpoint would go)."""

    name = "marker"

    def __call__(self, incident: IncidentRef, ctx: ActionContext) -> Outcome:
        path = OUT / "marks" / f"{incident.doc.id}.rank{ctx.rank}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(incident.doc.kind.value)
        return Outcome(done=True, details={"path": str(path)})


def merged_incidents() -> int:
    return len(list(INCIDENTS.glob(f"*/{INCIDENT_FILE}"))) if INCIDENTS.is_dir() else 0


# The lines where the ranks stall end in a "# MARK: <name>" comment; the test finds them by it.


def eval_loop(wanted: int, bound_s: float = 20.0) -> None:
    """Rank 2 "evaluates" until the hang it causes has been merged into a report."""
    with phase("eval", batch=7):
        rankkit.when(lambda: merged_incidents() >= wanted, bound_s).wait(bound_s)  # MARK: eval


def own_statement(rank: int, wanted: int) -> bool:
    """Whether incident number ``wanted`` is merged and holds this rank's own dump (its statement)."""
    if merged_incidents() < wanted:
        return False
    latest = sorted(p for p in INCIDENTS.iterdir() if p.is_dir())[wanted - 1]
    return (latest / f"rank{rank}.json").is_file()


def frozen(wanted: int, bound_s: float = 20.0) -> None:
    """Rank 1 stays on its line until the incident is merged and its own statement written: its stack
    is sampled then. Ending at the merge alone let a loaded run (a CI run) take the late statement's
    stack after the freeze, in the next wait_for_incident."""
    r = dist.get_rank()
    with phase("checkpoint", step=9):
        rankkit.when(lambda: own_statement(r, wanted), bound_s).wait(bound_s)  # MARK: frozen


def exercise_ops(r: int, world: int) -> dict[str, str]:
    """Calls every instrumented op once; returns "ok" or the error per op."""
    x = torch.full((4,), float(r + 1))
    outcomes = {}
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather([torch.zeros(4) for _ in range(world)], x),
        "all_gather_single": lambda: dist.all_gather_single(torch.zeros(4 * world), x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(4 * world), x),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.zeros(4), [torch.ones(4) for _ in range(world)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * world)),
        "broadcast": lambda: dist.broadcast(x, src=0),
        "reduce": lambda: dist.reduce(x, dst=0),
        "barrier": lambda: dist.barrier(),
        "all_to_all": lambda: dist.all_to_all(
            [torch.zeros(2) for _ in range(world)], [torch.ones(2) for _ in range(world)]
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(2 * world), torch.ones(2 * world)),
        "gather": lambda: dist.gather(x, [torch.zeros(4) for _ in range(world)] if r == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(
            torch.zeros(4), [torch.ones(4) for _ in range(world)] if r == 0 else None, src=0
        ),
        "async_all_reduce": lambda: dist.all_reduce(x, async_op=True).wait(),
    }
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - an op gloo lacks is recorded as failed
            outcomes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    # Point to point, ring order: even ranks send first, odd ranks receive first.
    nxt, prv = (r + 1) % world, (r - 1) % world
    buf = torch.zeros(4)
    if r % 2 == 0:
        dist.send(x, dst=nxt)
        dist.recv(buf, src=prv)
    else:
        dist.recv(buf, src=prv)
        dist.send(x, dst=nxt)
    reqs = [dist.isend(x, dst=nxt), dist.irecv(buf, src=prv)]
    for req in reqs:
        req.wait()
    outcomes["p2p"] = "ok"
    return outcomes


def desync() -> None:
    r = rankkit.init()
    world = dist.get_world_size()
    wd = start_watchdog(
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=HANG_S,
        peer_timeout_s=DESYNC_PEER_S,
        incident_dir=INCIDENTS,
        actions=["report", Marker()],
    )

    with phase("train", step=1):
        put("ops", exercise_ops(r, world))
    recorder.sweep()
    put(
        "records",
        [
            {k: v for k, v in rec.to_dict().items() if k not in ("start", "end", "thread", "error")}
            for rec in recorder.records()
        ],
    )
    safe_barrier(timeout=20)

    # 1. A desync: rank 2 skips this all_reduce and goes to evaluate.
    with phase("train", step=4):
        if not skip_collective(2):
            put("desync_start", time.time())
            dist.all_reduce(torch.ones(4))  # MARK: desync
            put("desync_released", time.time())
    if r == 2:
        eval_loop(wanted=1)
        dist.all_reduce(torch.ones(4))  # back in step: the others are released
    put("after_desync", wd.wait_for_incident(10, count=1))

    # 2. Rank 1 freezes in Python (say a checkpoint save) while the others wait in a collective.
    safe_barrier(timeout=20)
    if r == 1:
        frozen(wanted=2)
    with phase("train", step=5):
        put("frozen_start", time.time())
        dist.all_reduce(torch.ones(8, dtype=torch.float64))
    put("after_frozen", wd.wait_for_incident(10, count=2))

    # 3. SIGALRM cannot interrupt a blocked gloo collective; the watchdog still reports it. Ranks 1-2
    # join rank 0's op only once the merged report is on disk: the alarm is delivered when the op
    # returns, not at its 1 s. The group's gloo timeout is a hang guard, over 3x the 8.1 s a loaded
    # CI run once took to report it (1.6-2.2 s is usual).
    safe_barrier(timeout=20)
    slow = dist.new_group(timeout=timedelta(seconds=SLOW_S))
    if r == 0:
        t0 = time.monotonic()
        put("alarm_start", time.time())
        try:
            with sigalrm_timeout(1.0):
                dist.all_reduce(torch.ones(3), group=slow)
            put("alarm", {"raised": None})
        except BaseException as exc:  # noqa: BLE001 - record whichever surfaced
            put(
                "alarm",
                {
                    "raised": type(exc).__name__,
                    "message": str(exc)[:300],
                    "context": type(exc.__context__).__name__ if exc.__context__ else None,
                },
            )
        put("alarm_elapsed", time.monotonic() - t0)
    else:
        wd.wait_for_incident(SLOW_S, count=3, merged=True)
        put("released_at", time.time())
        dist.all_reduce(torch.ones(3), group=slow)
    safe_barrier(timeout=SLOW_S + 60)
    put("incidents", wd.wait_for_incident(10, count=3, merged=r == 0, settled=True))
    put("group_names", {"world": dist.distributed_c10d._get_default_group().group_name, "slow": slow.group_name})
    rankkit.done()


def raise_lost() -> None:
    r = rankkit.init()
    survivors = dist.new_group([0, 1, 2])  # for a store barrier once rank 3 is gone
    wd = start_watchdog(
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=HANG_S,
        peer_timeout_s=PEER_S,
        escalate_after_s=0.5,
        incident_dir=INCIDENTS,
        action="raise",
    )

    # 1. Rank 2 freezes in Python; action raise ends its stall. The others wait in C++ (not raised).
    with phase("train", step=1):
        dist.all_reduce(torch.ones(2))
    t0 = time.monotonic()
    if r == 2:
        try:
            with phase("eval", batch=7):
                time.sleep(30)
            put("stall", {"raised": None})
        except CollectiveTimeout as exc:
            put("stall", {"raised": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0})
    with phase("train", step=2):
        dist.all_reduce(torch.ones(2))
    put("released", time.monotonic() - t0)
    put("first", wd.wait_for_incident(10, count=1, settled=True))
    safe_barrier(timeout=20)

    # 2. Rank 3 dies by SIGKILL; the others, idle in Python, learn it (and are raised).
    kill(3)
    put("lost", idle(count=2))
    put("survivors_met", bool(safe_barrier(timeout=20, group=survivors)))
    # Rank 0 hosts the store: it dies only once the others are out of the barrier's store round.
    store = dist.distributed_c10d._get_default_store()
    if r in (1, 2):
        store.set(f"test/out_of_barrier/{r}", "1")
    elif r == 0:
        store.wait(["test/out_of_barrier/1", "test/out_of_barrier/2"], timedelta(seconds=20))

    # 3. Rank 0, which hosts the store under this launcher, dies: the store is reported gone.
    kill(0)
    put("store", idle(count=3))
    put("incidents", wd.incidents)
    rankkit.done()


def idle(count: int, bound_s: float = 25.0) -> dict:
    """Waits in Python (phase idle) until the watchdog handled ``count`` incidents and raised."""
    t0 = time.monotonic()
    seen: dict = {"raised": None}
    wd = __import__("ncclguard").current_watchdog()
    try:
        with phase("idle"):
            while time.monotonic() - t0 < bound_s:
                time.sleep(0.05)
    except CollectiveTimeout as exc:
        seen = {
            "raised": type(exc).__name__,
            "message": str(exc),
            "missing": exc.missing_ranks,
            "elapsed": time.monotonic() - t0,
        }
    seen["handled"] = len(wd.wait_for_incident(5, count=count))
    return seen


def exit_ladder() -> None:
    r = rankkit.init()
    start_watchdog(
        heartbeat_s=HEARTBEAT_S, hang_timeout_s=1.0, escalate_after_s=0.4, incident_dir=INCIDENTS, action="exit"
    )
    put("started", time.time())
    rankkit.save()
    if r == 1:
        raised = 0
        with phase("eval", batch=3):
            while True:  # a stubborn stall: it swallows the raise and goes on
                try:
                    time.sleep(10)
                except CollectiveTimeout:
                    raised += 1
                    put("raised", raised)
                    rankkit.save()
    try:
        dist.all_reduce(torch.ones(2))
        put("unexpected", "the all_reduce returned")
    except RuntimeError as exc:  # rank 1 exited first: gloo closed the pairs; the job is still stuck
        put("all_reduce_error", str(exc).splitlines()[0][:200])
        rankkit.save()
        time.sleep(30)
    rankkit.done()


def hold_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # MARK: gil


def gil() -> None:
    r = rankkit.init()
    wd = start_watchdog(
        heartbeat_s=HEARTBEAT_S, hang_timeout_s=HANG_S, peer_timeout_s=1.2, incident_dir=INCIDENTS, action="report"
    )
    safe_barrier(timeout=20)
    # A few beats, so that each rank has seen its peer's heartbeat before rank 1 goes silent.
    time.sleep(4 * HEARTBEAT_S)  # MARK: gil-before
    if r == 1:
        with phase("checkpoint", step=3):
            hold_gil(6)  # a C call that keeps the GIL: no Python thread of this rank runs meanwhile
    with phase("train", step=4):
        put("start", time.time())
        dist.all_reduce(torch.ones(4))
    put("incidents", wd.wait_for_incident(15, count=1, merged=r == 0))
    if r == 0:  # the stacks are added to the report by a helper thread, after the merge
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            json.loads(p.read_text()).get("outside_stacks") for p in INCIDENTS.glob(f"*/{INCIDENT_FILE}")
        ):
            time.sleep(0.1)
    rankkit.done()


if __name__ == "__main__":
    rankkit.fault_fired(f"{sys.argv[1]}: skipped ops, frozen and killed ranks")  # every scenario here is made of faults
    {"desync": desync, "raise_lost": raise_lost, "exit": exit_ladder, "gil": gil}[sys.argv[1]]()
