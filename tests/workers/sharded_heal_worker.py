"""Rank side of tests/recovery/test_sharded_heal_multirank.py: FSDP2 ranks killed and restored from the
snapshots their buddies hold. Usage: sharded_heal_worker.py SCENARIO (ncclguard's launcher, restarts=1,
``twice``: 2).

The model has the size where fixed slack stops mattering: 2.7M float32 parameters in four Linear
layers 1024 wide and a (1, 512, 1024) position table (ranks 1 and up hold an empty shard of it), with
dropout, Adam (its moments triple the state a rank holds, and a restarted
rank has none of them yet) and an LR schedule the loop steps (in the snapshots).

``kill`` (3 ranks, one host, a snapshot every 2 steps, two kept of each): a fault-free run of STEPS
steps through ``RecoveringStep(wrap=FSDP2(...), heal=True, snapshot_keep=2)`` (the reference, which
also gathers the full state at the start of its step 2), then the same run, its steps numbered on
from STEPS, in which rank 1 SIGKILLs itself inside its take of step STEPS + KILL_TAKE (10): the
survivors' swaps fail, so that take commits nowhere, and step 10 fails. The newest committed
snapshot is of step 8: the survivors go back to it (a rollback, the loop's ``stepper.steps()``
goes back too), the restarted rank gets its shards from its buddy (rank 2), and every rank ends
bit-equal to the reference. Then, with every rank's live state at the end of the run:
a replica that does not fit rank 1's module is refused on every rank at its manifest, at each step
held, before anything is copied; and rank 2's replica of rank 1's newest snapshot is damaged (one
flipped bit): every rank falls back to the step before, and the full state is then bit-equal to the
reference's at the start of that step. Then that replica holds NaN instead, with a digest that matches
(numbers that went bad before the take): refused all the same, the same fallback.

``host`` (4 ranks on two simulated hosts of 2: ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
as torchrun sets them per node; a snapshot every step; its test turns the watchdog on as
``NCCLGUARD_AUTO=1`` does, with the node tier on): ranks 2 and 3, the whole second host, SIGKILL
themselves at step K; restarted, they get their shards of step K from ranks 0 and 1 on the other
host, and every rank redoes step K (the survivors' live state is that snapshot: no rollback). Each
rank records how its two-tier rounds went (the takes' agreements, the commits, the meeting).

``twice`` (3 ranks, one host, a snapshot every step, two restarts): rank 1 SIGKILLs itself at step K;
its first restart SIGKILLs itself inside its restore, once its replica from rank 2 has arrived. The
survivors' restore fails at its death notice; the world is rebuilt again, the second restart gets
its shards, every rank redoes step K at its third attempt and ends bit-equal to the reference.

``ring`` (4 ranks, one host, a snapshot every 2 steps): the ``kill`` run with rank 3 dying inside its
take of step 10. Gloo's all_reduce of the take's agreement goes round the ranks: a neighbour of the
dead rank fails at once, the others wait on live ranks that have given up, up to the take's deadline
(``heal_timeout``, HEAL_S); its launcher's death notice ends their wait instead, and every rank ends
bit-equal to the reference. Its job is a user's: a BERT classifier of 2,054,274 parameters
(``transformers.BertConfig``, hidden 128, 2 layers, vocabulary 12,800, the default dropout of 0.1),
each encoder layer and the model sharded by FSDP2, AdamW, a warm-up schedule passed as
``scheduler=``, the forward under bf16 autocast, gradient clipping at norm 1.0, and shuffled data
(``DistributedSampler(shuffle=True)``, a new epoch every 3 steps).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from ddp_bitequal_worker import batch as bert_batch
from ddp_bitequal_worker import dataset as bert_dataset
from ddp_bitequal_worker import make as make_bert  # a BERT classifier of 2.05M parameters, AdamW
from rankkit import put
from recovering_worker import full_state, shard_layers  # the FSDP2 layout and its gathered state

import ncclguard
from ncclguard import FSDP2, RecoveringStep
from ncclguard.recovery.records import StepResult
from ncclguard.recovery.snapshots import keeper as keeper_module
from ncclguard.recovery.snapshots import restore as restore_module
from ncclguard.recovery.snapshots.keeper import Keeper
from ncclguard.recovery.snapshots.packing import Snapshot, digest
from ncclguard.recovery.snapshots.restore import Restored, restore
from ncclguard.recovery.snapshots.state import ModuleState

SCENARIO = sys.argv[1]
ME = int(os.environ["RANK"])
rankkit.rank = lambda: ME  # results go by launch rank, whatever the world
if SCENARIO == "host":  # two hosts of two ranks, numbered as torchrun --nnodes 2 --nproc-per-node 2 numbers them
    os.environ.update(GROUP_RANK=str(ME // 2), LOCAL_RANK=str(ME % 2), LOCAL_WORLD_SIZE="2")
LIFE = ncclguard.restart_count()
KILLED = {"kill": [1], "host": [2, 3], "ring": [3], "twice": [1]}[SCENARIO]
EVERY = {"kill": 2, "host": 1, "ring": 2, "twice": 1}[SCENARIO]
STEPS, K = 6, 3
KILL_TAKE = 4  # kill: rank 1 dies inside its take of step BASE + 4 (a snapshot every 2 steps from BASE)
BACK_AT = 3  # kill: the step (of the reference) the damaged replica's fallback goes back to (9 in the faulty run)
BASE = STEPS  # the faulty run's step numbers follow the reference run's
WIDTH = 1024

GROUP_TIMEOUT_S = 60.0
BOUND_STEP_S = 3.0  # the step bound: a survivor waiting on a live peer's data gives up then
COMMIT_S = 30.0  # hang guards: the launcher's death notice settles the commit at once
REBUILD_S = 90.0  # the restarted processes import torch again (20 s seen on a loaded host)
HEAL_S = 60.0


# ring: the BERT job of tests/workers/ddp_bitequal_worker.py on 4 ranks: 6 samples a rank, 3 steps an epoch.
BERT_WORLD, BERT_BATCH, WARMUP = 4, 2, 3
BERT_DATA = bert_dataset(24)


class Positions(torch.nn.Module):
    """A learned position table of shape (1, 512, WIDTH), as ViTs and BERT-style models hold one: FSDP2
    shards dim 0, so every rank but rank 0 holds an empty shard (0, 512, WIDTH) of its 2 MiB, and the
    buddy of rank 0 holds a replica of the whole row that its own shard cannot bound."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, 512, WIDTH) * 0.02)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.table.mean(dim=(0, 1))


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if SCENARIO == "ring":
        return make_bert()
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, WIDTH), Positions()]
    for _ in range(2):
        layers += [torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(WIDTH, WIDTH)]
    module = torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    return module, torch.optim.Adam(module.parameters(), lr=1e-3, betas=(0.8, 0.95))


