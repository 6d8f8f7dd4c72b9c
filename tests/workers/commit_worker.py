"""Rank side of tests/recovery/test_commit_multirank.py. Usage: commit_worker.py SCENARIO.

``agree`` (torchrun, 3 ranks), one launch for every check of should_commit on real gloo ranks:
  (a) clean DDP steps commit everywhere with the same numbers;
  (b) rank 2 comes 6 s late to a safe_all_reduce with a 2 s deadline, after the others' commit
      settled: the commit is falsy on all three with the same verdict, rank 2 ``late``;
      after a rebuild the next step commits (generation 1);
  (c) rank 2 issues one plain all_reduce more than the others: the count mismatch names it;
  (d) a commit on a group whose communicator is dead still settles;
  (e) every group is compared: a send from rank 0 to rank 1 (which gloo counts in those two ranks'
      sequence numbers only) fails nothing, and one all_reduce more on a subgroup names rank 2.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put, skip_collective

import ncclguard
from ncclguard import rebuild_world, safe_all_reduce, should_commit
from ncclguard.errors import CommitFailed, GroupFailed
from ncclguard.recording.instrument import instrument
from ncclguard.recovery.commit import CommitResult

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

GROUP_TIMEOUT_S = 20.0


def fields(res: CommitResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "bool": bool(res),
        "step": res.step,
        "generation": res.generation,
        "failed_ranks": res.failed_ranks,
        "reasons": {str(k): v for k, v in res.reasons.items()},
        "late": res.late,
        "elapsed_s": res.elapsed_s,
        "error_type": type(res.error).__name__ if res.error is not None else None,
        "error_agrees": res.error is None
        or (isinstance(res.error, CommitFailed) and res.error.failed_ranks == res.failed_ranks),
    }


def refused(fn: Any) -> list[str] | None:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return [type(exc).__name__, str(exc)]
    return None


def clean_steps(tag: str, steps: int) -> None:
    """DDP steps with a commit each: the commits, and the parameters equal on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    commits = []
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(3, 4, generator=g, dtype=torch.float64)).sum().backward()
        res = should_commit(timeout=30)
        commits.append(fields(res))
        if res:
            opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    put(f"{tag}_commits", commits)
    put(f"{tag}_params_equal", all(torch.equal(everyone[0], t) for t in everyone))
    del model, opt


def agree() -> None:
    r = rankkit.init(timeout_s=GROUP_TIMEOUT_S)
    # Bad input: refused before any communication (a round joined by one rank would stall the rest).
    put(
        "bad",
        {
            "timeout_str": refused(lambda: should_commit(timeout="5")),  # type: ignore[arg-type]
            "timeout_zero": refused(lambda: should_commit(timeout=0)),
            "step_negative": refused(lambda: should_commit(step=-1)),
            "step_bool": refused(lambda: should_commit(step=True)),
            "failure_int": refused(lambda: should_commit(failure=3)),  # type: ignore[arg-type]
        },
    )

    # (a) clean steps.
    clean_steps("a", 3)
    # The caller's step numbers: checked, and a repeat refused before any communication.
    put("user_step", fields(should_commit(timeout=30, step=7)))
    put("user_step_repeat", refused(lambda: should_commit(step=7)))
    put("committed_step", ncclguard.recovery.committed_step())

    # (b) rank 2 comes 6 s late to a 2 s all_reduce, after the others' 2 s commit settled.
    old_pg = dist.distributed_c10d._get_default_group()
    if r != 2:
        res = safe_all_reduce(torch.ones(4), timeout=2)
        put("b_all_reduce", [res.ok, type(res.error).__name__])
        put("b_commit", fields(should_commit(timeout=2)))
        rankkit.announce(f"b-verdict-{r}")
    else:
        rankkit.fault_fired("6 s late to an all_reduce")  # (c) to (e) are faults too, all after it
        t0 = time.monotonic()
        rankkit.wait_for("b-verdict-0", timeout_s=60)
        rankkit.wait_for("b-verdict-1", at_least_s=max(0.0, 6.0 - (time.monotonic() - t0)), timeout_s=60)
        t = torch.ones(4)
        res = safe_all_reduce(t, timeout=2)
        put("b_all_reduce", [res.ok, type(res.error).__name__, t.tolist()])
        put("b_late_by_s", time.monotonic() - t0)
        put("b_commit", fields(should_commit(timeout=2)))
    rebuilt = rebuild_world(timeout=60)
    put("b_rebuild", [rebuilt.ok, rebuilt.generation])
    put("b_old_group", refused(functools.partial(should_commit, group=old_pg)))
    del old_pg
    put("b_after", fields(should_commit(timeout=30)))

    # (c) rank 2 issues one plain all_reduce more than the others (left in flight).
    if r == 2:
        dist.all_reduce(torch.ones(1), async_op=True)
    put("c_commit", fields(should_commit(timeout=30)))
    put("c_rebuild", rebuild_world(timeout=60).generation)
    clean_steps("c_after", 2)

    # (d) the communicator dies (ranks 0-1 time out, rank 2 never issues the op); the commit settles.
    if not skip_collective(2):
        res = safe_all_reduce(torch.ones(4), timeout=2)
        again = safe_all_reduce(torch.ones(4), timeout=2)
        put("d_dead", [type(res.error).__name__, isinstance(again.error, GroupFailed)])
    put("d_commit", fields(should_commit(timeout=30)))
    put("d_rebuild", rebuild_world(timeout=60).generation)
    put("d_after", fields(should_commit(timeout=30)))

    # (e) a send on the default group, recorded (instrument), then an extra op on another group.
    instrument()
    sub = dist.new_group([0, 1, 2])
    dist.all_reduce(torch.ones(1), group=sub)
    t = torch.ones(2)
    if r == 0:
        dist.send(t, 1)
    elif r == 1:
        dist.recv(t, 0)
    put("e_p2p_seq", dist.group.WORLD._get_sequence_number_for_group())  # type: ignore[attr-defined]
    put("e_p2p_commit", fields(should_commit(timeout=30)))
    if r == 2:
        dist.all_reduce(torch.ones(1), group=sub, async_op=True)  # left in flight: done() ends the rank
    put("e_sub_name", dist.distributed_c10d._get_process_group_name(sub))
    put("e_sub_commit", fields(should_commit(timeout=30)))
    rankkit.done()


if __name__ == "__main__":
    {"agree": agree}[sys.argv[1]]()
