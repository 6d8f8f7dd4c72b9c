"""Rank side of tests/recovery/test_held_release_multirank.py. Usage: held_worker.py.

3 ranks as ``ncclguard run --ncclguard-restarts 1`` runs them (each under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default), ``RecoveringStep(module, opt)`` with every
default (under restarts it heals), no timeout set anywhere: the group keeps gloo's 30 min, the step
bound its 300 s, the rebuild its 60 s.

At step KILL of the first world, the hold seen in CI (tests/integrations/test_hf_bitequal_multirank.py):
- launch rank 2 SIGKILLs itself as the step begins;
- launch rank 1 waits until it is gone, then fails its step without entering the op (as a rank whose op
  failed at once on the dead peer's closed connection) and waits in the commit;
- launch rank 0 enters an ``all_reduce`` on the pair group {0, 1}, which rank 1 never joins: a live peer
  holds it, and the commit waits for it.
The survivors' verdicts read rank 2's death notice (its supervisor posts it) and shut down their
connections to each other: rank 0's op fails, the step fails on every rank, rank 2's restart rejoins,
is healed, and step KILL is redone on the full world. Each process records its steps, the verdict's
events and what rank 0's held op ended with; at the end every rank compares its parameters.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put
from recovering_worker import batch, flat, make_module, summary

import ncclguard
from ncclguard import RecoveringStep
from ncclguard.watching.watchdog import current_watchdog
from ncclguard.world import current_world

ME, LIFE = int(os.environ["RANK"]), ncclguard.restart_count()
rankkit.rank = lambda: ME + 10 * LIFE  # a restarted process saves apart from its first life
STEPS, KILL = 8, 4
BEATS_S = 60.0  # bound of the wait for every peer's first heartbeat (5 s apart by default)


def peers_beating() -> None:
    """Waits until this rank's watchdog has a heartbeat of every peer: the verdict finds the peers of
    this host by their heartbeats' pids (a job's steps run long past its first beats)."""
    wd = current_watchdog()
    assert wd is not None, "NCCLGUARD_AUTO=1 starts the watchdog"
    deadline = time.monotonic() + BEATS_S
    while len(wd.peer_beats()[1]) < dist.get_world_size() - 1:
        assert time.monotonic() < deadline, f"no heartbeat of every peer within {BEATS_S} s"
        time.sleep(0.1)


def hold(pair: dist.ProcessGroup | None) -> None:
    """Step KILL of the first world (see the module doc)."""
    if ME == 2:
        rankkit.fault_fired("SIGKILL as the step begins")
        rankkit.save()
        os.kill(os.getpid(), signal.SIGKILL)
    if ME == 1:
        pid = json.loads((Path(os.environ["NCCLGUARD_TEST_OUT"]) / "rank2.json").read_text())["pid"]
        rankkit.when(lambda: rankkit.dead(pid), 60.0).wait(60.0)
        raise RuntimeError("launch rank 1 leaves its step before its op: its peer rank 2 is gone")
    t, t0 = torch.ones(4), time.monotonic()
    try:
        dist.all_reduce(t, group=pair)
    except RuntimeError as exc:
        put("held", {"error": str(exc)[:300], "held_s": round(time.monotonic() - t0, 3)})
        raise
    put("held", {"error": None, "held_s": round(time.monotonic() - t0, 3)})


def main() -> None:
    dist.init_process_group("gloo")  # no timeout: gloo's own 30 min
    module = make_module()
    stepper = RecoveringStep(module, torch.optim.SGD(module.parameters(), lr=0.1))  # every default
    pair = dist.new_group([0, 1]) if LIFE == 0 else None  # every rank of the first world makes it
    put("pid", os.getpid())
    put("life", LIFE)
    put("heal", stepper.engine.options.heal)
    put("lane", getattr(stepper.healed, "lane", None))  # the group a restarted process was healed over
    rankkit.save()
    results = []
    for step in range(stepper.resume_step or 0, STEPS):
        x, y = batch(step, ME)
        if step == KILL and LIFE == 0:
            peers_beating()

        def step_fn(model: torch.nn.Module, step: int = step, x=x, y=y) -> float:
            if step == KILL and current_world().generation == 0:
                hold(pair)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        t0 = time.time()
        res = stepper(step_fn, step=step)
        results.append(
            {"step": step, **summary(res), "size": dist.get_world_size(), "elapsed_s": round(time.time() - t0, 3)}
        )
        if not res:
            break
    put("results", results)
    put("events", stepper.engine.timing.driver.events)
    mine = flat(module)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


if __name__ == "__main__":
    main()
