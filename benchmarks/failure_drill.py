"""The failure drill: a 3-rank gloo DDP job with a fault every T seconds, against a fault-free run
and against restart-from-checkpoint (issue 20, part 5).

Runs (each one torchrun launch of 3 ranks on this host, the same model, data and step count):

- ``clean``: ``RecoveringStep`` and the watchdog (ladder ``report, abort, fence``), no fault;
- ``stall``: the same with a stall every ``--every`` seconds: rank 2, then 1, then 2, ... sleeps
  ``--stall-s`` (past the step bound ``--group-timeout``, ``RecoveringStep``'s
  ``collective_timeout``) once; every rank redoes the step on a rebuilt world of 3. Final
  parameters must be bit-equal to ``clean``'s;
- ``stuck``: the first fault is rank 2 stuck for good in Python (a sleep loop it never leaves): its
  watchdog fences it (exit 0), ranks 0-1 rebuild as a world of 2 and go on; later faults are stalls
  of rank 1;
- ``kill``: rank 2, then 1, then 2, ... SIGKILLs itself once per fault; each rank runs under its
  supervisor (``python -m ncclguard.supervise``), which posts the death in the job's store (the
  survivors' commit settles at once) and restarts the killed process alone (torchrun's agent never
  sees it fail); the restarted process rejoins the survivors' rebuild in its old place and is
  healed from a live peer (``RecoveringStep(heal=True)``), and every rank redoes the step;
- ``spare``: ``kill`` with ``--warm-spare``: a standby process that imported torch takes the dead
  rank's place;
- ``restart``: the baseline: plain DDP, a checkpoint every ``--ckpt-every`` steps, torchrun
  ``--max-restarts``: on a stall past the group timeout the ranks' all_reduce raises, torchrun
  restarts every rank, and they go on from the last checkpoint.

``--framework fsdp2`` runs ``clean``, ``nosnap``, ``kill`` and ``spare`` with the module sharded by
FSDP2 (``RecoveringStep(wrap=ncclguard.FSDP2(...), heal=True)``, Adam): each rank's shards are kept
in in-memory snapshots replicated on a buddy rank, a killed rank is restored from its buddy, and
every rank goes back to the snapshot's step (``stepper.steps()``); ``nosnap`` is ``clean`` without
snapshots (``heal=False``), the side-by-side cost of taking them.

``--framework deepspeed`` runs the same four as ``fsdp2`` with a DeepSpeed ZeRO-3 engine
(``CommittedEngineStep(rebuild_engine=..., heal=True)``): a killed rank's partitions come from its
buddy, every rank builds its engine again in process, and the loop goes back to the snapshot.

Sharded state, issue 35 (``--framework fsdp2`` or ``deepspeed``):

- ``clean4`` and ``host``: 4 ranks on 2 simulated hosts of 2 (``GROUP_RANK`` = launch rank // 2, as
  ``torchrun --nnodes 2`` sets it; the snapshots' placement puts host 1's replicas on host 0 and
  back). ``clean4`` has no fault; in ``host`` both ranks of host 1 are SIGKILLed at once every
  ``--every`` seconds (default 120: rank 2 kills rank 3, then itself), restarted by their
  supervisors and restored from their buddies on host 0; measured against ``clean4``, bit-equal to it;
- ``disk``: the baseline without ncclguard's in-memory heal: the plain sharded loop (FSDP2 and
  Adam, or the ZeRO-3 engine) with a checkpoint in the framework's own format (DCP, or
  ``engine.save_checkpoint``) every ``--ckpt-every`` steps (default 100) under the run's own
  directory; a kill (rank 2, then 1, ...) ends the whole job as torchrun does, torchrun
  (``--max-restarts``) starts every rank again, and they resume from the newest checkpoint: the
  steps since are lost and redone. Measured against ``clean``.

Every sharded run reports each rank's snapshot memory (bytes of its own snapshots and of the
replicas it keeps, from their manifests) and, for each kill, its cost by part (``kill_parts``: the
engine's timings on rank 0 and the restarted processes' stamps; ``disk_parts``: the kill to the
new processes, their start, the checkpoint's load, the lost steps redone).

``--framework hf`` runs ``clean``, ``stall``, ``kill`` and ``spare`` through the HF Trainer
instead of a loop of ``RecoveringStep``: ``TrainingArguments``' defaults (``use_cpu=True``,
``ddp_backend="gloo"``; ``ddp_timeout`` stays 1,800 s), ``guard_trainer(trainer, recover=True,
heal=...)``, the same model (its forward returns ``{"loss": ...}``) and one sample per row of the
loop's batches; the faults come from a ``TrainerCallback``'s ``on_step_begin``.

``--framework hf-deepspeed`` runs ``clean``, ``nosnap``, ``kill`` and ``spare`` through the HF Trainer
on DeepSpeed ZeRO-3 (``TrainingArguments(deepspeed=...)`` with the usual ``"auto"`` values; the model
made by ``model_init``), ``guard_trainer(trainer, recover=True, heal=True)``: each rank's partitions
and the Trainer's state are kept in snapshots replicated on a buddy, a killed rank's come from its
buddy, every rank builds its engine again inside ``train()`` and the Trainer's resume path takes
them back to the snapshot's step; ``nosnap`` is ``clean`` with ``heal=False``.

Each step sleeps ``--step-s`` (its compute) besides a tiny float64 model's forward and backward.
Measured per run, on rank 0, from the first step's start (the first launch's, for ``restart``) to
the last step's end: throughput (steps/s), step efficiency (steps committed / steps attempted,
redone and rolled-back steps counted as attempted), and a SHA-256 of the final parameters.

Usage:
    python benchmarks/failure_drill.py --short                 # ~1 min: clean, stall, restart
    python benchmarks/failure_drill.py --steps 800 --every 60 --json benchmarks/results/failure_drill.json
    python benchmarks/failure_drill.py --framework hf --modes clean kill spare stall --steps 2100 --every 60
    python benchmarks/failure_drill.py --framework fsdp2 --modes clean nosnap kill spare --steps 2100 --every 60
    python benchmarks/failure_drill.py --framework deepspeed --modes clean nosnap kill spare --steps 2100 --every 60
    python benchmarks/failure_drill.py --framework hf-deepspeed --modes clean nosnap kill spare --steps 2100 --every 60
    python benchmarks/failure_drill.py --framework fsdp2 --modes clean4 host --steps 2400 --every 120
    python benchmarks/failure_drill.py --framework fsdp2 --modes clean kill disk --steps 1500 --every 60
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MODES = ("clean", "nosnap", "stall", "stuck", "kill", "spare", "restart", "clean4", "host", "disk")
SHARDED_MODES = ("clean", "nosnap", "kill", "spare", "clean4", "host", "disk")
NPROC = 3
HOST_RANKS = 2  # --modes host: 4 ranks on 2 simulated hosts of 2
# The watchdog of the recovering runs: a hang after 2 s, the fence 6 s after the abort rung (so a
# stall of a few seconds is redone, never fenced), heartbeats every 0.5 s.
WATCHDOG = {"heartbeat_s": 0.5, "hang_timeout_s": 2.0, "escalate_after_s": 1.0, "fence_after_s": 6.0}


# ------------------------------------------------------------------------------------ rank side


def _watchdog(args: argparse.Namespace) -> dict[str, float]:
    """The drill's watchdog settings, its hang bound from ``--hang-timeout`` where given."""
    if args.hang_timeout is None:
        return dict(WATCHDOG)
    return {**WATCHDOG, "hang_timeout_s": args.hang_timeout}


