"""Rank side of tests/recovery/test_recovering_multirank.py (and of the NCCL stand-in's
tests/recovery/test_nccl_stand_in_multirank.py). Usage: recovering_worker.py SCENARIO [SCENARIO ...].

``stall``, ``handshake`` and ``fsdp2`` (torchrun, 3 ranks) run one after another in one launch, in
the order given, on the same process group: the world's generation grows across them (each redone
step is on a later generation than the scenario before left it), the loop's step numbers grow across
every run, and each scenario's results are saved under its own name. ``stall`` and ``handshake``
compare with one fault-free DDP run of STEPS steps, made once, before the first of them.

``stall``: after that fault-free run, the same run from the same start through RecoveringStep with
rank 2 stalled past the step bound at step K: every rank redoes step K in the next generation, and
the parameters end bit-equal to the fault-free run's.

``handshake``: ``stall``'s fault-free run, then rank 2 raising in step K's first attempt and rank 1's
handshake into the rebuilt world failing once: no rank commits alone, every rank rebuilds again, and
step K is redone two generations on, bit-equal to the fault-free run.

``fsdp2``: ``stall`` with the module sharded by FSDP2 (``ncclguard.FSDP2``, each Linear then the
root) and Adam, its own fault-free run first: step K is redone on a world whose module was sharded
again from each rank's shards; the full parameters and Adam's state end bit-equal to the fault-free run.

``shrink`` (torchrun, 3 ranks, alone in its launch: rank 2 ends in it): rank 2 is stuck for good at
step K (it sleeps until the survivors are done, then finds itself left out and exits 0); ranks 0-1
go on in a world of 2.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

from ncclguard import FSDP2, RecoveringStep
from ncclguard.recording.ddp import record_ddp
from ncclguard.recording.flight import recorder
from ncclguard.recovery.records import StepResult
from ncclguard.world import WorldChange, subscribe

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults go by launch rank

# The deadline of DDP's gradient all_reduce: RecoveringStep's collective_timeout (the group keeps 60 s).
STEP_BOUND_S = 6.0
STALL_S = 10.0  # past it
STEPS, K = 5, 2


def make_module() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def batch(step: int, launch_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + launch_rank)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [t.detach().reshape(-1) for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    )


def summary(res: StepResult) -> dict[str, Any]:
    return {
        "ok": res.ok,
        "attempts": res.attempts,
        "generation": res.generation,
        "rebuilds": res.rebuilds,
        "commits": [[c.ok, c.failed_ranks] for c in res.commits],
        "error": type(res.error).__name__ if res.error is not None else None,
    }


def event_of(change: WorldChange) -> dict[str, Any]:
    # "left_out": the rebuild's error says late; the world this rank stays in is its generation.
    return {"step": change.step, "late": getattr(change.error, "late", None), "generation": change.new.generation}


def shard_layers(module: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def recorded_ddp(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(module)
    record_ddp(model)  # DDP's bucket all-reduces in the flight recorder
    return model


def train(
    stall_at: int | None,
    stall: Any = None,
    base: int = 0,
    shrink: bool = False,
    fsdp2: bool = False,
    wait_s: float | None = None,
) -> tuple[RecoveringStep, list[dict[str, Any]]]:
    module = make_module()
    # The commit waits for the stalled rank (10 s, then its own failure). One stuck for good (shrink)
    # is given up at the commit's 8 s, and the rebuild waits 20 s for it before going on without it.
    commit_s, rebuild_s = (8.0, 20.0) if shrink else (60.0, 60.0)
    if wait_s is not None:
        commit_s = rebuild_s = wait_s
    opt: torch.optim.Optimizer
    if fsdp2:
        opt = torch.optim.Adam(module.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    stepper = RecoveringStep(
        module,
        opt,
        wrap=FSDP2(shard_layers) if fsdp2 else (recorded_ddp if shrink else None),
        collective_timeout=STEP_BOUND_S,
        commit_timeout=commit_s,
        rebuild_timeout=rebuild_s,
        allow_shrink=shrink,
    )
    me = int(os.environ["RANK"])
    results: list[dict[str, Any]] = []

    def left_out(change: WorldChange) -> None:  # the engine exits this rank (status 0) right after
        put("results", [*results, {"left_out": True, "error": type(change.error).__name__, **event_of(change)}])
        rankkit.save()

    # The world's one hook, for this run only (a process trains more than once: references, then runs).
    unsubscribe = subscribe(left_out, kinds=("left_out",))
    try:
        _steps(stepper, results, me, stall_at, stall, base)
    finally:
        unsubscribe()
    return stepper, results


def _steps(
    stepper: RecoveringStep, results: list[dict[str, Any]], me: int, stall_at: int | None, stall: Any, base: int
) -> None:
    for step in range(STEPS):
        x, y = batch(step, me)
        tries = []

        def step_fn(
            model: torch.nn.Module, step: int = step, x: torch.Tensor = x, y: torch.Tensor = y, tries: list[int] = tries
        ) -> float:
            tries.append(dist.get_world_size())
            if step == stall_at and len(tries) == 1 and stall is not None:
                stall()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return float(loss.detach())

        res = stepper(step_fn, step=base + step)  # the loop's step, growing across both runs
        results.append({**summary(res), "world_sizes": tries})
        if not res:
            break


def full_state(stepper: RecoveringStep) -> torch.Tensor:
    """FSDP2: the full parameters and Adam's full state, gathered over the current world."""
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    tensors = [full(p.detach()) for p in stepper.model.parameters()]
    for p in stepper.model.parameters():
        held = stepper.optimizer.state[p]
        tensors += [full(held["exp_avg"]), full(held["exp_avg_sq"]), held["step"]]
    return torch.cat([t.reshape(-1).double() for t in tensors])


