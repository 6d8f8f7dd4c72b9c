"""Rank side of tests/collectives/test_collectives_faults.py. Usage: collectives_faults_worker.py SCENARIO.

Scenarios: ``group_timeout`` (our deadline before the backend's), ``alignment`` (calls that do
not line up are told, not matched), ``threads`` (safe calls from two threads on two groups, then
a barrier while the store is frozen).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import safe_all_reduce, safe_barrier
from ncclguard.collectives.all_reduce import CollectiveResult
from ncclguard.collectives.barrier import BarrierResult
from ncclguard.recording.flight import recorder

# The deadline of the calls that must fail at once (a mismatch told by the cross-rank check): long, so
# that a call ended by its deadline instead can never pass the test's bound (a third of it).
AT_ONCE_DEADLINE_S = 30.0


def barrier_at_a(**kw: Any) -> BarrierResult:
    return safe_barrier(**kw)


def barrier_at_b(**kw: Any) -> BarrierResult:
    return safe_barrier(**kw)


def all_reduce_at_c(t: torch.Tensor, **kw: Any) -> CollectiveResult:
    return safe_all_reduce(t, **kw)


def site(fn: Any) -> str:
    """Where ``fn`` calls ncclguard: the line after its ``def``."""
    return f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno + 1}"


def outcome(res: CollectiveResult | BarrierResult, t0: float) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "elapsed": time.monotonic() - t0,
        "type": type(res.error).__name__ if res.error else None,
        "message": str(res.error) if res.error else "",
        "missing": getattr(res.error, "missing_ranks", None),
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def group_timeout() -> None:
    r = rankkit.init(timeout_s=60)

    def three_second_group() -> Any:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=3))

    # A peer 4 s late on a group whose own timeout is 3 s; the default deadline is capped below it.
    g = three_second_group()
    t0 = time.monotonic()
    if r == 0:
        put("default", outcome(safe_all_reduce(torch.ones(4), group=g), t0))
        rankkit.announce("default")
    else:
        rankkit.wait_for("default", at_least_s=4.0)  # late: after rank 0 gave up, however long that took
        t0 = time.monotonic()
        put("late_peer", outcome(safe_all_reduce(torch.ones(4), group=g), t0))
    safe_barrier(timeout=30)

    # Explicit deadlines at or above the group's timeout: refused before any communication.
    g = three_second_group()
    seq_before = dict(recorder.last_seq())
    refused = {}
    for name, timeout in (("equal", 3), ("above", timedelta(seconds=5))):
        try:
            safe_all_reduce(torch.ones(2), group=g, timeout=timeout)
            refused[name] = None
        except ValueError as exc:
            refused[name] = str(exc)
    put("refused", refused)
    put("refused_no_communication", recorder.last_seq() == seq_before)
    t = torch.ones(2)
    put("just_below", {"ok": bool(safe_all_reduce(t, group=g, timeout=2.9)), "value": t.tolist()})
    # The barrier never touches the communicator: an explicit timeout past the group's is taken.
    put("barrier_explicit_long", bool(safe_barrier(timeout=10, group=g)))
    safe_barrier(timeout=30)

    # The barrier's default deadline is capped too; the late rank fails at once.
    g = three_second_group()
    if r == 1:
        rankkit.wait_for("barrier_default", at_least_s=3.5)  # late: after rank 0 gave up
    t0 = time.monotonic()
    b = safe_barrier(group=g)
    put("barrier_default", outcome(b, t0) | {"late": b.late})
    if r == 0:
        rankkit.announce("barrier_default")
    safe_barrier(timeout=30)

    # The backend gives up first: an op another piece of code queued on the group 2 s earlier
    # reaches the group's 3 s timeout before the guarded call's own deadline (2 + 2.2 s): 1 s into
    # the call, 1.2 s before the deadline (each side of it about 1 s for a loaded machine).
    g = three_second_group()
    if r == 0:
        dist.all_reduce(torch.ones(2), group=g, async_op=True)
        time.sleep(2.0)
        t0 = time.monotonic()
        put("backend_first", outcome(safe_all_reduce(torch.ones(3), group=g), t0))
        rankkit.announce("backend_first")
    else:
        rankkit.wait_for("backend_first", at_least_s=4.5)  # never joins the queued op
    safe_barrier(timeout=30)
    rankkit.done()


def alignment() -> None:
    r = rankkit.init(timeout_s=60)
    put("sites", {"a": site(barrier_at_a), "b": site(barrier_at_b), "c": site(all_reduce_at_c)})
    lines = _Lines()
    logging.getLogger("ncclguard").addHandler(lines)

    # Different kinds in one round: both ranks are told at once, nothing moves.
    t0 = time.monotonic()
    if r == 0:
        res: Any = barrier_at_a(timeout=AT_ONCE_DEADLINE_S)
    else:
        res = all_reduce_at_c(torch.ones(3), verify=True, timeout=AT_ONCE_DEADLINE_S)
    put("kinds", outcome(res, t0))
    # ... and a later call made at the same point by both works.
    t = torch.full((3,), float(r + 1))
    put("after_kinds", {"plain": bool(all_reduce_at_c(t, timeout=10)) and t.tolist() == [3.0] * 3})
    put("after_kinds_verified", bool(all_reduce_at_c(torch.ones(3), verify=True, timeout=10)))

    # One kind from two lines: goes on, logged once with both sites however often it happens.
    before = len(lines.lines)
    oks = [bool(barrier_at_a(timeout=10) if r == 0 else barrier_at_b(timeout=10)) for _ in range(3)]
    put("sites_ok", oks)
    put("site_notes", [line for line in lines.lines[before:] if "different lines" in line])

    # A rank makes a call the others do not (an extra barrier, alone): it times out; the other's
    # next call lands in that given-up round, is told at once which call rank 0 was in, and its
    # retry meets rank 0's next call.
    t0 = time.monotonic()
    if r == 0:
        put("extra", outcome(barrier_at_a(timeout=1), t0))
        rankkit.announce("extra")
    else:
        rankkit.wait_for("extra", at_least_s=1.5)  # after rank 0 gave that round up, however late
        t0 = time.monotonic()
        put("extra_victim", outcome(all_reduce_at_c(torch.ones(2), verify=True, timeout=AT_ONCE_DEADLINE_S), t0))
    t = torch.full((2,), float(r + 1))
    put("extra_then", {"ok": bool(all_reduce_at_c(t, verify=True, timeout=10)), "value": t.tolist()})

    # A call refused on one rank (bad input) still takes its number: counts stay equal.
    t0 = time.monotonic()
    if r == 1:
        try:
            safe_all_reduce(torch.ones(3), timeout=0)
        except ValueError:
            pass
    else:
        put("refused_peer", outcome(all_reduce_at_c(torch.ones(3), verify=True, timeout=1.5), t0))
    put("after_refused", bool(all_reduce_at_c(torch.ones(3), verify=True, timeout=10)))

    # Counts two apart (rank 0 made two lone barriers); a tagged barrier realigns them.
    if r == 0:
        barrier_at_a(timeout=0.3)
        barrier_at_a(timeout=0.3)
    else:
        time.sleep(1.0)
    put("tagged", bool(safe_barrier(tag="sync-1", timeout=10)))
    put("after_tag", bool(all_reduce_at_c(torch.ones(3), verify=True, timeout=10)))

    # An all_reduce that makes no store round against a barrier: both give up at the deadline and
    # the post-mortem names each rank's call (on a side group: the all_reduce kills it).
    side = dist.new_group(backend="gloo")
    t0 = time.monotonic()
    if r == 0:
        res = barrier_at_a(group=side, timeout=2)
    else:
        res = all_reduce_at_c(torch.ones(2), group=side, timeout=2)
    put("postmortem", outcome(res, t0))
    rankkit.done()


def threads() -> None:
    r = rankkit.init(timeout_s=60)
    groups = [dist.new_group(backend="gloo") for _ in range(4)]
    errors: list[str] = []
    done: dict[str, int] = {}

    def traffic(name: str, group: Any, salt: int) -> None:
        rng = random.Random(salt)  # the same sequence on every rank
        calls = 0
        try:
            for i in range(40):
                n = rng.randint(1, 3000)
                chunk = rng.choice([None, 7, 500])
                verify = rng.choice([None, True])
                t = torch.full((n,), float(r + 1 + salt))
                res = safe_all_reduce(t, group=group, chunk_numel=chunk, verify=verify, timeout=20)
                want = float(1 + salt + 2 + salt)
                if not res or not bool((t == want).all()):
                    errors.append(f"{name} call {i}: ok={res.ok} error={res.error} first={t[0].item()} want={want}")
                calls += 1
                if i % 10 == 9:
                    if not safe_barrier(group=group, timeout=20):
                        errors.append(f"{name} barrier after call {i} failed")
                    calls += 1
        except Exception as exc:  # noqa: BLE001 - the test reports whatever a thread hit
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        done[name] = calls

    workers = [
        threading.Thread(target=traffic, args=(n, g, s)) for n, g, s in (("A", groups[0], 0), ("B", groups[1], 7))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    put("two_groups", {"errors": errors, "calls": done})

    # From a thread other than the main one, a call keeps its deadline; rank 1 is absent.
    got: dict[str, Any] = {}

    def lonely(kind: str, group: Any) -> None:
        t0 = time.monotonic()
        if kind == "all_reduce":
            got[kind] = outcome(safe_all_reduce(torch.ones(3), group=group, timeout=1.5), t0)
        else:
            got[kind] = outcome(safe_barrier(group=group, timeout=1.5), t0)

    if r == 0:
        ts = [
            threading.Thread(target=lonely, args=(k, g)) for k, g in (("all_reduce", groups[2]), ("barrier", groups[3]))
        ]
        for th in ts:
            th.start()
        for th in ts:
            th.join(30)
        put("thread_deadline", got)
    else:
        time.sleep(3.0)
    safe_barrier(timeout=30)
    frozen_store(r)
    rankkit.done()


def frozen_store(r: int) -> None:
    """The store stops answering: torchrun's agent (the ranks' parent) holds the TCPStore
    server, so SIGSTOP freezes it; gloo's own connections do not need it."""
    agent = os.getppid()
    with open(f"/proc/{agent}/cmdline", "rb") as f:
        cmdline = f.read()
    if not any(name in cmdline for name in (b"torchrun", b"torch.distributed.run")):
        put("frozen_store", {"skipped": f"the parent is not torchrun's agent: {cmdline!r}"})
        return
    dist.barrier()
    if r == 0:
        os.kill(agent, signal.SIGSTOP)
    dist.barrier()  # over gloo: both ranks start with the store frozen
    t0 = time.monotonic()
    frozen = outcome(safe_barrier(timeout=2.0), t0)
    dist.barrier()
    if r == 0:
        os.kill(agent, signal.SIGCONT)
    dist.barrier()
    time.sleep(0.2)  # the call left blocked in the frozen store returns first (until then calls fail fast)
    t0 = time.monotonic()
    thawed = outcome(safe_barrier(timeout=10.0), t0)
    put("frozen_store", {"frozen": frozen, "thawed": thawed})


if __name__ == "__main__":
    rankkit.fault_fired(f"{sys.argv[1]}: late peers and lone calls")  # every scenario here is made of faults
    {"group_timeout": group_timeout, "alignment": alignment, "threads": threads}[sys.argv[1]]()
