"""The backend reader against NCCL's real flight recorder: a world-of-one NCCL group on one GPU.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so multi-rank NCCL runs cannot be
tested on a one-GPU machine; this checks that what the watchdog reads from torch (the backend's
sequence number per group, the newest flight-recorder entry and its completion) has the shape
ncclguard parses. Skipped without CUDA and NCCL. ``python tests/watching/test_watching_nccl.py OUT``
also writes the raw recorder dump to OUT for inspection.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.watching.sensors.rank_state import RankState, backend_ops

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA GPU and NCCL"
)


@pytest.fixture
def nccl_world():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        yield compat.default_group()
    finally:
        dist.destroy_process_group()


def run_ops() -> None:
    """An all_reduce from Python and a DDP step (its bucket all_reduce issued from C++)."""
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16).cuda())
    model(torch.ones(4, 16, device="cuda")).sum().backward()
    torch.cuda.synchronize()


def test_the_nccl_recorder_reads_as_the_watchdog_expects(nccl_world):
    run_ops()
    seqs = RankState.backend_seq()
    name = nccl_world.group_name
    assert seqs is not None and seqs[name] >= 2  # the all_reduce and DDP's bucket all_reduce, at least
    ops = backend_ops(seqs)
    op = ops[name]
    assert op.name.startswith("nccl:") and op.sizes and op.dtypes == ["Float"]
    assert op.completed is True and op.created > 0
    raw = json.loads(compat.dump_flight_recorder(nccl=True))
    assert {"entries", "pg_status"} <= set(raw)


def test_on_nccl_an_op_held_open_reads_open_and_python_issued_ops_are_joined_to_their_call(nccl_world):
    """torch's NCCL recorder against ncclguard's join (watching/sensors/torchfr.py): DDP's bucket all_reduces
    come from the autograd device thread and join nothing; an all_reduce queued behind a sleep kernel
    reads open, joined to its Python call, then completed."""
    from ncclguard.recording.flight import recorder
    from ncclguard.recording.instrument import instrument, uninstrument
    from ncclguard.watching.sensors import torchfr
    from ncclguard.watching.sensors.rank_state import op_record

    recorder.clear()
    instrument()
    try:
        run_ops()
        records = [op_record(r) for r in recorder.records()]
        dump = torchfr.parse_dump(compat.dump_flight_recorder(nccl=True))
        joined = torchfr.join(records, dump.entries)
        assert [(r.seq, r.op) for r in joined.values()] == [(1, "all_reduce(SUM)")]  # run_ops' one Python call
        buckets = [e for e in dump.entries if e.name == "nccl:all_reduce" and e.numel == 16 * 16 + 16]
        assert buckets and not any(e.record_id in joined for e in buckets)
        name = nccl_world.group_name
        torch.cuda._sleep(int(2e9))  # about a second: the all_reduce behind it stays open
        dist.all_reduce(torch.ones(1024, device="cuda"))  # MARK: held open
        held = backend_ops(RankState.backend_seq() or {}, [op_record(r) for r in recorder.records()])[name]
        assert held.completed is False and held.name == "nccl:all_reduce" and held.record is not None
        assert held.record.site.endswith(f"test_watching_nccl.py:{_line('held open')}")
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # NCCL's watchdog thread retires the entry
            done = backend_ops(RankState.backend_seq() or {})[name]
            if done.completed:
                break
            time.sleep(0.05)
        assert done.completed is True
    finally:
        uninstrument()
        recorder.clear()


def _line(mark: str) -> int:
    (line,) = [i + 1 for i, t in enumerate(Path(__file__).read_text().splitlines()) if t.endswith(f"# MARK: {mark}")]
    return line


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    run_ops()
    seqs = RankState.backend_seq()
    for nccl in (False, True):
        (out / f"fr_{'nccl' if nccl else 'generic'}.json").write_text(compat.dump_flight_recorder(nccl=nccl))
    print("torch", torch.__version__, "seqs", seqs)
    print("backend_ops", {k: v.model_dump() for k, v in backend_ops(seqs or {}).items()})
    dist.destroy_process_group()
