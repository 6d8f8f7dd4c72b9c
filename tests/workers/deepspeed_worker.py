"""Rank side of tests/integrations/test_deepspeed_eval_multirank.py.

Usage: ``deepspeed_worker.py STAGE [STAGE ...]`` or ``deepspeed_worker.py example [ARGS ...]``
(runs docs/examples/deepspeed_guarded_eval.py with ARGS on this rank).

Per ZeRO stage, one DeepSpeed engine of the tiny Qwen2.5-VL classifier and, in order: a healthy
evaluation unguarded and guarded; rank 1 stalling in its evaluation loop past the deadline;
3 training steps after that; a retry whose shrink() removes the stall; slim_outputs on the engine.
"""

from __future__ import annotations

import hashlib
import runpy
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import deepspeed
import rankkit
import torch
import torch.distributed as dist
from qwen2_5_vl_synthetic import synthetic_batch, tiny_config
from rankkit import put, stall
from reference_trainer import ListMonitor, ReferenceTrainer, ds_config
from torch.distributed import distributed_c10d as c10d

from ncclguard.deadlines import Deadline
from ncclguard.evaluation.side_group import deadline_timeout, routed_default_group
from ncclguard.integrations.deepspeed import FAILED_METRIC, guarded_evaluate, patch_trainer, unpatch_trainer
from ncclguard.integrations.models.qwen2_5_vl import (
    Qwen2_5_VLForClassification,
    is_slimmed,
    slim_outputs,
    unslim_outputs,
)

TIMEOUT_S = 2.0
STALL_S = 30.0  # far past the deadline: only the guard can end it in time
STALL_RANK = 1


