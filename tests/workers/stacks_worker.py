"""Rank side of tests/watching/test_watching_stacks_multirank.py: one desync per way of issuing a collective.

2 ranks (torchrun, gloo), watchdog action report. For each stack, in order: plain
``dist.all_reduce``, a functional ``all_reduce``, a DTensor ``redistribute``, DDP forward and
backward, FSDP2 (``fully_shard``) forward and backward, a ``torch.compile``d function with a
functional ``all_reduce``, and a DeepSpeed ZeRO-2 training step. Rank 0 goes into the stack's
collectives; rank 1 evaluates until the watchdog's report of that desync is merged, then joins
(which releases rank 0). Before the desyncs, a healthy call of each stack measures how far the
backend's sequence numbers (all groups) and ncclguard's records advance, and how many of the
backend's entries the join gives a Python call site. At the end each rank saves torch's flight
recorder and ncclguard's records (``fr_rank<r>.json``) for the join to be checked on them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import deepspeed
import rankkit
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from rankkit import put
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ncclguard import _torch_compat as compat
from ncclguard import phase, safe_barrier, start_watchdog
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.recording.flight import recorder
from ncclguard.watching.sensors import torchfr
from ncclguard.watching.sensors.rank_state import RankState, op_record

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
INCIDENTS = OUT / "incidents"
HEARTBEAT_S = 0.3
HANG_S = 1.5
DS_CONFIG = {
    "train_batch_size": 2,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def backend_total() -> int:
    """The backend's ops on every group this rank is in."""
    return sum((RankState.backend_seq() or {}).values())


def joined_since(t0: float) -> int:
    """Backend entries created since ``t0`` (time.time()) that the join gives a Python record."""
    dump = torchfr.parse_dump(compat.dump_flight_recorder())
    fresh = [e for e in dump.entries if e.created >= t0]
    return len(torchfr.join([op_record(r) for r in recorder.records()], fresh))


def merged_incidents() -> int:
    return len(list(INCIDENTS.glob(f"*/{INCIDENT_FILE}"))) if INCIDENTS.is_dir() else 0


def eval_loop(wanted: int, bound_s: float = 20.0) -> None:
    with phase("eval", batch=7):
        rankkit.when(lambda: merged_incidents() >= wanted, bound_s).wait(bound_s)  # MARK: eval


class Stacks:
    """Each stack's step, built once on every rank (DDP and FSDP2 wrap their models up front)."""

    def __init__(self, world: int) -> None:
        torch.manual_seed(0)
        self.pg = compat.default_group()
        self.mesh = init_device_mesh("cpu", (world,))
        self.ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        self.fsdp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in self.fsdp:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.fsdp, mesh=self.mesh)
        self.compiled = torch.compile(self._reduce_twice)
        self.dt = distribute_tensor(torch.ones(4, 4), self.mesh, [Shard(0)])
        self.engine, *_ = deepspeed.initialize(model=torch.nn.Sequential(torch.nn.Linear(16, 8)), config=DS_CONFIG)

    # Compiled: inductor runs generated code in its place, so its frame stands at its first line.
    def _reduce_twice(self, t: torch.Tensor) -> torch.Tensor:  # MARK: compile
        return fc.all_reduce(t, "sum", self.pg) * 2

    def plain(self) -> None:
        dist.all_reduce(torch.ones(4))  # MARK: plain

    def functional(self) -> None:
        out = fc.all_reduce(torch.ones(4), "sum", self.pg)
        float(out[0])  # MARK: functional

    def dtensor(self) -> None:
        self.dt.redistribute(self.mesh, [Replicate()]).to_local()  # MARK: dtensor

    def ddp_step(self) -> None:
        self.ddp(torch.ones(4, 16)).sum().backward()  # MARK: ddp

    def fsdp_step(self) -> None:
        self.fsdp(torch.ones(2, 8)).sum().backward()  # MARK: fsdp2

    def compile_step(self) -> None:
        float(self.compiled(torch.ones(4))[0])

    def deepspeed_step(self) -> None:
        loss = self.engine(torch.ones(1, 16)).sum()
        self.engine.backward(loss)  # MARK: deepspeed
        self.engine.step()

    def all(self) -> dict[str, Callable[[], None]]:
        return {
            "plain": self.plain,
            "functional": self.functional,
            "dtensor": self.dtensor,
            "ddp": self.ddp_step,
            "fsdp2": self.fsdp_step,
            "compile": self.compile_step,
            "deepspeed": self.deepspeed_step,
        }


def main() -> None:
    r = rankkit.init()
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group already there
    stacks = Stacks(dist.get_world_size()).all()
    # The first calls build lazy state (FSDP2's, the compiled graph; DDP rebuilds its buckets in its
    # second step, with two broadcasts): before the watchdog, since one rank may compile seconds
    # longer than the other, which is a desync of its own.
    for step in stacks.values():
        step()
        step()
    wd = start_watchdog(heartbeat_s=HEARTBEAT_S, hang_timeout_s=HANG_S, incident_dir=INCIDENTS, action="report")
    # Healthy calls, measured: backend ops (every group), ncclguard records, backend entries joined.
    counts = {}
    for name, step in stacks.items():
        seq, recs, t0 = backend_total(), len(recorder.records()), time.time()
        step()
        counts[name] = (backend_total() - seq, len(recorder.records()) - recs, joined_since(t0))
    put("counts", counts)
    starts = {}
    for k, (name, step) in enumerate(stacks.items(), 1):
        safe_barrier(timeout=60)
        if r == 1:
            rankkit.fault_fired(f"evaluates while rank 0 is in {name}'s collectives")
            eval_loop(wanted=k)  # evaluates until this desync's report is merged
        with phase("train", step=k):
            starts[name] = time.time()
            step()
    put("starts", starts)
    put("incidents", wd.wait_for_incident(10, count=len(stacks), merged=r == 0))
    saved = {"dump": json.loads(compat.dump_flight_recorder()), "records": [x.to_dict() for x in recorder.records()]}
    (OUT / f"fr_rank{r}.json").write_text(json.dumps(saved))
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