def fsdp2_refusals() -> list[str]:
    """What FSDP2 refuses, before any communication: a module sharded already, a stepped optimizer."""
    said = []
    sharded = make_module()
    shard_layers(sharded, None)  # fully_shard's default mesh: the whole world
    stepped = make_module()
    opt = torch.optim.Adam(stepped.parameters())
    stepped(torch.zeros(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    for module, optimizer in ((sharded, torch.optim.Adam(sharded.parameters())), (stepped, opt)):
        try:
            RecoveringStep(module, optimizer, wrap=FSDP2(shard_layers))
        except RuntimeError as exc:
            said.append(str(exc))
    return said


class Launch:
    """What the scenarios of one launch share: the loop's step number, growing across every run (a
    commit's step must grow), and the fault-free DDP run that ``stall`` and ``handshake`` compare with."""

    def __init__(self) -> None:
        self.steps_run = 0
        self._ddp: tuple[list[dict[str, Any]], torch.Tensor] | None = None

    def base(self) -> int:
        """The first loop step of the next run of STEPS steps."""
        self.steps_run += STEPS
        return self.steps_run - STEPS

    def ddp_reference(self) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """The fault-free DDP run's step results and final parameters, run at the first call only."""
        if self._ddp is None:
            reference, ref_results = train(stall_at=None, base=self.base())
            self._ddp = ref_results, flat(reference.module)
        return self._ddp


def stall(launch: Launch, fsdp2: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reference_model = None
    if fsdp2:
        out["refusals"] = fsdp2_refusals()
        reference, ref_results = train(stall_at=None, base=launch.base(), fsdp2=True)
        # Read now: the reference's FSDP2 shards are gathered over this world's group, gone after a rebuild.
        theirs, reference_model = full_state(reference), reference.model
        del reference
    else:
        ref_results, theirs = launch.ddp_reference()
    out["reference_results"] = ref_results
    t0 = time.monotonic()
    stepper, results = train(stall_at=K, stall=lambda: rankkit.stall(2, STALL_S), base=launch.base(), fsdp2=fsdp2)
    out["results"] = results
    out["faulty_s"] = time.monotonic() - t0
    bound = stepper.engine.bound  # how the step bound acted: gloo lowers timeouts, NCCL's rules abort
    out["step_bound"] = {"aborted": bound.aborted, "lowered": bound.lowered}
    if fsdp2:
        mine = full_state(stepper)
        out["module_is_new"] = stepper.model is not reference_model and stepper.module is stepper.model
        out["sharded"] = sorted({type(p).__name__ for p in stepper.model.parameters()})
    else:
        mine = flat(stepper.module)
    del reference_model
    return {**out, **compare(mine, theirs)}


def compare(mine: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    """This rank's state against the fault-free run's and every rank's, and where it ended."""
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {
        "equal_to_reference": torch.equal(mine, theirs),
        "equal_across_ranks": all(torch.equal(everyone[0], t) for t in everyone),
        "final": [dist.get_rank(), dist.get_world_size()],
    }


def shrink() -> None:
    rankkit.init(timeout_s=60)
    me = int(os.environ["RANK"])

    def stuck() -> None:
        if me == 2:  # stuck for good, as far as the others can tell: until they are done
            rankkit.fault_fired("stuck until the survivors are done")
            store, deadline = rankkit._job_store(), time.monotonic() + 300
            while time.monotonic() < deadline and not store.check(
                ["rankkit/survivors-done-0", "rankkit/survivors-done-1"]
            ):
                time.sleep(0.2)
            put("woke_after_survivors", store.check(["rankkit/survivors-done-0", "rankkit/survivors-done-1"]))

    stepper, results = train(stall_at=K, stall=stuck, shrink=True)
    put("results", results)
    if me != 2:
        mine = flat(stepper.module)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        put("equal_across_ranks", all(torch.equal(everyone[0], t) for t in everyone))
        put("final", [dist.get_rank(), dist.get_world_size()])
        # The recorder keeps generation 1's records: the redone step 2, then steps 3 and 4.
        put("ddp_records", [[r.site, r.state, r.async_op] for r in recorder.records()])
        put("ddp_inflight", len(recorder.inflight()))
        # A single-process reference: steps before K average 3 ranks' gradients, from K on 2 ranks'.
        put("max_diff_to_reference", float((mine - reference_shrunk()).abs().max()))
        rankkit.save()
        rankkit.announce(f"survivors-done-{me}")
    rankkit.done()


def handshake(launch: Launch) -> dict[str, Any]:
    me = int(os.environ["RANK"])
    ref_results, theirs = launch.ddp_reference()
    from ncclguard.recovery._rebuild import stand_in

    real = stand_in.torch_init_process_group

    def fails_once(*args: Any, **kwargs: Any) -> None:
        stand_in.torch_init_process_group = real  # type: ignore[assignment]
        raise RuntimeError("injected: this rank's handshake failed")

    def fault() -> None:  # step K's first attempt: rank 2 raises, rank 1's next handshake fails
        if me in (1, 2):
            rankkit.fault_fired("a failed handshake next" if me == 1 else "raise in step K")
        if me == 1:
            stand_in.torch_init_process_group = fails_once  # type: ignore[assignment]
        if me == 2:
            raise RuntimeError("injected: step K failed on rank 2")

    # 10 s to meet and shake hands: the ranks whose handshake waits on rank 1 give up after about 10 s.
    stepper, results = train(stall_at=K, stall=fault, base=launch.base(), wait_s=10)
    return {"reference_results": ref_results, "results": results, **compare(flat(stepper.module), theirs)}


def reference_shrunk() -> torch.Tensor:
    """One process: steps before K average 3 ranks' losses, from K on ranks 0-1's (as DDP does)."""
    module = make_module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        ranks = range(3) if step < K else range(2)
        loss = sum(torch.nn.functional.mse_loss(module(batch(step, k)[0]), batch(step, k)[1]) for k in ranks)
        (loss / len(ranks)).backward()
        opt.step()
    return flat(module)


PARTS = {"stall": stall, "handshake": handshake, "fsdp2": lambda launch: stall(launch, fsdp2=True)}


def main(scenarios: list[str]) -> None:
    if scenarios == ["shrink"]:  # rank 2 ends in it: a launch of its own
        shrink()  # every rank ends in it
        return
    unknown = [s for s in scenarios if s not in PARTS]
    if unknown or not scenarios:
        raise SystemExit(f"recovering_worker.py: unknown scenarios {unknown} (shrink alone, or of {sorted(PARTS)})")
    rankkit.init(timeout_s=60)
    launch = Launch()
    for name in scenarios:
        put(name, PARTS[name](launch))
        dist.barrier()  # the ranks leave a scenario together, and the next starts on the world it left
        rankkit.save()
    rankkit.done()


if __name__ == "__main__":
    main(sys.argv[1:])
