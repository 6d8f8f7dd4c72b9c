"""Rank side of tests/integrations/test_hf_recover_multirank.py: steps redone on a rebuilt world, 3 gloo ranks.

The process group is the one ``TrainingArguments`` makes, with HF's defaults (``ddp_timeout``
1,800 s, never lowered by hand): the step bound of 3 s is ncclguard's own ``collective_timeout``.
One torchrun launch, in order (the world's generation grows across the parts):

A. HF Trainer, ``guard_trainer(recover=True)``, a tiny BERT (from a config), 2 micro-batches per
   optimizer step. A fault-free run, then the same run from the same seed where rank 2 stalls in
   step K's first micro-batch until ranks 0-1 have failed (their DDP collective ran past the 3 s
   step bound): every rank redoes step K in generation 1.
B. An Accelerate loop through ``recovering_step``: a fault-free run, then rank 2 stalls the same
   way at step K: every rank redoes it in generation 2.
C. HF Trainer, ``recover=True, allow_shrink=True``, the watchdog reporting only
   (``action="report"``): rank 2 sleeps for good at the start of step K. Ranks 0-1 fail the step
   at the bound, go on as a world of 2 (generation 3) and re-shard the data at the next epoch.
   Rank 2 never returns: the left-behind fence the engine arms ends it with status 0, so the job
   ends.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from accelerate import Accelerator
from hf_parts import Dataset, tiny_bert  # the HF tests' tiny dataset and model
from rankkit import put
from transformers import Trainer, TrainerCallback, TrainingArguments

from ncclguard.collectives.groups import group_timeout_s
from ncclguard.integrations.accelerate import recovering_step
from ncclguard.integrations.hf import find_guard, guard_trainer
from ncclguard.recovery import generation

OUT = os.environ["NCCLGUARD_TEST_OUT"]
BOUND_STEP_S = 3.0  # collective_timeout: a collective inside a step waits this long at most
K = 2  # the step that fails
BOUND_S = 120.0  # how long a stalled rank waits at most for the event that ends its stall
ME = int(os.environ["RANK"])  # the launch rank: a rebuild renumbers, faults go by this one


class Announcer(logging.Handler):
    """Marks in the job's store that this rank's step failed (ncclguard logs it), for the stalled rank."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = ""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.tag and " raised on this rank (" in text:  # the recovery engine logs a failed step so
            rankkit.announce(f"{self.tag}-failed-{ME}")


ANNOUNCER = Announcer()


def wait_for_peers_to_fail(tag: str) -> None:
    for r in (0, 1):
        rankkit.wait_for(f"{tag}-failed-{r}", timeout_s=BOUND_S)


class Probe(TrainerCallback):
    """What each step saw: the world, the sampler's shard, the samples (their first token)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.steps: list[dict[str, Any]] = []

    def on_step_begin(self, args, state, control, **kw):
        bs = kw["train_dataloader"].batch_sampler
        self.steps.append(
            {
                "step": state.global_step,
                "world": [dist.get_rank(), dist.get_world_size()],
                "accelerate": [self.trainer.accelerator.process_index, self.trainer.accelerator.num_processes],
                "args_world_size": args.world_size,
                "shard": [bs.process_index, bs.num_processes],
            }
        )


def aligned() -> None:
    """Meets the other ranks (the ranks leave train() at their own times)."""
    dist.barrier()


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def equal_across_ranks(module: torch.nn.Module) -> bool:
    aligned()
    mine = flat(module)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone)


def trainer(name: str, n: int, max_steps: int, accumulation: int, stall: Any = None, **guard: Any) -> Trainer:
    torch.manual_seed(0)
    model = tiny_bert()
    if stall is not None:
        model.register_forward_pre_hook(stall)
    args = TrainingArguments(
        output_dir=f"{OUT}/{name}",
        use_cpu=True,
        ddp_backend="gloo",
        learning_rate=1e-3,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    probe = Probe()
    t = Trainer(model=model, args=args, train_dataset=Dataset(n, seed=n), callbacks=[probe])
    probe.trainer = t
    guard_trainer(t, recover=True, collective_timeout=BOUND_STEP_S, **{"watchdog": False, **guard})
    return t


def part_a() -> None:
    ANNOUNCER.tag = "a"
    options = {"commit_timeout": 30, "rebuild_timeout": 30}
    ref = trainer("a-ref", 96, 5, 2, **options)
    ref.train()
    stalled: list[float] = []

    def stall(module, args) -> None:
        t = trainer_a
        if ME == 2 and t.state.global_step == K and not stalled and module.training:
            rankkit.fault_fired(f"part A: stall at step {K}")
            stalled.append(time.time())
            wait_for_peers_to_fail("a")  # past the group timeout: they gave up on rank 2

    trainer_a = trainer("a", 96, 5, 2, stall=stall, **options)
    aligned()  # the fault-free run's end
    trainer_a.train()
    guard = find_guard(trainer_a)
    put(
        "a",
        {
            "global_step": trainer_a.state.global_step,
            "generation": generation(),
            "world": [dist.get_rank(), dist.get_world_size()],
            "recoveries": recoveries(guard.recovery.recoveries),
            "log_history": trainer_a.state.log_history,
            "ref_log_history": ref.state.log_history,
            "equal_across_ranks": equal_across_ranks(trainer_a.model),
            "equal_to_reference": torch.equal(flat(trainer_a.model), flat(ref.model)),
            "stalled": len(stalled),
        },
    )


def part_b() -> None:
    ANNOUNCER.tag = "b"
    accelerator = Accelerator(cpu=True)

    def run(stall: bool, base: int) -> tuple[torch.nn.Module, list[list[Any]], Any]:
        torch.manual_seed(7)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)).double()
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        model, opt = accelerator.prepare(module, opt)
        stepper = recovering_step(
            accelerator, model, opt, collective_timeout=BOUND_STEP_S, commit_timeout=30, rebuild_timeout=30
        )
        results = []
        for step in range(5):
            g = torch.Generator().manual_seed(1000 * step + ME)
            x, y = (
                torch.randn(6, 4, generator=g, dtype=torch.float64),
                torch.randn(6, 1, generator=g, dtype=torch.float64),
            )
            tries: list[int] = []

            def step_fn(m, step=step, x=x, y=y, tries=tries) -> float:
                tries.append(dist.get_world_size())
                if stall and step == K and len(tries) == 1 and ME == 2:
                    rankkit.fault_fired(f"part B: stall at step {K}")
                    wait_for_peers_to_fail("b")
                loss = torch.nn.functional.mse_loss(m(x), y)
                accelerator.backward(loss)
                return float(loss.detach())

            res = stepper(step_fn, step=base + step)  # the loop's step grows across both runs
            results.append([res.ok, res.attempts, res.generation, [[c.ok, c.failed_ranks] for c in res.commits]])
        return module, results, stepper

    ref, ref_results, _ = run(stall=False, base=0)
    module, results, stepper = run(stall=True, base=5)
    put(
        "b",
        {
            "ref_results": ref_results,
            "results": results,
            "recoveries": recoveries(stepper.recoveries),
            "equal_across_ranks": equal_across_ranks(module),
            "equal_to_reference": torch.equal(flat(module), flat(ref)),
            "accelerate": [accelerator.process_index, accelerator.num_processes],
        },
    )


class StuckForGood(TrainerCallback):
    """Rank 2 sleeps for good at the start of step K (its main thread never comes back)."""

    def on_step_begin(self, args, state, control, **kw):
        if ME == 2 and state.global_step == K:
            rankkit.fault_fired(f"part C: asleep for good at step {K}")
            rankkit.save()  # parts A and B
            while True:
                time.sleep(1.0)


def part_c() -> None:
    ANNOUNCER.tag = ""
    # 48 samples, batches of 4 on 3 ranks: 4 steps an epoch; 7 steps cross into a second epoch.
    watchdog = {"action": "report", "heartbeat_s": 0.5, "hang_timeout_s": 3, "escalate_after_s": 4}
    # The survivors wait out both timeouts for rank 2, so each costs its length. The rebuild's also
    # bounds the new group's handshake after a shrink: rebuild_world gives every member
    # max(time left, rebuild_timeout / 4, 2 s), and a shrink leaves no time, so
    # the 4 s this was gave rank 1 the 2 s floor. Under load (4 CPU burners on 2 cores) the
    # handshake took up to 0.9 s, and a rank 0 that came 2.5 s late (a delay injected before its
    # init_process_group) made rank 1 fail with "the new group of generation 1 could not be built
    # within 2 s", the message of a loaded fresh clone's failure. 24 s gives 6 s: 3x a 2 s stall.
    trainer_c = trainer("c", 48, 7, 1, allow_shrink=True, commit_timeout=6, rebuild_timeout=24, watchdog=watchdog)
    trainer_c.add_callback(StuckForGood())
    probe = next(cb for cb in trainer_c.callback_handler.callbacks if isinstance(cb, Probe))
    trainer_c.train()  # rank 2 never leaves it
    guard = find_guard(trainer_c)
    put(
        "c",
        {
            "global_step": trainer_c.state.global_step,
            "generation": generation(),
            "world": [dist.get_rank(), dist.get_world_size()],
            "recoveries": recoveries(guard.recovery.recoveries),
            "log_history": trainer_c.state.log_history,
            "equal_across_ranks": equal_across_ranks(trainer_c.model),
            "steps": probe.steps,
        },
    )


def recoveries(found: list[Any]) -> list[dict[str, Any]]:
    return [{"step": r.step, **r.metrics()} for r in found]


def main() -> None:
    rankkit.rank = lambda: ME  # results files and faults go by launch rank
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("ncclguard").addHandler(ANNOUNCER)
    for part in sys.argv[1:]:
        {"a": part_a, "b": part_b, "c": part_c}[part]()
        # The group TrainingArguments made, with HF's default ddp_timeout: never lowered by hand.
        put("group_timeout_s", group_timeout_s())
        rankkit.save()
    rankkit.done()


if __name__ == "__main__":
    main()