def shard_bert(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module.bert.encoder.layer:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + ME)
    return torch.randn(6, 64, generator=g), torch.randn(6, 1, generator=g)


def die_in_take(base: int) -> None:
    """The rank KILLED dies inside its take of step ``base + KILL_TAKE`` (after its state is captured)."""
    real = keeper_module.pack

    def pack(state: Any, step: int, rank: int, reuse: Any = None) -> Any:
        if step == base + KILL_TAKE and LIFE == 0 and ME in KILLED:
            put("results", RESULTS)
            rankkit.kill(ME)
        return real(state, step, rank, reuse)

    keeper_module.pack = pack  # type: ignore[assignment]


DIED_IN_RESTORE = Path(os.environ["NCCLGUARD_TEST_OUT"]) / "died-in-restore"


def die_in_restore() -> None:
    """twice: the first restart of rank 1 dies inside its restore, once its replica has arrived."""
    real = restore_module.unpack

    def unpack(snapshot: Any) -> Any:
        DIED_IN_RESTORE.write_text(str(snapshot.manifest.step))  # the next life says so: it saves over this one
        rankkit.kill(ME)
        return real(snapshot)

    restore_module.unpack = unpack  # type: ignore[assignment]


def summary(step: int, res: StepResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step": step,
        "ok": res.ok,
        "attempts": res.attempts,
        "generation": res.generation,
        "rewound_to": res.rewound_to,
        "error": type(res.error).__name__ if res.error is not None else None,
    }
    if isinstance(res.healed, Restored):
        out["restored"] = described(res.healed)
        out["restore_parts"] = parts(res.healed)
    if res.rewound_to is not None:  # where the rolled-back step's seconds went
        out["timings"] = sorted(res.timings)
    return out


