"""Rank side of tests/recovery/test_seeds_multirank.py: 3 gloo ranks, each under ``python -m
ncclguard.supervise --restarts=1`` (so that ``heal`` is on by default, as under ``ncclguard run
--ncclguard-restarts 1``). Usage: seeds_worker.py.

A loop as users write it: the process group first, ncclguard after; a BERT classifier
(``transformers.BertConfig``, hidden 64, 2 layers, vocabulary 4,000, its default dropout of 0.1),
AdamW, a linear schedule with warm-up passed as ``scheduler=``, shuffled data
(``DistributedSampler(shuffle=True)``), ``RecoveringStep`` building the DDP wrapper. Three parts, one
after the other in the same world:

``together``: one seed on every rank (``transformers.set_seed(7)``), ``heal=True``: 3 steps, each
    committed at its first attempt, no rebuild, nothing said of the generators.
``default``: a seed per rank (``transformers.set_seed(7 + rank)``), ``heal`` left to its default (on
    under the supervisor): 3 steps, all committed; the generators found apart said once, at error level.
``apart``: a seed per rank, ``heal=True``: the first step raises GeneratorsApart on every rank before
    it is applied (the parameters as they were).
"""

from __future__ import annotations

import hashlib
import logging
import sys
from datetime import timedelta
from typing import Any

import rankkit
import torch
import torch.distributed as dist
import transformers
from rankkit import put
from torch.utils.data import DistributedSampler, TensorDataset

STEPS, WARMUP, BATCH, SEQ, SAMPLES = 3, 1, 4, 16, 48


class Lines(logging.Handler):
    """ncclguard's lines at error level and above, kept for the test."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    transformers.set_seed(seed)  # random, NumPy and torch, as the HF examples seed
    config = transformers.BertConfig(
        vocab_size=4_000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    module = transformers.BertForSequenceClassification(config)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    return module, opt, transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    data = TensorDataset(
        torch.randint(0, 4_000, (SAMPLES, SEQ), generator=g), torch.randint(0, 2, (SAMPLES,), generator=g)
    )
    sampler = DistributedSampler(data, shuffle=True, seed=17)
    order = list(sampler)
    return [data[order[i * BATCH : (i + 1) * BATCH]] for i in range(STEPS)]


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def part(name: str, first: int, seed: int, lines: Lines, **heal: Any) -> None:
    from ncclguard import RecoveringStep
    from ncclguard.errors import GeneratorsApart

    module, opt, schedule = make(seed)
    stepper = RecoveringStep(module, opt, scheduler=schedule, commit_timeout=60.0, **heal)
    before, said = digest(module), len(lines.lines)
    results: list[dict[str, Any]] = []
    raised = None
    for step, (ids, labels) in enumerate(batches(), start=first):  # should_commit's step= grows in a world

        def step_fn(model: torch.nn.Module, ids: torch.Tensor = ids, labels: torch.Tensor = labels) -> None:
            model(input_ids=ids, labels=labels).loss.backward()

        try:
            res = stepper(step_fn, step=step)
        except GeneratorsApart as exc:
            raised = {"type": type(exc).__name__, "text": str(exc), "step": step}
            break
        results.append({"ok": bool(res), "attempts": res.attempts, "generation": res.generation})
        schedule.step()
    put(
        name,
        {
            "heal": stepper.engine.options.heal,
            "results": results,
            "raised": raised,
            "lines": [t for t in lines.lines[said:] if "generators" in t],
            "unchanged": digest(module) == before,
        },
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the group first, as users write it
    import ncclguard  # after the group, as users write it

    lines = Lines()
    logging.getLogger("ncclguard").addHandler(lines)
    me = dist.get_rank()
    part("together", 0, 7, lines, heal=True)
    part("default", 10, 7 + me, lines)
    part("apart", 20, 7 + me, lines, heal=True)
    put("final", [me, dist.get_world_size(), ncclguard.recovery.generation()])
    dist.barrier()  # rank 0 hosts the store: every rank has read the last outcome
    rankkit.done()


if __name__ == "__main__":
    main()
