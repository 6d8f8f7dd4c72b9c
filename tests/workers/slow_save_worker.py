"""Rank side of tests/watching/test_slow_save_multirank.py. Usage: slow_save_worker.py MOUNT.

Launched as ``ncclguard run --ncclguard-restarts 1`` does it (each rank under its supervisor,
``NCCLGUARD_AUTO=1``: the watchdog with every default) and nothing else set. The script as a user
writes it: ``dist.init_process_group("gloo")`` first, ncclguard imported after; a BERT classifier of
2.05M parameters (tests/workers/ddp_bitequal_worker.py's, its default dropout), AdamW, a warm-up
schedule, shuffled data from the step number, ``RecoveringStep(module, opt, scheduler=schedule)``.

WARM healthy steps (the judge bound learned: its 10 s floor), then in step SAVE launch rank 0 saves a
checkpoint inside its step function, before its forward and backward: ``torch.save`` of the model's
and the optimizer's state dicts (about 25 MiB) to ``MOUNT/ckpt.pt``, a FUSE mount whose writes take
their time and whose flush (the ``close()``) waits long past the judge bound and the still window
(tests/fusefs.py). Ranks 1-2 wait for it in the step's DDP all_reduce. torch's file writer closes
the file holding the GIL: rank 0's other threads (its watchdog's heartbeats) stop for as long as the
close, and only its ``/proc`` (the thread in ``close()`` on the mount) tells its peers it is busy.

Each rank saves its steps, its verdict events, the judge bound at the save, its parameters' digest
and its world at the end; rank 0 the save's times, the file's size and :func:`state_digest` of what
it saved. A restarted process (none expected) would save under its launch rank plus 10.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

WARM = SAVE = 12  # past the judge bound's warm-up (10 intervals): its 10 s floor
STEPS = 15
SAVER = 0


def state_digest(obj: Any) -> str:
    """A sha256 of a (nested) state dict: its keys, its tensors' dtypes, shapes and bytes, its other values."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                h.update(f"K{k!r}".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"V{x!r}".encode())

    walk(obj)
    return h.hexdigest()


def _digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _save(module: torch.nn.Module, opt: torch.optim.Optimizer, target: Path) -> dict[str, Any]:
    """The checkpoint, as a user saves it: one ``torch.save`` of both state dicts to the mount."""
    state = {"model": module.state_dict(), "optimizer": opt.state_dict()}
    t0 = time.time()
    torch.save(state, str(target))
    return {"started": t0, "ended": time.time(), "digest": state_digest(state), "size": target.stat().st_size}


def main() -> None:
    me, life = int(os.environ["RANK"]), int(os.environ.get("NCCLGUARD_RESTART_COUNT", "0") or 0)
    rankkit.rank = lambda: me + 10 * life
    put("life", life)
    import transformers

    before = "ncclguard" in sys.modules
    dist.init_process_group("gloo")  # as a user writes it, first: no timeout
    put("order", {"ncclguard_first": before, "group": [dist.get_rank(), dist.get_world_size()]})
    from ddp_bitequal_worker import batch, dataset, make  # imports ncclguard: after the group, as users do

    import ncclguard
    from ncclguard.world import current_world

    rankkit.rank = lambda: me + 10 * life  # that module sets its own on import
    target = Path(sys.argv[1]) / "ckpt.pt"
    module, opt = make()
    schedule = transformers.get_linear_schedule_with_warmup(opt, 3, STEPS)
    stepper = ncclguard.RecoveringStep(module, opt, scheduler=schedule)  # nothing else
    put("plan", [SAVE, STEPS])
    put("pid", os.getpid())
    rankkit.save()
    data, results = dataset(), []
    for step in range(stepper.resume_step or 0, STEPS):
        ids, labels = batch(data, step)
        if step == SAVE:
            put("judge_s_at_save", stepper.engine.timing.judge_s())

        def step_fn(model: torch.nn.Module, step: int = step, ids: torch.Tensor = ids, labels: torch.Tensor = labels):
            if me == SAVER and life == 0 and step == SAVE:
                rankkit.fault_fired("a save to a slow mount inside the step")
                put("save", _save(module, opt, target))  # ranks 1-2 wait in this step's all_reduce
            model(input_ids=ids, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        t0 = time.time()
        res = stepper(step_fn, step=step)
        results.append(
            {
                "step": step,
                "ok": res.ok,
                "attempts": res.attempts,
                "size": dist.get_world_size(),
                "started": t0,
                "ended": time.time(),
            }
        )
        if not res:
            break
        schedule.step()
    put("results", results)
    put("events", list(stepper.engine.timing.driver.events))
    put("rebuilds", len(stepper.recoveries))
    put("digest", _digest(module))
    put("final", [dist.get_rank(), dist.get_world_size(), current_world().generation])
    rankkit.done()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    main()