def described(r: Restored) -> dict[str, Any]:
    return {"ok": r.ok, "role": r.role, "step": r.step, "rolled_back": r.rolled_back, "holders": r.holders}


def parts(r: Restored) -> dict[str, Any]:
    """The restore's timings: its phases, and whether they add up to no more than the whole."""
    return {"names": sorted(r.timings), "within": sum(r.timings.values()) <= r.elapsed_s + 1e-3, "bytes": r.bytes}


RESULTS: list[dict[str, Any]] = []  # the faulty run's, saved by a rank that dies in its take
AT_BACK: list[torch.Tensor] = []  # the reference's full state at the start of its step BACK_AT


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    if SCENARIO == "ring":  # as a user writes it for BERT: bf16 autocast, clipping after the backward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return
    noise = torch.rand(x.shape, dtype=x.dtype) * 1e-3  # differs if the generators were not restored
    torch.nn.functional.mse_loss(model(x + noise), y).backward()


def train(kill_at: int | None, base: int) -> tuple[RecoveringStep, list[dict[str, Any]]]:
    module, opt = make()
    if SCENARIO == "ring":  # a linear warm-up, then flat
        sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    else:
        sched = torch.optim.lr_scheduler.StepLR(
            opt, step_size=2, gamma=0.5
        )  # stepped by the loop, kept by the snapshots
    stepper = RecoveringStep(
        module,
        opt,
        wrap=FSDP2(shard_bert if SCENARIO == "ring" else shard_layers),
        scheduler=sched,
        collective_timeout=BOUND_STEP_S,
        commit_timeout=COMMIT_S,
        rebuild_timeout=REBUILD_S,
        heal=True,
        heal_timeout=HEAL_S,
        snapshot_every=EVERY,
        snapshot_keep=2 if SCENARIO == "kill" else 1,
    )
    results: list[dict[str, Any]] = RESULTS if base else []
    for step in stepper.steps(base + STEPS, start=base):
        x, y = bert_batch(BERT_DATA, step - base, BERT_WORLD, BERT_BATCH) if SCENARIO == "ring" else batch(step - base)
        if base == 0 and step == BACK_AT and SCENARIO == "kill":
            AT_BACK.append(full_state(stepper))  # every rank at once: a gather over the world

        def step_fn(model: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            if step - base == kill_at and ME in KILLED and LIFE == 0:
                put("results", results)
                rankkit.kill(ME)
            forward_backward(model, x, y)

        res = stepper(step_fn, step=step)
        if res:
            sched.step()
        results.append(summary(step, res))
        if not res and res.rewound_to is None:
            break
    return stepper, results


def refused(stepper: RecoveringStep) -> None:
    """Rank 1 is given its replica again, into a module of another shape: every rank refuses."""
    assert stepper.engine.keeper is not None
    if ME == 1:
        rankkit.fault_fired("a replica restored into a module of another shape")
        other = torch.nn.Sequential(torch.nn.Linear(64, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))
        before = [t.detach().clone() for t in other.parameters()]
        keeper = Keeper(ModuleState(lambda: other, None))
        res = restore(keeper, None, HEAL_S, receivers=[1])
        put("untouched", all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True)))
    else:
        keeper = stepper.engine.keeper
        res = restore(keeper, keeper.own[-1].step + 1, HEAL_S, receivers=[1])
    put(
        "refused",
        {**described(res), "error": str(res.error), "refused_ranks": getattr(res.error, "refused_ranks", None)},
    )


def damaged(stepper: RecoveringStep) -> None:
    """Rank 2's replica of rank 1's newest snapshot loses a bit: every rank goes back to the one before."""
    keeper = stepper.engine.keeper
    assert keeper is not None
    held = sorted(s.step for s in keeper.own)
    put("held", held)
    if ME == 2:
        rankkit.fault_fired("a bit of a replica flipped")
        keeper.replicas[1][-1].payload[12345] ^= 1
    if ME == 1:  # as a restarted rank: its live model takes the replica, its own snapshots are not used
        keeper = Keeper(ModuleState(lambda: stepper.model, lambda: stepper.optimizer))
        res = restore(keeper, None, HEAL_S, receivers=[1])
    else:
        res = restore(keeper, held[-1] + 1, HEAL_S, receivers=[1])
    put("damaged", {**described(res), "error": str(res.error) if res.error else None})
    now = full_state(stepper)  # every rank at once: a gather over the world
    back = AT_BACK[0] if ME == 0 else torch.zeros_like(now)
    dist.broadcast(back, src=0)  # a restarted rank never ran the reference: rank 0's copy
    put("equal_to_reference_at_back", torch.equal(now, back))