SIZE: dict[str, float | None] = {"params_m": None}  # --params-m, set once in main() (ranks read it in _model)


def _model() -> Any:
    import torch

    torch.manual_seed(7)
    target = SIZE["params_m"]
    if not target:  # the drill's tiny model: the figures of docs/reference/recovery-drills.md before --params-m
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    # --params-m: two square layers hold almost all of it (2 W^2), as a transformer's blocks do
    width = max(64, int(math.sqrt(target * 1e6 / 2)) // 64 * 64)
    layers: list[Any] = [torch.nn.Linear(16, width)]
    for _ in range(2):
        layers += [torch.nn.Tanh(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(width, 1)).double()


def _batch(step: int, launch_rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + launch_rank)
    return torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g, dtype=torch.float64)


def _shard(module: Any, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def _gathered_digests(digest: str) -> list[Any]:
    """Every rank's SHA-256 (hex) as 32-byte tensors, gathered: the same on every rank when the
    parameters are."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return everyone


def _digest(module: Any) -> tuple[str, Any]:
    import torch

    # FSDP2's parameters are DTensors: the digest is of the full parameters, the same on every rank.
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in full])
    # The array's own buffer: .tobytes() would copy it holding the GIL (800 MB at 100M parameters: the
    # watchdog's beats stopped for 3.2 s, past the drill's 3 s peer bound); hashlib releases it.
    return hashlib.sha256(flat.numpy()).hexdigest(), flat


class Faults:
    """Fault ``i`` falls due ``every`` seconds after fault ``i - 1`` was injected and ``every``
    seconds after its victim last came out of a recovery (a redone step committed, or, in a
    restarted process, its join), whichever is later; fault 0, ``every`` seconds after the first
    step. Its victim (a launch rank: 2, then 1, then 2, ...) injects it at the start of its next
    step and marks it first (``fault-<i>.done``, with the time). Every rank reads the marks, so the
    ranks agree on the next fault whoever restarted meanwhile, and a fault never falls due while
    the last one is being recovered from: a restart slower than ``every`` on a loaded host does
    not set off a chain of overdue faults."""

    def __init__(self, mode: str, every: float, t0: float, out: Path, me: int) -> None:
        self.mode, self.every, self.t0, self.out, self.me = mode, every, t0, out, me
        self.recovered_at = t0

    def recovered(self, now: float) -> None:
        """This rank came out of a recovery now."""
        self.recovered_at = now

    def victim(self, i: int) -> int:
        if self.mode == "stuck":
            return 2 if i == 0 else 1
        if self.mode == "host":  # the first rank of host 1 (ranks 2 and 3) kills its host
            return 2
        return 2 if i % 2 == 0 else 1

    def marks(self) -> list[float]:
        """When each fault injected so far was injected."""
        return [float(p.read_text().split()[1]) for p in self.out.glob("fault-*.done")]

    def take(self, now: float) -> int | None:
        """The fault this rank injects now (already marked), or None."""
        if self.mode in ("clean", "nosnap", "clean4"):
            return None
        marks = self.marks()
        i = len(marks)
        if now < max([*marks, self.recovered_at]) + self.every or self.victim(i) != self.me:
            return None
        _save_text(self.out / f"fault-{i}.done", f"{self.me} {now!r}")
        return i


def _deadline(group_timeout: float) -> None:
    """Once every rank is ready (the group was joined and DDP built under a long bound: ranks of a
    loaded host start seconds apart), ``group_timeout`` for every collective (a rebuilt world
    keeps it)."""
    import torch.distributed as dist

    from ncclguard import _torch_compat as compat

    dist.barrier()
    compat.set_group_timeout(compat.default_group(), timedelta(seconds=group_timeout))


def _kill_time(out: Path, me: int) -> float | None:
    """When this launch rank was last killed (its fault mark), or None."""
    times = [float(t) for p in out.glob("fault-*.done") for r, t in [p.read_text().split()] if int(r) == me]
    return max(times, default=None)


def _save_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}")
    tmp.write_text(text)
    tmp.replace(path)


def _save(out: Path, me: int, data: dict[str, Any]) -> None:
    _save_text(out / f"rank{me}.json", json.dumps(data))


def _end() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a gloo group that timed out may still hold an abandoned op: no destructor waits


def _record(
    args: argparse.Namespace, attempted: int, train_s: float, faults: Faults, recoveries: list[Any], digest: str
) -> dict[str, Any]:
    """What every rank of a recovering run reports (the launcher reads rank 0's)."""
    return {
        "mode": args.mode,
        "steps": args.steps,
        "committed": args.steps,
        "attempted": attempted,
        "train_s": train_s,
        "faults": len(faults.marks()),
        "recoveries": recoveries,
        "digest": digest,
    }


def _start(
    args: argparse.Namespace, out: Path, me: int, restarted: bool, healed: Any = None, **stamps: float
) -> tuple[float, Faults]:
    """The run's clock and its faults: the ranks of the first launch start together (rank 0 writes
    the start); a restarted process notes when it took the dead rank's place and was healed (and,
    restored from a snapshot, its ``Restored``: bytes and timings)."""
    import torch.distributed as dist

    import ncclguard

    start_file = out / "t0.txt"
    if restarted:
        joined = {
            "kill_at": _kill_time(out, _victim_of(args.mode, me)),
            "fault": len(list(out.glob("fault-*.done"))) - 1,
            "script_at": args.script_at,
            **stamps,
            "healed_at": time.time(),
            "restored": _restored(healed),
        }
        _save_text(out / f"joined-{me}-{ncclguard.restart_count()}.json", json.dumps(joined))
    else:  # a restarted process must make no collective the survivors do not make
        dist.barrier()  # every rank ready (ranks of a loaded host start seconds apart)
        if me == 0:
            _save_text(start_file, repr(time.time()))
        dist.barrier()
    t0 = float(start_file.read_text())
    faults = Faults(args.mode, args.every, t0, out, me)
    if restarted:
        faults.recovered(time.time())
    return t0, faults


def rank_recovering(args: argparse.Namespace) -> None:
    """A rank of ``clean``, ``stall`` or ``stuck``, or of ``--framework fsdp2``'s recovering runs."""
    import torch
    import torch.distributed as dist

    import ncclguard

    out, me = Path(args.out), int(os.environ["RANK"])
    kill = args.mode in ("kill", "spare", "host")
    fsdp2 = args.framework == "fsdp2"
    _simulate_hosts(args.mode, out, me)
    restarted = ncclguard.restart_count() > 0  # a killed rank restarted by its supervisor: it rejoins, no init
    if not restarted:
        if args.defaults:
            dist.init_process_group("gloo")  # --defaults: no timeout set anywhere (gloo's 30 min)
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    module = _model()
    from torch.nn.parallel import DistributedDataParallel

    stepper_at = time.time()
    # --defaults: every timeout of the engine at its default (the step bound 300 s, the judge bound
    # learned) and the watchdog as `ncclguard run` starts it (NCCLGUARD_AUTO, every setting default).
    timeouts: dict[str, Any] = (
        {}
        if args.defaults
        else {
            "collective_timeout": args.group_timeout,  # the step bound; the group keeps its own 120 s
            "commit_timeout": args.commit_timeout,
            # A killed rank's restart imports torch again before it rejoins: seconds on a loaded host.
            "rebuild_timeout": args.rejoin_timeout if kill else args.commit_timeout,
        }
    )
    stepper = ncclguard.RecoveringStep(
        module,
        torch.optim.Adam(module.parameters(), lr=1e-3)
        if fsdp2
        else torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9),
        # One bucket layout from the first step on: a re-wrapped DDP otherwise starts from its
        # initial layout, and the ring all-reduce sums some elements in another order (last bit).
        wrap=ncclguard.FSDP2(_shard) if fsdp2 else lambda m: DistributedDataParallel(m, find_unused_parameters=True),
        allow_shrink=args.mode == "stuck",
        heal=kill or (fsdp2 and args.mode != "nosnap"),  # FSDP2: snapshots, restored from a buddy
        **({"snapshot_every": args.snapshot_every} if fsdp2 else {}),
        **timeouts,
    )
    # After the stepper: a restarted process has its process group only once it has rejoined.
    if not args.defaults:
        ncclguard.start_watchdog(
            **_watchdog(args), action="fence", incident_dir=out / "incidents", straggler=False, incident_plot=False
        )
    t0, faults = _start(args, out, me, restarted, stepper.healed, stepper_at=stepper_at)
    attempted, healed = 0, 0
    costs = Costs(out)
    for step in stepper.steps(args.steps):  # goes back when every rank went back to a snapshot
        x, y = _batch(step, me)
        first = [True]

        def step_fn(model: Any, x: Any = x, y: Any = y, first: list[bool] = first) -> None:
            if first[0]:
                first[0] = False
                i = faults.take(time.time())  # marked first: the restarted process does not repeat it
                if i is not None:
                    if kill:
                        _kill(args.mode, out, me)
                    if args.mode == "stuck" and i == 0:
                        while True:  # stuck for good: the watchdog's fence rung ends this process
                            time.sleep(0.1)
                    time.sleep(args.stall_s)
            time.sleep(args.step_s)  # the step's compute
            torch.nn.functional.mse_loss(model(x), y).backward()

        res = stepper(step_fn, step=step)
        attempted += res.attempts
        healed += bool(res.healed)
        if res.rewound_to is not None:  # the loop goes back: this attempt and the steps since count
            costs.rewound(step, res.rewound_to, res.elapsed_s, res.timings, res.healed)
            faults.recovered(time.time())
            continue
        if res.attempts > 1:
            faults.recovered(time.time())
            rec = stepper.recoveries[-1]  # where the recovery's seconds went (Recovered.timings)
            # the failed commit settled on a death notice: early
            costs.redone(step, rec, res.healed, early=res.commits[0].early)
        if not res:
            raise SystemExit(f"step {step} was not applied: {res.error}")
        costs.applied(step)
    t1 = time.time()
    digest, _ = _digest(stepper.model if fsdp2 else module)
    everyone = _gathered_digests(digest)  # not the parameters: at 100M, 3 x 800 MB more a rank ran out of memory
    _save(
        out,
        me,
        {
            **_record(args, attempted, t1 - t0, faults, costs.records, digest),
            "equal_across_ranks": all(torch.equal(everyone[0], t) for t in everyone),
            "memory": _memory(stepper.engine.keeper),
            "world_size": dist.get_world_size(),
            "generation": res.generation,
            "healed": healed,
            "restarted": restarted,
            # The judge bound learned from the job, against its real step intervals (docs/reference/recovery-drills.md).
            "judge_s": stepper.engine.timing.judge_s(),
            "learned": stepper.engine.timing.learner.state.model_dump(),
        },
    )
    _end()


def rank_deepspeed(args: argparse.Namespace) -> None:
    """A rank of ``--framework deepspeed``: ZeRO-3 through ``CommittedEngineStep(rebuild_engine=...,
    heal=True)`` (``nosnap``: ``heal=False``), the loop's data from the step number."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import ncclguard
    from ncclguard.integrations.deepspeed import CommittedEngineStep

    out, me = Path(args.out), int(os.environ["RANK"])
    kill = args.mode in ("kill", "spare", "host")
    _simulate_hosts(args.mode, out, me)
    restarted = ncclguard.restart_count() > 0
    if not restarted:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        deepspeed.init_distributed(dist_backend="gloo")

    stepper_at = time.time()
    stepper = CommittedEngineStep(
        None if restarted else _zero3_engine(),
        checkpoint_dir=str(out / "ckpt"),
        rebuild_engine=_zero3_engine,
        collective_timeout=args.group_timeout,
        commit_timeout=args.commit_timeout,
        rebuild_timeout=args.rejoin_timeout if kill else args.commit_timeout,
        heal=args.mode != "nosnap",
        snapshot_every=args.snapshot_every,
    )
    t0, faults = _start(args, out, me, restarted, stepper.healed, stepper_at=stepper_at)
    attempted, costs = 0, Costs(out)
    for step in stepper.steps(args.steps):
        x, y = _batch(step, me)
        first = [True]

        def step_fn(eng: Any, x: Any = x, y: Any = y, first: list[bool] = first) -> None:
            if first[0]:
                first[0] = False
                if faults.take(time.time()) is not None and kill:
                    _kill(args.mode, out, me)
            time.sleep(args.step_s)  # the step's compute
            eng.backward(torch.nn.functional.mse_loss(eng(x.float()), y.float()))

        done = len(stepper.recovery.recoveries)
        res = stepper(step_fn, step=step)
        attempted += 1
        if res.rewound_to is not None:
            costs.rewound(step, res.rewound_to, sum(res.timings.values()), res.timings, res.restored)
            faults.recovered(time.time())
            continue
        if len(stepper.recovery.recoveries) > done:  # the step was redone: its failed attempts count too
            rec = stepper.recovery.recoveries[-1]
            attempted += rec.attempts - 1
            costs.redone(step, rec, res.restored, early=None)  # the engine keeps the failed commit to itself
            faults.recovered(time.time())
        costs.applied(step)
    t1 = time.time()
    params = list(stepper.engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        flat = torch.cat([p.detach().reshape(-1).double() for p in params])
    digest = hashlib.sha256(flat.numpy()).hexdigest()
    _save(
        out,
        me,
        {
            **_record(args, attempted, t1 - t0, faults, costs.records, digest),
            "memory": _memory(stepper.recovery.keeper),
            "world_size": dist.get_world_size(),
            "restarted": restarted,
        },
    )
    _end()


def rank_hf(args: argparse.Namespace) -> None:
    """A rank of ``--framework hf``: the HF Trainer with its defaults, guarded by ``guard_trainer``;
    of ``--framework hf-deepspeed``: the same on DeepSpeed ZeRO-3, its model made by ``model_init``."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import ncclguard
    from ncclguard.integrations.hf import find_guard, guard_trainer

    out, me = Path(args.out), int(os.environ["RANK"])
    kill = args.mode in ("kill", "spare")
    restarted = ncclguard.restart_count() > 0
    start_file = out / "t0.txt"
    ds = args.framework == "hf-deepspeed"

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model().float() if ds else _model()

        def forward(self, x: Any, y: Any) -> dict[str, Any]:
            time.sleep(args.step_s)  # the step's compute
            dtype = next(self.body.parameters()).dtype
            return {"loss": torch.nn.functional.mse_loss(self.body(x.to(dtype)), y.to(dtype))}

    class Rows(torch.utils.data.Dataset):
        """Row ``i`` of the loop drill's batches, one sample each (the Trainer shards and batches them)."""

        def __len__(self) -> int:
            return args.steps * 8 * NPROC

        def __getitem__(self, i: int) -> dict[str, Any]:
            x, y = _batch(i // 8, 0)
            return {"x": x[i % 8], "y": y[i % 8]}

    state: dict[str, Any] = {"faults": None}

    class Drill(TrainerCallback):
        def on_train_begin(self, targs: Any, tstate: Any, control: Any, **kw: Any) -> None:
            if state["faults"] is not None:  # the loop entered again after a heal: recovered
                state["faults"].recovered(time.time())
                return
            if not restarted:  # a restarted process makes no collective the survivors do not make
                dist.barrier()
                if me == 0:
                    _save_text(start_file, repr(time.time()))
                dist.barrier()
            t0 = float(start_file.read_text())
            state["t0"] = t0
            state["faults"] = Faults(args.mode, args.every, t0, out, me)
            state["seen"] = 0
            if restarted:
                state["faults"].recovered(time.time())
                joined = {"kill_at": _kill_time(out, me), "script_at": args.script_at, "healed_at": time.time()}
                _save_text(out / f"joined-{me}-{ncclguard.restart_count()}.json", json.dumps(joined))

        def on_step_begin(self, targs: Any, tstate: Any, control: Any, **kw: Any) -> None:
            state["begun"] = state.get("begun", 0) + 1  # steps attempted: redone and rolled back ones too
            done = find_guard(trainer).recovery.recoveries  # type: ignore[union-attr]
            if len(done) > state["seen"]:  # a step was redone since the last look
                state["seen"] = len(done)
                state["faults"].recovered(time.time())
            if state["faults"].take(time.time()) is None:  # marked first: a restart does not repeat it
                return
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.stall_s)

    targs = TrainingArguments(  # HF's defaults, on the CPU with gloo (ddp_timeout stays 1,800 s)
        output_dir=str(out / "hf"),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=args.steps,
        per_device_train_batch_size=8,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        deepspeed=_ZERO3_TRAINER if ds else None,
    )
    model = {"model_init": Net} if ds else {"model": Net()}  # ZeRO-3: the Trainer builds it again on a new world
    trainer = Trainer(**model, args=targs, train_dataset=Rows(), callbacks=[Drill()])
    guard_trainer(
        trainer,
        recover=True,
        heal=(args.mode != "nosnap") if ds else kill,
        # hf-deepspeed: no watchdog, as --framework deepspeed: the drill's 2 s hang bound is shorter than a
        # new engine's build inside train(), and its incident would fail the redo's commit.
        watchdog=False
        if ds
        else dict(
            **_watchdog(args), action="fence", incident_dir=out / "incidents", straggler=False, incident_plot=False
        ),
        collective_timeout=args.group_timeout,
        commit_timeout=args.commit_timeout,
        rebuild_timeout=args.rejoin_timeout if kill else args.commit_timeout,
    )
    trainer.train()
    t1 = time.time()
    recoveries = find_guard(trainer).recovery.recoveries  # type: ignore[union-attr]
    module = trainer.model.body
    if ds:  # ZeRO-3: the digest of the full parameters, gathered for the read
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            digest, flat = _digest(module)
    else:
        digest, flat = _digest(module)
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    _save(
        out,
        me,
        {
            "mode": args.mode,
            "framework": args.framework,
            "steps": args.steps,
            "committed": args.steps,
            # A rollback to a snapshot re-attempts every step after it: counted where they began (rank 0).
            "attempted": state["begun"] if ds else args.steps + sum(r.attempts - 1 for r in recoveries),
            "train_s": t1 - state["t0"],
            "faults": len(state["faults"].marks()),
            "recoveries": [
                {"step": r.step, "attempts": r.attempts, "s": round(r.elapsed_s, 3), **r.timings} for r in recoveries
            ],
            "digest": digest,
            "equal_across_ranks": all(torch.equal(everyone[0], t) for t in everyone),
            "world_size": dist.get_world_size(),
            "global_step": trainer.state.global_step,
            "restarted": restarted,
        },
    )
    _end()


_ZERO3_TRAINER = {  # the Trainer's usual ZeRO-3 config: its "auto" values come from TrainingArguments
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def rank_restart(args: argparse.Namespace) -> None:
    """A rank of the ``restart`` baseline: plain DDP, a checkpoint every ``ckpt_every`` steps; a
    stall past the group timeout makes the all_reduce raise and torchrun restart every rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    out, me = Path(args.out), int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    module = _model()
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    ckpt, start_file = out / "ckpt.pt", out / "t0.txt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)  # our own file, written below (tensors and ints)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    model = DistributedDataParallel(module)
    _deadline(args.group_timeout)
    if me == 0 and not start_file.exists():
        start_file.write_text(repr(time.time()))
    dist.barrier()
    t0 = float(start_file.read_text())
    # A fault falls due --every seconds after the last one was injected, so a restarted job never
    # meets an overdue one at once (the marks, on disk, outlive the restarts).
    faults = Faults("stall", args.every, t0, out, me)
    attempts = (out / "attempts.txt").open("a")
    for step in range(start, args.steps):
        if faults.take(time.time()) is not None:  # marked first: a restarted job does not repeat it
            time.sleep(args.stall_s)
        opt.zero_grad(set_to_none=True)
        x, y = _batch(step, me)
        time.sleep(args.step_s)
        torch.nn.functional.mse_loss(model(x), y).backward()  # raises past the group timeout: restart
        opt.step()
        if me == 0:
            attempts.write(f"{step}\n")
            attempts.flush()
            if (step + 1) % args.ckpt_every == 0:
                tmp = out / "ckpt.tmp"
                torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                tmp.replace(ckpt)
    t1 = time.time()
    digest, _ = _digest(module)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempts.close()
    attempted = len((out / "attempts.txt").read_text().split())
    _save(
        out,
        me,
        {
            "mode": "restart",
            "steps": args.steps,
            "committed": args.steps,
            "attempted": attempted,
            "train_s": t1 - t0,
            "faults": len(faults.marks()),
            "restarts": restarts,
            "digest": digest,
            "world_size": dist.get_world_size(),
        },
    )
    _end()


# ------------------------------------- sharded state: a host lost, restart from disk, the cost by part


def _simulate_hosts(mode: str, out: Path, me: int) -> None:
    """``host`` and ``clean4``: 4 ranks on 2 simulated hosts of 2, as ``torchrun --nnodes 2`` places them (its
    ``GROUP_RANK``, which the snapshots' placement reads: host 1's replicas go to host 0 and back).
    Every rank of a killing mode notes its pid, for a host peer that must kill it."""
    if mode in ("host", "clean4"):
        os.environ["GROUP_RANK"] = str(me // HOST_RANKS)
    if mode in ("kill", "spare", "host"):
        import psutil

        _save_text(out / f"pid-{me}.txt", f"{os.getpid()} {psutil.Process().create_time()!r}")


def _victim_of(mode: str, me: int) -> int:
    """The launch rank whose fault mark says when ``me`` was killed (a host's first rank marks it)."""
    return me - me % HOST_RANKS if mode == "host" else me


def _kill(mode: str, out: Path, me: int) -> None:
    """The fault of ``kill``, ``spare`` and ``host``: SIGKILL this process; ``host``: its host
    peers first, by the pid each noted (checked against the process's start time, so that a pid
    the system reused is never killed), then itself: the whole simulated host at once."""
    import psutil

    if mode == "host":
        first = _victim_of(mode, me)
        for peer in range(first, first + HOST_RANKS):
            if peer == me:
                continue
            pid, started = (out / f"pid-{peer}.txt").read_text().split()
            try:
                proc = psutil.Process(int(pid))
                if proc.create_time() == float(started):
                    proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def _restored(res: Any) -> dict[str, Any] | None:
    """A ``Restored``'s bytes and timings (None for a heal of a replicated model, or none)."""
    from ncclguard.recovery.snapshots.restore import Restored

    if not isinstance(res, Restored):
        return None
    return {"role": res.role, "step": res.step, "bytes": res.bytes, "s": round(res.elapsed_s, 4), **res.timings}


def _memory(keeper: Any) -> dict[str, Any] | None:
    """The host memory this rank's snapshots hold at the end: its own and the replicas it keeps for
    its sources (``snapshot_keep`` of each, one by default), in bytes, from the snapshots' manifests."""
    if keeper is None:
        return None
    own = [s.manifest.nbytes for s in keeper.own]
    replicas = {src: [s.manifest.nbytes for s in held] for src, held in keeper.replicas.items()}
    return {
        "own_bytes": sum(own),
        "replica_bytes": sum(sum(v) for v in replicas.values()),
        "own": own,
        "replicas": replicas,
        "every": keeper.k,
        "takes": keeper.takes,
        "spent_s": round(keeper.spent_s, 4),  # what the steps paid for them (Keeper.spent_s)
    }


class Costs:
    """What each recovery cost on this rank, by part, for the drill's report.

    A recovery that redid the failed step (the newest snapshot was of that step) is the engine's
    ``Recovered`` record; one that went back to an older snapshot (a rollback) is the failed step's
    ``timings`` and its ``Restored``, and its ``redo`` is measured here: from the rollback to the
    failed step applied again (the steps since the snapshot and the failed one, redone)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.records: list[dict[str, Any]] = []
        self._back: tuple[dict[str, Any], int, float] | None = None

    def _fault(self) -> int:
        return len(list(self.out.glob("fault-*.done"))) - 1

    def redone(self, step: int, rec: Any, restored: Any, early: bool | None) -> None:
        """A step applied after a redo (``rec``: its ``Recovered``)."""
        self.records.append(
            {
                "fault": self._fault(),
                "step": step,
                "attempts": rec.attempts,
                "s": round(rec.elapsed_s, 3),
                "early": early,
                "healed": rec.healed_ranks,
                **rec.timings,
                "restore": _restored(restored),
            }
        )

    def rewound(self, step: int, back: int, elapsed_s: float, timings: dict[str, float], restored: Any) -> None:
        """Every rank went back to the snapshot of step ``back``: the loop runs again from there."""
        rec = {
            "fault": self._fault(),
            "step": step,
            "rewound_to": back,
            "s": round(elapsed_s, 3),
            **timings,
            "restore": _restored(restored),
        }
        self.records.append(rec)
        self._back = (rec, step, time.monotonic())

    def applied(self, step: int) -> None:
        """A step applied: a rollback's redo ends when its failed step is applied again."""
        if self._back is not None and step >= self._back[1]:
            rec, _, since = self._back
            rec["redo"] = round(time.monotonic() - since, 4)
            self._back = None


def _zero3_engine() -> Any:
    """The DeepSpeed drills' engine: the drill's model in fp32, ZeRO-3, AdamW (torch's), on the
    current world (``rebuild_engine`` builds it again after a rebuild)."""
    import deepspeed

    module = _model().float()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1_000_000,
    }
    return deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)[0]


class _DiskFSDP2:
    """``disk`` for FSDP2: the drill's sharded module and Adam, no ncclguard; checkpoints in DCP
    (``torch.distributed.checkpoint`` with ``get_state_dict``/``set_state_dict``)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.module = _model()
        _shard(self.module, init_device_mesh("cpu", (dist.get_world_size(),)))
        self.opt = torch.optim.Adam(self.module.parameters(), lr=1e-3)

    def step(self, x: Any, y: Any) -> None:
        import torch

        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.module(x), y).backward()
        self.opt.step()

    def save(self, directory: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.opt)
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(directory / f"step{step}"))

    def load(self, directory: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = get_state_dict(self.module, self.opt)  # the layout to load into
        state = {"model": model, "optim": optim}
        dcp.load(state, checkpoint_id=str(directory / f"step{step}"))
        set_state_dict(self.module, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def digest(self) -> str:
        return _digest(self.module)[0]


class _DiskZeRO3:
    """``disk`` for DeepSpeed: the drill's ZeRO-3 engine, no ncclguard; checkpoints with
    ``engine.save_checkpoint`` and ``engine.load_checkpoint`` (DeepSpeed's own format)."""

    def __init__(self) -> None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        self.engine = _zero3_engine()

    def step(self, x: Any, y: Any) -> None:
        import torch

        self.engine.backward(torch.nn.functional.mse_loss(self.engine(x.float()), y.float()))
        self.engine.step()

    def save(self, directory: Path, step: int) -> None:
        self.engine.save_checkpoint(str(directory), tag=f"step{step}")

    def load(self, directory: Path, step: int) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=f"step{step}")
        if path is None:
            raise SystemExit(f"DeepSpeed found no checkpoint step{step} in {directory}")

    def digest(self) -> str:
        import deepspeed
        import torch

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            flat = torch.cat([p.detach().reshape(-1).double() for p in params])
        return hashlib.sha256(flat.numpy()).hexdigest()


def _disk_checkpoint(job: Any, ckpt: Path, step: int, me: int, saves: Any) -> None:
    """Every rank saves the state after ``step`` steps; once every rank's part is written, rank 0
    points ``latest.txt`` at it and keeps the two newest (a kill during a save leaves the one before)."""
    import torch.distributed as dist

    start = time.monotonic()
    job.save(ckpt, step)
    dist.barrier()
    if me == 0:
        _save_text(ckpt / "latest.txt", str(step))
        for old in sorted(ckpt.glob("step*"), key=lambda d: int(d.name[4:]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        saves.write(f"{step} {time.monotonic() - start!r}\n")
        saves.flush()


def _disk_resume(out: Path, launch: int) -> tuple[int, int | None]:
    """Where a launch starts (the step of the newest complete checkpoint, 0 without one) and, after
    a kill, the step that kill interrupted (its victim wrote it)."""
    latest = out / "ckpt" / "latest.txt"
    start = int(latest.read_text()) if latest.exists() else 0
    killed = out / f"fault-{launch - 1}.step"
    return start, int(killed.read_text()) if launch and killed.exists() else None


def rank_disk(args: argparse.Namespace) -> None:
    """A rank of ``disk``: the restart-from-disk baseline of the sharded stacks, without ncclguard.

    The same model, data and steps as ``clean``; a checkpoint in the framework's own format every
    ``--ckpt-every`` steps (DCP for FSDP2, ``engine.save_checkpoint`` for DeepSpeed) under the run's
    own directory. A kill (rank 2, then 1, ... SIGKILLs itself at a step's start) ends the whole job
    as torchrun does (its agent stops every worker), torchrun (``--max-restarts``) starts every rank
    again, and they resume from the newest checkpoint: the steps since it are lost and redone. Rank
    0 notes each launch's stamps (``launch-<n>.json``) for the cost of a kill by part."""
    import torch.distributed as dist

    out, me = Path(args.out), int(os.environ["RANK"])
    launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = out / "ckpt"
    ckpt.mkdir(exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    job = _DiskZeRO3() if args.framework == "deepspeed" else _DiskFSDP2()
    ready_at = time.time()
    start, killed = _disk_resume(out, launch)
    if start:
        job.load(ckpt, start)
    loaded_at = time.time()
    stamps: dict[str, Any] = {"script_at": args.script_at, "ready_at": ready_at, "loaded_at": loaded_at}
    stamps.update(launch=launch, from_step=start, killed_step=killed)
    dist.barrier()  # every rank ready (ranks of a loaded host start seconds apart)
    start_file = out / "t0.txt"
    if me == 0:
        _save_text(out / f"launch-{launch}.json", json.dumps(stamps))
        if not start_file.exists():
            _save_text(start_file, repr(time.time()))
    dist.barrier()
    t0 = float(start_file.read_text())
    faults = Faults("disk", args.every, t0, out, me)
    if launch:
        faults.recovered(loaded_at)
    attempts, saves = (out / "attempts.txt").open("a"), (out / "saves.txt").open("a")
    for step in range(start, args.steps):
        i = faults.take(time.time())  # marked first: the next launch does not repeat it
        if i is not None:
            _save_text(out / f"fault-{i}.step", str(step))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, me)
        time.sleep(args.step_s)  # the step's compute
        job.step(x, y)
        if me == 0:
            attempts.write(f"{step}\n")
            attempts.flush()
            if step == killed:  # the lost steps and the interrupted one are redone
                stamps["redone_at"] = time.time()
                _save_text(out / f"launch-{launch}.json", json.dumps(stamps))
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            _disk_checkpoint(job, ckpt, step + 1, me, saves)
    t1 = time.time()
    digest = job.digest()
    attempts.close()
    faults_n = len(faults.marks())
    # Attempted: every step applied (a redone one again) and the step each kill interrupted.
    attempted = len((out / "attempts.txt").read_text().split()) + faults_n
    record = {"mode": "disk", "steps": args.steps, "committed": args.steps, "attempted": attempted}
    record.update(train_s=t1 - t0, faults=faults_n, restarts=launch, digest=digest)
    _save(out, me, {**record, "world_size": dist.get_world_size(), "ckpt_every": args.ckpt_every})
    _end()


def kill_parts(res: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """The cost of each kill by part, in seconds, from rank 0's records (the engine's timings) and
    the restarted processes' stamps (``joined-*.json``): ``detect`` (the failed attempt and its
    commit: the step's start to every rank knowing), ``rebuild`` (the new world: waiting for the
    restarted process to start and join), ``restore`` (rank 0's part of the restore) and ``rewrap``,
    ``redo`` (the failed step again, and after a rollback the steps since the snapshot);
    ``process_start`` (the kill to the restarted process's first line), ``ready`` (to its imports
    done, its model made: it asks to join), ``joined`` (the kill to it restored), ``fetch`` (on the restarted rank: the holdings agreed and its replica received)."""
    joins = [json.loads(p.read_text()) for p in sorted(out.glob("joined-*.json"))]
    parts = []
    for rec in res.get("recoveries", []):
        mine = [j for j in joins if j.get("fault") == rec.get("fault") and j.get("kill_at") is not None]
        got = [j["restored"] for j in mine if j.get("restored")]
        part = {"fault": rec.get("fault"), "step": rec["step"], "rewound_to": rec.get("rewound_to")}
        part["detect"] = round(rec.get("attempt", 0.0) + rec.get("commit", 0.0), 4)
        part.update({k: rec.get(k) for k in ("rebuild", "rewrap", "redo")}, restore=rec.get("heal"))
        part["process_start"] = max((round(j["script_at"] - j["kill_at"], 3) for j in mine), default=None)
        part["ready"] = max((round(j["stepper_at"] - j["kill_at"], 3) for j in mine), default=None)
        part["joined"] = max((round(j["healed_at"] - j["kill_at"], 3) for j in mine), default=None)
        part["fetch"] = max((round(g.get("agree", 0.0) + g.get("fetch", 0.0), 4) for g in got), default=None)
        part["fetch_bytes"] = sum(g["bytes"] for g in got)
        part["total"] = round(sum(part[k] or 0.0 for k in ("detect", "rebuild", "restore", "rewrap", "redo")), 3)
        parts.append(part)
    return parts


def disk_parts(out: Path) -> dict[str, Any]:
    """The cost of each kill of ``disk`` by part, in seconds, from the victims' marks and each
    launch's stamps: ``relaunch`` (the kill to the new processes' first line: torchrun's agent sees
    the death, stops every worker, starts them all again), ``start`` (imports, the group, the model
    or engine built), ``load`` (the checkpoint), ``redo`` (the steps since the checkpoint, lost,
    and the interrupted one); and what the checkpoints cost (``saves``, their seconds on rank 0)."""
    parts = []
    for n in range(1, 1 + len(list(out.glob("fault-*.done")))):
        path = out / f"launch-{n}.json"
        if not path.exists():
            continue
        stamp = json.loads(path.read_text())
        kill_at = float((out / f"fault-{n - 1}.done").read_text().split()[1])
        part = {"fault": n - 1, "killed_step": stamp["killed_step"], "from_step": stamp["from_step"]}
        part["lost_steps"] = (stamp["killed_step"] or 0) - stamp["from_step"]
        part["relaunch"] = round(stamp["script_at"] - kill_at, 3)
        part["start"] = round(stamp["ready_at"] - stamp["script_at"], 3)
        part["load"] = round(stamp["loaded_at"] - stamp["ready_at"], 3)
        part["redo"] = round(stamp["redone_at"] - stamp["loaded_at"], 3) if "redone_at" in stamp else None
        part["total"] = round(stamp["redone_at"] - kill_at, 3) if "redone_at" in stamp else None
        parts.append(part)
    saves = [float(line.split()[1]) for line in (out / "saves.txt").read_text().split("\n") if line.strip()]
    return {"kills": parts, "saves": len(saves), "save_s": round(sum(saves), 3)}


def _part_line(part: dict[str, Any], names: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {part[k]:.3f}" if isinstance(part.get(k), float) else f"{k} {part.get(k)}" for k in names)


# ------------------------------------------------------------------------------------ the driver


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in [*children]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One torchrun launch of ``mode``; rank 0's result with the launch's wall time."""
    out = root / mode
    out.mkdir(parents=True)
    nproc, every, ckpt_every = _settings(mode, args)
    worker = [
        str(HERE),
        "--rank-mode",
        mode,
        *("--steps", str(args.steps), "--every", str(every), "--step-s", str(args.step_s)),
        *("--stall-s", str(args.stall_s), "--group-timeout", str(args.group_timeout)),
        *("--commit-timeout", str(args.commit_timeout), "--ckpt-every", str(ckpt_every)),
        *("--out", str(out), "--framework", args.framework),
        *(["--defaults"] if args.defaults else []),
        *(["--snapshot-every", str(args.snapshot_every)] if args.snapshot_every is not None else []),
        *(["--params-m", str(args.params_m)] if args.params_m else []),
        *(["--hang-timeout", str(args.hang_timeout)] if args.hang_timeout is not None else []),
    ]
    restarts = ["--max-restarts", "100"] if mode in ("restart", "disk") else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if args.defaults:  # as `ncclguard run --ncclguard-restarts 1` runs each rank
        worker = ["-m", "ncclguard.supervise", "--restarts", "1", "--", sys.executable, *worker]
    elif mode in ("kill", "spare", "host"):  # each rank under its supervisor: the agent never sees it die
        spare = ["--warm-spare"] if mode == "spare" else []
        if mode == "spare" and args.framework == "deepspeed":
            spare += ["--preload=deepspeed"]  # the spare imports what the script does
        if mode == "spare" and args.framework in ("hf", "hf-deepspeed"):
            spare += ["--preload=transformers.trainer"]  # the spare imports what the script does (Trainer is lazy)
        if mode == "spare" and args.framework == "hf-deepspeed":
            spare += ["--preload=deepspeed"]
        worker = ["-m", "ncclguard.supervise", "--restarts", "100", *spare, "--", sys.executable, *worker]
    cmd += ["--monitor-interval=0.1", *restarts, *worker]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.defaults:
        env.update(NCCLGUARD_AUTO="1", NCCLGUARD_WATCHDOG_INCIDENT_DIR=str(out / "incidents"))
    if mode in ("restart", "disk"):
        # torch 2.13's torchrun shares its rendezvous TCPStore server with the workers and keeps it
        # across restarts, with no per-attempt prefix on init_process_group's keys: a restarted
        # worker can read the previous attempt's gloo addresses ("connectFullMesh ... Connection
        # refused", or a 120 s wait in DDP's constructor; pytorch/pytorch#135712). Opting out of the
        # sharing gives each attempt a store of its own: the baseline as a careful user runs it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    start = time.monotonic()
    with (out / "launch.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.launch_timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
            tail = (out / "launch.log").read_text()[-4000:]
            raise SystemExit(f"{mode}: did not finish within {args.launch_timeout} s\n{tail}") from None
    wall = time.monotonic() - start
    if rc != 0 or not (out / "rank0.json").exists():
        tail = (out / "launch.log").read_text()[-4000:]
        raise SystemExit(f"{mode}: torchrun exited {rc}\n{tail}")
    res = json.loads((out / "rank0.json").read_text())
    survivors = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    res["same_digest_on_survivors"] = len({s["digest"] for s in survivors}) == 1
    res["survivors"] = len(survivors)
    res["launch_wall_s"] = round(wall, 2)
    res["steps_per_s"] = res["steps"] / res["train_s"]
    res["efficiency"] = res["committed"] / res["attempted"]
    res["torchrun_rc"] = rc
    res["faults_injected"] = len(list(out.glob("fault-*.done")))  # the victims' marks
    if mode in ("kill", "spare", "host"):  # from the kill to the new process's script, and to its heal
        joins = [json.loads(p.read_text()) for p in sorted(out.glob("joined-*.json"))]
        res["restarts"] = [
            {"script_s": round(j["script_at"] - j["kill_at"], 3), "healed_s": round(j["healed_at"] - j["kill_at"], 3)}
            for j in joins
            if j.get("kill_at") is not None
        ]
    if args.framework in ("fsdp2", "deepspeed"):
        _sharded_results(mode, res, out)
    return res


def _settings(mode: str, args: argparse.Namespace) -> tuple[int, float, int]:
    """A launch's ranks, seconds between faults and steps between checkpoints: ``host`` and
    ``clean4`` run 4 ranks (2 simulated hosts) and lose a host every 120 s unless ``--every`` says;
    ``disk`` checkpoints every 100 steps, the DDP ``restart`` baseline every 50, unless ``--ckpt-every`` says."""
    nproc = 2 * HOST_RANKS if mode in ("host", "clean4") else NPROC
    every = args.every if args.every is not None else 120.0 if mode == "host" else 60.0
    ckpt_every = args.ckpt_every if args.ckpt_every is not None else 100 if mode == "disk" else 50
    return nproc, every, ckpt_every


def _sharded_results(mode: str, res: dict[str, Any], out: Path) -> None:
    """Adds the sharded drills' parts to a launch's result: every rank's snapshot memory (by launch
    rank), and the cost of each kill by part (:func:`kill_parts`, :func:`disk_parts`)."""
    ranks = {p.stem[4:]: json.loads(p.read_text()) for p in out.glob("rank*.json")}
    mem = {r: ranks[r]["memory"] for r in sorted(ranks, key=int) if ranks[r].get("memory") is not None}
    if mem:
        res["memory_per_rank"] = mem
        res["memory_max_bytes"] = max(m["own_bytes"] + m["replica_bytes"] for m in mem.values())
    if mode in ("kill", "spare", "host"):
        res["kill_parts"] = kill_parts(res, out)
    if mode == "disk":
        res["disk_parts"] = disk_parts(out)


def _print_parts(mode: str, r: dict[str, Any]) -> None:
    """Prints the cost of each kill by part and the snapshots' memory per rank (sharded drills)."""
    kill = ("detect", "rebuild", "restore", "rewrap", "redo", "total", "process_start", "ready", "fetch", "fetch_bytes")
    for part in r.get("kill_parts", []):
        print(f"  {mode} kill {part['fault']} at step {part['step']}: {_part_line(part, kill)}", flush=True)
    disk = r.get("disk_parts")
    if disk is not None:
        names = ("lost_steps", "relaunch", "start", "load", "redo", "total")
        for part in disk["kills"]:
            print(f"  disk kill {part['fault']} at step {part['killed_step']}: {_part_line(part, names)}", flush=True)
        print(f"  disk: {disk['saves']} checkpoint(s) saved, {disk['save_s']} s on rank 0", flush=True)
    for rank, m in r.get("memory_per_rank", {}).items():
        print(
            f"  {mode} rank {rank}: snapshots every {m['every']} step(s), own {m['own_bytes']} B, "
            f"replicas {m['replica_bytes']} B (of ranks {sorted(m['replicas'])}); "
            f"{m['takes']} taken, {1000 * m['spent_s'] / max(m['takes'], 1):.2f} ms each paid by the loop",
            flush=True,
        )


def _sharded_summary(ok: dict[str, Any], summary: dict[str, Any]) -> None:
    """The sharded drills' verdicts: ``host`` against the clean 4-rank run (``clean4``), ``disk``
    against ``clean``, and the in-memory heal against the restart from disk."""
    clean, clean4 = ok.get("clean"), ok.get("clean4")
    for mode in ("host", "clean4"):
        if mode in ok and clean4 is not None:
            ok[mode]["throughput_vs_clean"] = ok[mode]["steps_per_s"] / clean4["steps_per_s"]
    if "host" in ok and clean4 is not None:
        summary["host_bit_equal_to_clean4"] = ok["host"]["digest"] == clean4["digest"]
        summary["host_throughput_vs_clean4"] = ok["host"]["throughput_vs_clean"]
    if "disk" in ok and clean is not None:
        summary["disk_bit_equal_to_clean"] = ok["disk"]["digest"] == clean["digest"]
        summary["disk_throughput_vs_clean"] = ok["disk"]["throughput_vs_clean"]
    if "disk" in ok and "kill" in ok:
        summary["kill_vs_disk_throughput"] = ok["kill"]["steps_per_s"] / ok["disk"]["steps_per_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="the CI form: 60 steps, a stall every 6 s, ~1 min")
    p.add_argument("--modes", nargs="+", choices=MODES, help="default: clean stall stuck kill restart")
    p.add_argument(
        "--framework",
        choices=("loop", "hf", "fsdp2", "deepspeed", "hf-deepspeed"),
        default="loop",
        help="loop: RecoveringStep in a plain loop; hf: the HF Trainer with guard_trainer(recover=True); "
        "fsdp2: the loop with FSDP2 and snapshots; deepspeed: a ZeRO-3 loop with snapshots; "
        "hf-deepspeed: the HF Trainer on ZeRO-3 with guard_trainer(recover=True, heal=True)",
    )
    p.add_argument("--steps", type=int, default=800)
    p.add_argument(
        "--defaults",
        action="store_true",
        help="stuck only: no timeout set anywhere, the watchdog as `ncclguard run --ncclguard-restarts 1` starts it",
    )
    p.add_argument("--every", type=float, help="seconds between faults (default 60; 120 for --modes host)")
    p.add_argument("--step-s", type=float, default=0.1, help="each step's compute (a sleep)")
    p.add_argument("--stall-s", type=float, default=3.0, help="a stall; past --group-timeout")
    p.add_argument(
        "--group-timeout",
        type=float,
        default=2.0,
        help="the step bound (collective_timeout; the baseline's group timeout)",
    )
    p.add_argument("--commit-timeout", type=float, default=8.0, help="RecoveringStep's commit and rebuild")
    p.add_argument(
        "--rejoin-timeout", type=float, default=90.0, help="kill: the survivors' rebuild waits this for the restart"
    )
    p.add_argument(
        "--ckpt-every", type=int, help="restart and disk baselines: steps between checkpoints (default 50; disk 100)"
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        help="fsdp2, deepspeed: a snapshot every this many steps (default: the engine's K)",
    )
    p.add_argument("--launch-timeout", type=float, default=1200.0, help="hang guard of each launch")
    p.add_argument(
        "--params-m",
        type=float,
        help="model size in millions of parameters (float64; two square layers hold them); default: the tiny model",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        help=f"the watchdog's hang bound in seconds (default {WATCHDOG['hang_timeout_s']}): at 100M parameters a "
        "snapshot swap or the final all_gather moves 800 MB a rank over gloo and takes longer than that",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workdir", type=Path, help="keep each launch's logs, dumps and results here (default: a temp dir)")
    p.add_argument("--rank-mode", choices=MODES, help=argparse.SUPPRESS)  # a rank of a launch
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    SIZE["params_m"] = args.params_m
    if args.rank_mode is not None:
        args.script_at = time.time()  # a rank's first line (a restarted one's: after its imports)
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        args.mode = args.rank_mode
        if args.mode == "disk":
            rank_disk(args)
        elif args.framework in ("hf", "hf-deepspeed"):
            rank_hf(args)
        elif args.framework == "deepspeed":
            rank_deepspeed(args)
        else:
            (rank_restart if args.mode == "restart" else rank_recovering)(args)
        return 0
    if args.short:
        args.steps, args.every, args.ckpt_every = 60, 6.0, 20
        args.launch_timeout = min(args.launch_timeout, 300.0)
    if args.defaults and set(args.modes or ()) - {"clean", "stuck"}:
        p.error("--defaults runs clean and stuck (--modes clean stuck)")
    if args.stall_s <= args.group_timeout:
        p.error(
            f"--stall-s ({args.stall_s}) must be past --group-timeout ({args.group_timeout}): a stall past the deadline"
        )
    sharded = ["clean", "nosnap", "kill", "spare"]
    default = {
        "hf": ["clean", "stall", "kill", "spare"],
        "fsdp2": sharded,
        "deepspeed": sharded,
        "hf-deepspeed": sharded,
    }.get(args.framework, [m for m in MODES if m != "nosnap" and m not in ("clean4", "host", "disk")])
    modes = args.modes or (["clean", "stall", "restart"] if args.short and args.framework == "loop" else default)
    if args.framework == "hf" and not set(modes) <= {"clean", "stall", "kill", "spare"}:
        p.error("--framework hf runs clean, stall, kill and spare")
    if args.framework == "hf-deepspeed" and not set(modes) <= set(sharded):
        p.error("--framework hf-deepspeed runs clean, nosnap, kill and spare")
    if args.framework in ("fsdp2", "deepspeed") and not set(modes) <= set(SHARDED_MODES):
        p.error(f"--framework {args.framework} runs {', '.join(SHARDED_MODES)}")
    if set(modes) & {"clean4", "host", "disk"} and args.framework not in ("fsdp2", "deepspeed"):
        p.error("clean4, host and disk are drills of --framework fsdp2 or deepspeed")
    if "host" in modes and "clean4" not in modes:
        p.error("the host run (4 ranks) is measured against the clean 4-rank run: add clean4 to --modes")
    if "nosnap" in modes and args.framework not in ("fsdp2", "deepspeed", "hf-deepspeed"):
        p.error("nosnap is the clean run without snapshots of --framework fsdp2, deepspeed or hf-deepspeed")
    if "stall" in modes and "clean" not in modes:
        p.error("the stall run is checked against the clean run: add clean to --modes")
    load0 = os.getloadavg()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ncclguard-drill-") as tmp:
        root = Path(tmp) if args.workdir is None else args.workdir
        for mode in modes:
            try:
                runs[mode] = launch(mode, args, root)
            except SystemExit as exc:  # one failed launch is a result, not the end of the drill
                runs[mode] = {"status": f"failed: {str(exc)[:3000]}"}
                print(f"{mode}: FAILED: {str(exc)[:600]}", flush=True)
                continue
            r = runs[mode]
            print(
                f"{mode}: {r['steps_per_s']:.2f} steps/s, efficiency {r['efficiency']:.3f} "
                f"({r['committed']}/{r['attempted']}), {r['faults_injected']} fault(s) injected, wall {r['launch_wall_s']} s",
                flush=True,
            )
            _print_parts(mode, r)
    clean = runs.get("clean")
    summary: dict[str, Any] = {}
    for mode, r in runs.items():
        if "steps_per_s" in r and clean is not None and mode not in ("host", "clean4"):
            r["throughput_vs_clean"] = r["steps_per_s"] / clean["steps_per_s"]
    ok = {m: r for m, r in runs.items() if "steps_per_s" in r}
    clean = ok.get("clean")
    if "stall" in ok and clean is not None:
        summary["stall_bit_equal_to_clean"] = runs["stall"]["digest"] == clean["digest"]
    if "nosnap" in ok and clean is not None:  # snapshots on (clean) against off (nosnap), one sitting
        summary["snapshot_cost_share"] = ok["nosnap"]["steps_per_s"] / clean["steps_per_s"] - 1
    for mode in ("kill", "spare", "nosnap"):
        if mode in ok and clean is not None:
            summary[f"{mode}_bit_equal_to_clean"] = runs[mode]["digest"] == clean["digest"]
    if "stall" in ok and "restart" in ok:
        summary["stall_vs_restart_throughput"] = runs["stall"]["steps_per_s"] / runs["restart"]["steps_per_s"]
    _sharded_summary(ok, summary)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: v for k, v in vars(args).items() if k not in ("rank_mode", "out", "json", "workdir")},
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "runs": runs,
        "summary": summary,
    }
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