def param_digest(engine: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_stage(stage: int, rank: int) -> dict:
    res: dict = {}
    torch.manual_seed(0)
    cfg = tiny_config()
    model = Qwen2_5_VLForClassification(cfg)
    seen_modes: list[tuple[bool, bool]] = []
    trainer_box: list[ReferenceTrainer] = []

    def on_eval_batch(i: int) -> None:
        t = trainer_box[0]
        seen_modes.append((t.model.training, t.model.module.training))
        if stalling["on"] and i == 0 and t.eval_batch_size > 2:  # big batches are "too slow" on rank 1
            stall(STALL_RANK, STALL_S)

    stalling = {"on": False}
    monitor = ListMonitor()
    trainer = ReferenceTrainer(
        model,
        ds_config(stage, micro_batch=4),
        synthetic_batch(cfg, 8, seed=500 + rank),
        eval_batch_size=4,
        monitor=monitor,
        on_eval_batch=on_eval_batch,
    )
    trainer_box.append(trainer)
    engine = trainer.model
    world_pg = c10d._world.default_pg
    batches = iter(synthetic_batch(cfg, 4, seed=1000 * (s + 1) + rank) for s in range(100))

    res["losses_before"] = [trainer.train_step(next(batches)) for _ in range(2)]

    # Healthy: unguarded, then guarded through patch_trainer, then the EvalSums path.
    res["unguarded"] = list(trainer.evaluate(step=2))
    patch_trainer(trainer, eval_timeout_s=TIMEOUT_S)
    seen_modes.clear()
    res["modes_before"] = [engine.training, engine.module.training]
    res["guarded"] = list(trainer.evaluate(step=2))
    res["modes_during"] = sorted(set(seen_modes))
    res["modes_after"] = [engine.training, engine.module.training]
    res["healthy_report"] = vars(trainer.last_eval_report)
    res["sums_guarded"] = list(guarded_evaluate(engine, trainer.eval_sums, eval_timeout_s=TIMEOUT_S))
    res["default_pg_restored"] = c10d._world.default_pg is world_pg

    # Rank 1 stalls in its first evaluation batch: both ranks must skip, by the deadline.
    stalling["on"] = True
    start = time.monotonic()
    res["stalled_value"] = list(trainer.evaluate(step=3))
    res["stalled_elapsed_s"] = time.monotonic() - start
    rep = trainer.last_eval_report
    res["stalled_report"] = {
        "ok": rep.ok,
        "attempts": rep.attempts,
        "reasons": rep.reasons,
        "failed_ranks": rep.failed_ranks,
    }
    res["modes_after_failure"] = [engine.training, engine.module.training]
    res["default_pg_restored_after_failure"] = c10d._world.default_pg is world_pg
    res["failure_records"] = [(s, m) for s, m in monitor.records if FAILED_METRIC in m]

    # Training goes on, on the training group.
    steps_before = engine.global_steps
    res["losses_after_failure"] = [trainer.train_step(next(batches)) for _ in range(3)]
    res["steps_after_failure"] = engine.global_steps - steps_before
    res["digest_after_failure"] = param_digest(engine)

    # Rank 1 comes to the evaluation late: the barrier fails, every rank skips, training goes on.
    # It comes once rank 0 gave up (and at least 2 deadlines late), not after a fixed sleep that a
    # loaded machine could outrun.
    patch_trainer(trainer, eval_timeout_s=TIMEOUT_S)
    if rank == STALL_RANK:
        rankkit.wait_for(f"late-{stage}", at_least_s=2 * TIMEOUT_S)
    start = time.monotonic()
    res["late_value"] = list(trainer.evaluate(step=7))
    res["late_elapsed_s"] = time.monotonic() - start
    rep = trainer.last_eval_report
    res["late_report"] = {"ok": rep.ok, "reasons": rep.reasons, "failed_ranks": rep.failed_ranks}
    if rank != STALL_RANK:
        rankkit.announce(f"late-{stage}")
    res["losses_after_late"] = [trainer.train_step(next(batches)) for _ in range(1)]

    # A retry after shrink() halves the evaluation batch (no stall at batch 2).
    def halve() -> None:
        trainer.eval_batch_size //= 2

    patch_trainer(trainer, eval_timeout_s=TIMEOUT_S, retries=1, shrink=halve)
    start = time.monotonic()
    res["retry_value"] = list(trainer.evaluate(step=6))
    res["retry_elapsed_s"] = time.monotonic() - start
    rep = trainer.last_eval_report
    res["retry_report"] = {"ok": rep.ok, "attempts": rep.attempts, "n_reasons": len(rep.reasons)}
    res["retry_batch_size"] = trainer.eval_batch_size
    unpatch_trainer(trainer)
    res["unpatched_is_class_method"] = "evaluate" not in vars(trainer)
    res["unguarded_at_2"] = list(trainer.evaluate(step=6))  # no stall at batch 2: the reference
    res["losses_after_retry"] = [trainer.train_step(next(batches)) for _ in range(1)]
    res["digest_end"] = param_digest(engine)

    # slim_outputs on the engine: config asks for hidden states, the call does not.
    batch = synthetic_batch(cfg, 2, seed=7)
    engine.module.config.output_hidden_states = True
    with torch.no_grad():
        res["engine_hidden_unslim"] = engine(**batch).hidden_states is not None
        slim_outputs(engine)
        slim_outputs(engine)
        res["engine_slimmed"] = [is_slimmed(engine), is_slimmed(engine.module)]
        out = engine(**batch)
        res["engine_fields_slim"] = sorted(out.keys())
        res["engine_hidden_when_asked"] = len(engine(**batch, output_hidden_states=True).hidden_states)
        unslim_outputs(engine)
        res["engine_hidden_unslimmed_again"] = engine(**batch).hidden_states is not None
    engine.module.config.output_hidden_states = False
    return res


def eval_group_checks(rank: int) -> dict:
    """The two mechanisms under the guard, on their own: routing group=None, deadline timeouts."""
    res: dict = {}
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    world_pg = c10d._world.default_pg
    t = torch.tensor([float(rank + 1)])
    with routed_default_group(side):
        res["routed_is_side"] = c10d._get_default_group() is side and dist.group.WORLD is side
        dist.all_reduce(t)
    res["routed_sum"] = t.item()
    try:
        with routed_default_group(side):
            raise KeyError("inside")
    except KeyError:
        pass
    res["restored_after_error"] = c10d._world.default_pg is world_pg

    # The group was made with a 30 s timeout; an op started 0.5 s before a 1.5 s deadline must
    # give up at the deadline, not 30 s later. Rank 1 never joins it.
    start = time.monotonic()
    with deadline_timeout(side, Deadline(start + 1.5)):
        if rank == 0:
            time.sleep(0.5)
            try:
                dist.all_reduce(torch.ones(1), group=side)
                res["op"] = "completed"
            except RuntimeError as exc:
                res["op"] = str(exc)
            res["op_elapsed_s"] = time.monotonic() - start
        else:
            rankkit.fault_fired("never joins an op of a side group")
            time.sleep(2.5)
    dist.barrier()  # the world group is untouched by the side group's failure
    res["world_ok_after"] = True

    # Why deadline_timeout must be entered before the ops it bounds: entered 0.3 s after an op
    # started, with a deadline 1 s after the start, it lowers the group's timeout, and the op in
    # flight keeps the 4 s it started with (torch reads a group's timeout when an op starts).
    fixed = dist.new_group(backend="gloo", timeout=timedelta(seconds=4))
    start = time.monotonic()
    if rank == 0:

        def too_late() -> None:
            with deadline_timeout(fixed, Deadline(start + 1.0)):
                pass

        later = threading.Timer(0.3, too_late)
        later.start()
        try:
            dist.all_reduce(torch.ones(1), group=fixed)
        except RuntimeError:
            pass
        res["inflight_op_elapsed_s"] = time.monotonic() - start
        later.join()
    else:
        time.sleep(4.5)
    dist.barrier()
    return res


EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "deepspeed_guarded_eval.py"


def main() -> None:
    if sys.argv[1] == "example":
        if "--stall-rank" in sys.argv:
            rankkit.fault_fired("the example's --stall-rank")  # on every rank: the example stalls one by its own code
        sys.argv = [str(EXAMPLE), *sys.argv[2:]]
        runpy.run_path(str(EXAMPLE), run_name="__main__")
        put("example_finished", True)
        rankkit.done()
    rank = rankkit.init(timeout_s=60)
    deepspeed.init_distributed(dist_backend="gloo")
    put("eval_group", eval_group_checks(rank))
    for stage in sys.argv[1:]:
        put(f"zero{stage}", run_stage(int(stage), rank))
    rankkit.done()


if __name__ == "__main__":
    main()
