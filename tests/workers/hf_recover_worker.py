"""Rank side of tests/test_hf_recover_multirank.py: steps redone on a rebuilt world, 3 gloo ranks.

One torchrun launch, in order (the world's generation grows across the parts):

A. HF Trainer, ``guard_trainer(recover=True)``, a tiny BERT (from a config), 2 micro-batches per
   optimizer step. A fault-free run, then the same run from the same seed where rank 2 stalls in
   step K's first micro-batch until ranks 0-1 have failed (their DDP collective ran past the 3 s
   group timeout): every rank redoes step K in generation 1.
B. An Accelerate loop through ``recovering_step``: a fault-free run, then rank 2 stalls the same
   way at step K: every rank redoes it in generation 2.
C. HF Trainer, ``recover=True, allow_shrink=True``: rank 2 is stuck at step K until ranks 0-1 are
   done; they go on as a world of 2 (generation 3), re-sharding the data at the next epoch. Rank 2
   comes back to find itself left out (RebuildFailed out of ``trainer.train()``) and exits 0.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from accelerate import Accelerator
from hf_worker import Dataset, tiny_bert  # the HF tests' tiny dataset and model
from rankkit import put
from transformers import Trainer, TrainerCallback, TrainingArguments

from ncclguard import _torch_compat as compat
from ncclguard.collectives.groups import group_timeout_s
from ncclguard.errors import RebuildFailed
from ncclguard.integrations.accelerate import recovering_step
from ncclguard.integrations.hf import find_guard, guard_trainer
from ncclguard.recovery import generation

OUT = os.environ["NCCLGUARD_TEST_OUT"]
GROUP_TIMEOUT_S = 3.0
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
        if self.tag and ("training step at global step" in text or "the step raised on this rank" in text):
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
    """Meets the other ranks with a long timeout, then gives the group its short one.

    Building a Trainer or an Accelerator takes each rank its own time on a loaded machine; the
    first collective after it (DDP's broadcast of the parameters) must not be the one that times
    out. The faults come later, inside training steps."""
    compat.set_group_timeout(compat.default_group(), timedelta(seconds=120))
    dist.barrier()
    compat.set_group_timeout(compat.default_group(), timedelta(seconds=GROUP_TIMEOUT_S))


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def equal_across_ranks(module: torch.nn.Module) -> bool:
    aligned()  # the ranks leave train() at their own times
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
    guard_trainer(t, watchdog=False, recover=True, **guard)
    return t


def part_a() -> None:
    ANNOUNCER.tag = "a"
    options = {"commit_timeout": 30, "rebuild_timeout": 30}
    ref = trainer("a-ref", 96, 5, 2, **options)
    aligned()
    ref.train()
    stalled: list[float] = []

    def stall(module, args) -> None:
        t = trainer_a
        if ME == 2 and t.state.global_step == K and not stalled and module.training:
            stalled.append(time.time())
            wait_for_peers_to_fail("a")  # past the group timeout: they gave up on rank 2

    trainer_a = trainer("a", 96, 5, 2, stall=stall, **options)
    aligned()
    trainer_a.train()
    guard = find_guard(trainer_a)
    put(
        "a",
        {
            "global_step": trainer_a.state.global_step,
            "generation": generation(),
            "world": [dist.get_rank(), dist.get_world_size()],
            "recoveries": guard.recovery.recoveries,
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
        aligned()
        model, opt = accelerator.prepare(module, opt)
        stepper = recovering_step(accelerator, model, opt, commit_timeout=30, rebuild_timeout=30)
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
            "recoveries": stepper.recoveries,
            "equal_across_ranks": equal_across_ranks(module),
            "equal_to_reference": torch.equal(flat(module), flat(ref)),
            "accelerate": [accelerator.process_index, accelerator.num_processes],
        },
    )


def part_c() -> None:
    ANNOUNCER.tag = ""
    stuck: list[bool] = []

    def stall(module, args) -> None:
        if ME == 2 and trainer_c.state.global_step == K and not stuck and module.training:
            store, deadline = rankkit._job_store(), time.monotonic() + BOUND_S
            keys = ["rankkit/c-done-0", "rankkit/c-done-1"]
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.2)
            stuck.append(store.check(keys))

    # 48 samples, batches of 4 on 3 ranks: 4 steps an epoch; 7 steps cross into a second epoch.
    trainer_c = trainer("c", 48, 7, 1, stall=stall, allow_shrink=True, commit_timeout=3, rebuild_timeout=4)
    probe = next(cb for cb in trainer_c.callback_handler.callbacks if isinstance(cb, Probe))
    aligned()
    try:
        trainer_c.train()
    except RebuildFailed as exc:
        put("c", {"left_out": True, "late": exc.late, "woke_after_survivors": stuck, "steps": probe.steps})
        rankkit.done()
    guard = find_guard(trainer_c)
    put(
        "c",
        {
            "left_out": False,
            "global_step": trainer_c.state.global_step,
            "generation": generation(),
            "world": [dist.get_rank(), dist.get_world_size()],
            "recoveries": guard.recovery.recoveries,
            "log_history": trainer_c.state.log_history,
            "equal_across_ranks": equal_across_ranks(trainer_c.model),
            "steps": probe.steps,
        },
    )
    rankkit.save()
    rankkit.announce(f"c-done-{ME}")


def main() -> None:
    rankkit.rank = lambda: ME  # results files and faults go by launch rank
    # The join waits for every rank's imports (long on a loaded machine); the collectives then get
    # the short timeout, read back from the live group below (the Trainer's Accelerate uses it).
    rankkit.init(timeout_s=120)
    aligned()
    logging.getLogger("ncclguard").addHandler(ANNOUNCER)
    put("group_timeout_s", group_timeout_s())
    for part in sys.argv[1:]:
        {"a": part_a, "b": part_b, "c": part_c}[part]()
        rankkit.save()
    rankkit.done()


if __name__ == "__main__":
    main()
