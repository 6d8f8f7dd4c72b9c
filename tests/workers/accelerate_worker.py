"""Rank side of tests/integrations/test_accelerate_multirank.py: a hand-written Accelerate loop on 2 gloo ranks.

torchrun starts the ranks; ``Accelerator(cpu=True)`` joins them (gloo, DDP). A small MLP
classifier, ncclguard's watchdog started from the Accelerator, evaluations through
``ncclguard.integrations.accelerate.guarded_evaluate`` with ``accelerator.gather_for_metrics``:

1. ``clean``: an evaluation set of 9 samples, batches of 4 per rank, ``even_batches=True``
   (Accelerate's default: the last batch is padded with samples from the start and
   ``gather_for_metrics`` drops them): every rank counts exactly 9 samples.
2. ``slow-train``: at step 1 rank 0 is slow in its loop (Python) while rank 1 goes on into DDP's
   next collective, issued from C++ (at its second iteration DDP rebuilds its gradient buckets
   and broadcasts their layout); rank 0 goes on once the watchdog's report is merged.
3. ``stall``: rank 1 stalls for 60 s before its second ``gather_for_metrics`` while rank 0 waits
   in it: skipped on both ranks by the deadline, logged to the trackers.
4. ``uneven``: the same 9 samples with ``even_batches=False``: rank 0 gets 2 batches, rank 1 one,
   so rank 0's second ``gather_for_metrics`` has no partner: skipped on both by the deadline.
Training goes on between the evaluations; the parameters are compared at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.tracking import GeneralTracker
from rankkit import put
from torch.utils.data import DataLoader, TensorDataset

import ncclguard
from ncclguard.integrations.accelerate import guarded_evaluate, last_skip, start_watchdog

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
# Every bound here is a hang guard, so that a loaded machine only makes the launch longer. Seen with
# 4 CPU burners on 2 cores (load ~10): a rank's main thread and heartbeat stood ~2 s while its
# watchdog thread drew the first incident's timeline.png, which raised 3 more incidents at the
# former 1.5 s hang timeout and 1.8 s peer timeout; on a loaded fresh clone a verdict round's store
# calls outlasted the default 2 s grace (plus the store layer's 1 s), which skipped the uneven
# evaluation with "could not agree on the outcome" instead of rank 0's deadline.
HEARTBEAT_S, HANG_S = 0.5, 8.0  # a hang: over 3x the ~2 s a loaded rank stood between two ops
PEER_TIMEOUT_S = 8.0  # a lost peer: over 3x the ~2 s without a heartbeat seen on a loaded rank
# The evaluation's deadline, below the hang timeout: the guard ends a stalled evaluation first (the
# waiting rank's gather gives up by gloo's own timer). A loaded clean evaluation took 0.04 s at
# most, its side group's build included; the deadline leaves 2x the ~2 s a loaded rank can stand.
EVAL_TIMEOUT_S = 4.0
# How long past the deadline the ranks wait for each other's verdict (guarded_evaluate's grace_s):
# a round's store calls must end by then plus 1 s. Both ranks always give a verdict here, so the
# grace never lengthens a run; it only keeps a slow store from deciding the outcome.
GRACE_S = 10.0
STALL_S = 60.0  # far over the skip's guard: only the deadline ends it
BOUND_S = 60.0  # rank 0's wait for the report: over 3x the 8.2 s a loaded run needs
EVAL_SAMPLES = 9


class Recorder(GeneralTracker):
    """A tracker that keeps what it is given (trackers log on the main process only)."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, int | None]] = []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.logged.append((dict(values), step))


def reported(count: int) -> bool:
    incidents = OUT / "incidents"
    return incidents.is_dir() and len(list(incidents.glob("*/incident.json"))) >= count


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x.sum(1) > 0).long())


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    recorder = Recorder()
    accelerator = Accelerator(
        cpu=True,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))],
        log_with=[recorder],
    )
    accelerator.init_trackers("accelerate_worker")
    rank = accelerator.process_index
    watchdog = start_watchdog(
        accelerator,
        heartbeat_s=HEARTBEAT_S,
        hang_timeout_s=HANG_S,
        peer_timeout_s=PEER_TIMEOUT_S,
        incident_dir=OUT / "incidents",
        eval_timeout_s=EVAL_TIMEOUT_S,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(data(64, 0), batch_size=4, shuffle=False)
    even = DataLoader(data(EVAL_SAMPLES, 1), batch_size=4)
    model, optimizer, train, even = accelerator.prepare(model, optimizer, train, even)
    # The same set without padding: prepared while even_batches is False.
    accelerator.even_batches = False
    uneven = accelerator.prepare(DataLoader(data(EVAL_SAMPLES, 1), batch_size=4))
    accelerator.even_batches = True
    batches = iter(train)

    def train_steps(first: int, n: int, slow_at: int | None = None) -> None:
        for step in range(first, first + n):
            with ncclguard.phase("train", step=step):
                if step == slow_at and rank == 0:
                    rankkit.fault_fired("slow in its training loop")
                    put("slow_started", time.time())
                    rankkit.when(lambda: reported(1), BOUND_S).wait(BOUND_S)  # MARK: slow-train
                    put("slow_ended", time.time())
                x, y = next(batches)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

    stalls: list[float] = []

    def evaluate(loader, stall_rank: int | None = None):
        def run():
            seen, correct = 0, 0
            for i, (x, y) in enumerate(loader):
                pred = model(x).argmax(-1)
                if i == 1 and rank == stall_rank:
                    rankkit.fault_fired("stall in an evaluation")
                    stalls.append(time.time())
                    time.sleep(STALL_S)  # MARK: stall
                pred, y = accelerator.gather_for_metrics((pred, y))
                seen += len(y)
                correct += int((pred == y).sum())
            return seen, correct

        return run

    def loaders() -> list[str]:
        return [type(r).__name__ for r in accelerator.gradient_state.dataloader_references]

    outcomes = {}
    outcomes["clean"] = guarded_evaluate(
        accelerator, evaluate(even), eval_timeout_s=EVAL_TIMEOUT_S, grace_s=GRACE_S, step=0, fallback=None
    )
    train_steps(0, 2, slow_at=1)
    before = loaders()
    ended = {}
    outcomes["stall"] = guarded_evaluate(
        accelerator, evaluate(even, stall_rank=1), eval_timeout_s=EVAL_TIMEOUT_S, grace_s=GRACE_S, step=2, fallback=None
    )
    ended["stall"] = time.time()
    skips = {"stall": dataclasses.asdict(last_skip()) if last_skip() else None}
    put("loaders", {"before": before, "after": loaders(), "training": model.training})
    train_steps(2, 2)
    outcomes["uneven"] = guarded_evaluate(
        accelerator, evaluate(uneven), eval_timeout_s=EVAL_TIMEOUT_S, grace_s=GRACE_S, step=4, fallback=None
    )
    skips["uneven"] = dataclasses.asdict(last_skip()) if last_skip() else None
    train_steps(4, 2)
    outcomes["again"] = guarded_evaluate(
        accelerator, evaluate(even), eval_timeout_s=EVAL_TIMEOUT_S, grace_s=GRACE_S, step=6, fallback=None
    )
    put("outcomes", outcomes)
    put("skips", skips)
    put("stalls", stalls)
    put("ended", ended)
    put("digest", digest(accelerator.unwrap_model(model)))
    put("wrapped", type(model).__name__)
    put("n_params", sum(p.numel() for p in model.parameters()))
    put("tracked", recorder.logged)
    put("incidents", watchdog.incidents)
    watchdog.stop()
    put("watchdog_after_stop", ncclguard.current_watchdog() is not None)
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