def poisoned(stepper: RecoveringStep) -> None:
    """Rank 2's replica of rank 1's newest snapshot holds NaN, its digest made to match (a step whose
    numbers turned NaN before the take): the digest passes, the check of its numbers refuses it, and
    every rank goes back to the one before, as for a damaged one."""
    keeper = stepper.engine.keeper
    assert keeper is not None
    held = sorted(s.step for s in keeper.own)
    if ME == 2:
        rankkit.fault_fired("a NaN in a replica, its digest made to match")
        snap = keeper.replicas[1][-1]
        snap.payload[12345] ^= 1  # the bit damaged() flipped, back: only the NaN is wrong now
        entry = next(e for e in snap.manifest.entries if e.dtype == "float32" and e.shape and e.shape[0])
        snap.payload[entry.offset : entry.offset + 4] = torch.tensor([float("nan")]).view(torch.uint8)
        keeper.replicas[1][-1] = Snapshot(
            snap.manifest.model_copy(update={"digest": digest(snap.payload)}), snap.payload
        )
    if ME == 1:
        keeper = Keeper(ModuleState(lambda: stepper.model, lambda: stepper.optimizer))
        res = restore(keeper, None, HEAL_S, receivers=[1])
    else:
        res = restore(keeper, held[-1] + 1, HEAL_S, receivers=[1])
    put("poisoned", {**described(res), "error": str(res.error) if res.error else None, "held": held})
    now = full_state(stepper)
    back = AT_BACK[0] if ME == 0 else torch.zeros_like(now)
    dist.broadcast(back, src=0)
    put("equal_to_reference_after_poison", torch.equal(now, back))
    put("finite", bool(torch.isfinite(now).all()))


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    put("life", LIFE)
    if SCENARIO in ("kill", "ring"):
        die_in_take(BASE)
    if SCENARIO == "twice" and LIFE == 1:
        die_in_restore()
    if SCENARIO == "twice" and LIFE == 2:
        put("died_in_restore", DIED_IN_RESTORE.read_text() if DIED_IN_RESTORE.exists() else None)
    if LIFE == 0:
        dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        ref, ref_results = train(kill_at=None, base=0)
        put("reference_results", ref_results)
        reference = full_state(ref)
        assert ref.engine.keeper is not None
        # What snapshots cost the loop, and the takes it lost (a fault-free run loses none).
        put("reference_takes", [ref.engine.keeper.takes, ref.engine.keeper.spent_s > 0, ref.engine.keeper.lost.failed])
    stepper, results = train(kill_at=K if SCENARIO in ("host", "twice") else None, base=BASE)
    put("results", results)
    put("resume_step", stepper.resume_step)
    if isinstance(stepper.healed, Restored):
        put("restored", described(stepper.healed))
        put("restore_parts", parts(stepper.healed))
    mine = full_state(stepper)
    ref_t = reference if LIFE == 0 and ME == 0 else torch.zeros_like(mine)
    dist.broadcast(ref_t, src=0)  # a restarted rank never ran the reference: rank 0's copy
    put("equal_to_reference", torch.equal(mine, ref_t))
    put("final", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    put("every", stepper.engine.keeper.k if stepper.engine.keeper is not None else None)
    if SCENARIO == "host":  # with the node tier on (its test's environment): this process's two-tier rounds
        from ncclguard.deadlines import Deadline
        from ncclguard.store import node_store
        from ncclguard.store.tier_round import tier_counts

        put("tier", tier_counts())
        if ME % 2 == 0:  # the node's store lives in this process (LOCAL_RANK 0, no launcher's store)
            # Whether a wait read the death notices through it (store/deaths.py, relay_deaths).
            near = node_store.near_client(30.0, Deadline.within(30.0))
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            put("relayed", near is not None and near.check([f"ncclguard/dead/{restart}/relay/at"]))
    if SCENARIO == "kill":
        refused(stepper)
        damaged(stepper)
        poisoned(stepper)
    rankkit.done()


if __name__ == "__main__":
    main()
