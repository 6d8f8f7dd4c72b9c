"""Rank side of tests/integrations/test_deepspeed_heal_multirank.py: a DeepSpeed ZeRO-3 rank killed and restored
from the in-memory snapshot its buddy holds, 3 gloo ranks under ncclguard's launcher (restarts=1).

Every rank's first life trains STEPS steps through ``CommittedEngineStep(engine,
rebuild_engine=engine, heal=True, snapshot_every=2)`` without a fault (the reference, its full
parameters' digest), then the same steps from a fresh engine with rank 1 SIGKILLing itself at step
K. Its restarted process passes no engine: the stepper joins the survivors' world, builds its engine
there with the survivors (who build theirs anew too) and takes its ZeRO partitions from its buddy's
replica (rank 2). The newest snapshot is of step K-1: every rank goes back to it and the loop with
it (``stepper.steps()``). All end with the reference's parameters, bit for bit. The model holds 2.1M
parameters (Linear layers 1024 wide) with dropout.

Usage: ``deepspeed_heal_worker.py [SCENARIO]``: ``kill`` (the default) as above, on 3 ranks of one
host; ``host`` on 4 ranks, two simulated hosts of 2 (``GROUP_RANK`` is the launch rank // 2, as
torchrun sets it per node): ranks 2 and 3, the whole second host, SIGKILL themselves at step K; both
restarted, they take their partitions from their buddies on the other host (rank 2's from rank 0,
rank 3's from rank 1), and every rank goes back to the snapshot of step K-1 as above. ``refused``
(no reference run): as ``kill``, but rank 2 damages every replica of rank 1 it holds as step K begins,
so every snapshot is refused at the restore: no rank may write a checkpoint in which the restarted
rank's fresh partitions would stand for the run's (every rank exits 75; the launcher's restart goes
to the last whole checkpoint on disk, here none).
"""

from __future__ import annotations

import logging
import os
import sys

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from deepspeed_commit_worker import batch, engine, gathered_digest
from rankkit import put

import ncclguard
from ncclguard.integrations.deepspeed import CommittedEngineStep
from ncclguard.recovery.rebuild import generation

SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "kill"
ME = int(os.environ["RANK"])
rankkit.rank = lambda: ME  # results go by launch rank
if SCENARIO == "host":
    os.environ["GROUP_RANK"] = str(ME // 2)  # two hosts of two ranks, as torchrun --nnodes 2 places them
LIFE = ncclguard.restart_count()
KILLED = {"kill": [1], "host": [2, 3], "refused": [1]}[SCENARIO]
STEPS, K = 6, 3
BASE = STEPS  # the faulty run's step numbers follow the reference's (the commit's count grows)


def make() -> deepspeed.DeepSpeedEngine:
    # 2.1M parameters (two square layers 1024 wide) with dropout: Adam's moments make a restarted
    # rank's replica three times what its fresh engine holds, and the redo must draw the same masks.
    return engine(stage=3, dropout=0.1, width=1024, depth=2)


def train(kill_at: int | None, base: int) -> tuple[CommittedEngineStep, list[dict]]:
    stepper = CommittedEngineStep(
        make() if LIFE == 0 else None,  # a restarted process builds its engine on the joined world
        checkpoint_dir=os.environ["NCCLGUARD_TEST_OUT"],
        rebuild_engine=make,
        collective_timeout=3.0,
        commit_timeout=30,
        rebuild_timeout=90,  # the restarted process imports torch and DeepSpeed again
        heal=True,
        heal_timeout=60,
        snapshot_every=2,
    )
    results: list[dict] = []
    for step in stepper.steps(base + STEPS, start=base):

        def step_fn(eng: deepspeed.DeepSpeedEngine, step: int = step) -> float:
            if step - base == kill_at and ME in KILLED and LIFE == 0:
                put("results", results)
                rankkit.kill(ME)
            if step - base == kill_at and SCENARIO == "refused" and LIFE == 0:
                damage_replicas_of(KILLED[0], stepper)
            x, y = batch(step - base, ME)
            loss = torch.nn.functional.mse_loss(eng(x), y)
            eng.backward(loss)
            return float(loss.detach())

        res = stepper(step_fn, step=step)
        results.append({"step": step, "applied": bool(res), "rewound_to": res.rewound_to, "generation": generation()})
        if res.rewound_to is not None:  # where the rolled-back step's seconds went, and this rank's restore
            r = res.restored
            put("rewind", {"timings": sorted(res.timings), "role": r and r.role, "restore": r and sorted(r.timings)})
            put("holders", r and r.holders)  # who sent each restarted rank its replica
    return stepper, results


def damage_replicas_of(rank: int, stepper: CommittedEngineStep) -> None:
    """Flips a bit in every replica of ``rank``'s snapshots this rank holds: each fails its digest."""
    rankkit.fault_fired(f"damages every replica of rank {rank}")
    keeper = stepper.recovery.keeper
    assert keeper is not None
    held = keeper.replicas.get(rank, [])
    for snap in held:
        snap.payload[12345] ^= 1
    put("damaged", [s.step for s in held])
    rankkit.save()  # every rank ends in the adapter's exit 75, without rankkit.done()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    put("life", LIFE)
    if LIFE == 0:
        rankkit.init(timeout_s=60)
        deepspeed.init_distributed(dist_backend="gloo")
    if LIFE == 0 and SCENARIO != "refused":
        ref, ref_results = train(None, 0)
        put("reference_results", ref_results)
        put("reference", gathered_digest(ref.engine))
        keeper = ref.recovery.keeper
        assert keeper is not None
        put("reference_takes", [keeper.takes, keeper.lost.failed])  # a fault-free run loses no take
    stepper, results = train(K, BASE)
    put("results", results)
    put("resume_step", stepper.resume_step)
    healed = stepper.healed  # a restarted process: how it was restored
    put(
        "healed",
        healed and {"role": healed.role, "step": healed.step, "bytes": healed.bytes, "restore": sorted(healed.timings)},
    )
    if healed is not None:
        put("holders", getattr(healed, "holders", None))
    put("global_steps", stepper.engine.global_steps)
    put("digest", gathered_digest(stepper.engine))
    put("generation", generation())
    put("world", [dist.get_rank(), dist.get_world_size()])
    rankkit.done()


if __name__ == "__main__":
    main()
