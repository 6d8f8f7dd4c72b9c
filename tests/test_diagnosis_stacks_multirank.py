"""Diagnosis sees every collective, whoever issued it: one desync per stack on real gloo ranks.

One launch (tests/workers/stacks_worker.py, torchrun, 2 ranks): for each of plain
``dist.all_reduce``, a functional ``all_reduce``, a DTensor redistribute, DDP, FSDP2 and a
``torch.compile``d functional ``all_reduce``, rank 1 evaluates while rank 0 goes into the stack's
collectives. Ops issued through ``torch.distributed``'s Python API are named by ncclguard's
records (kind ``hang``, with their call site); the others by the backend's sequence numbers in the
heartbeats (kind ``desync``, issued from C++).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank
HEARTBEAT_S = 0.3  # as in the worker
HANG_S = 1.5
WORKER = "stacks_worker.py"
STACKS = ["plain", "functional", "dtensor", "ddp", "fsdp2", "compile"]
# Which detector names each stack's desync: Python-level records, or the backend's numbers.
KIND = {
    "plain": "hang",
    "functional": "desync",
    "dtensor": "desync",
    "ddp": "desync",
    "fsdp2": "hang",
    "compile": "desync",
}


def mark(name: str) -> int:
    source = (Path(__file__).parent / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def stacks():
    return run_ranks("stacks_worker", 2, timeout_s=240)


def merged_by_stack(job) -> dict[str, dict]:
    found = sorted((job.out_dir / "incidents").iterdir())
    assert len(found) == len(STACKS), [p.name for p in found]
    return {name: json.loads((where / "incident.json").read_text()) for name, where in zip(STACKS, found, strict=True)}


def test_what_the_backend_counts_against_what_python_sees_per_call(stacks):
    """A healthy call of each stack: backend sequence numbers advanced vs ncclguard records (instrumented)."""
    for r in (0, 1):
        counts = {name: tuple(c) for name, c in stacks[r]["counts"].items()}
        assert counts["plain"] == (1, 1)
        for name in ("functional", "dtensor", "ddp", "compile"):  # issued from C++: no Python record
            assert counts[name][0] >= 1 and counts[name][1] == 0, (name, counts[name])
        assert counts["fsdp2"][0] > counts["fsdp2"][1] >= 1  # some through Python, some not


@pytest.mark.parametrize("stack", STACKS)
def test_the_desync_of_each_stack_names_the_evaluating_rank_within_hang_timeout_plus_two_beats(stacks, stack):
    inc = merged_by_stack(stacks)[stack]
    assert inc["incident"]["kind"] == KIND[stack] and inc["incident"]["by"] == 0
    (culprit,) = inc["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["phase"]) == (1, "behind", "eval batch=7")
    assert culprit["site"].endswith(f"{WORKER}:{mark('eval')}")
    assert inc["victims"] == [0]
    (finding,) = inc["findings"]
    assert (finding["kind"], finding["waiting"], finding["phase"]) == (
        "desync",
        [0],
        f"train step={STACKS.index(stack) + 1}",
    )
    if KIND[stack] == "desync":
        assert finding["backend"] and finding["op"].startswith("gloo:")
        assert finding["site"].startswith("C++ (not a torch.distributed Python call")
        # The victim's main thread stands at the user's line, never in torch's or inductor's code.
        assert finding["site"].endswith(f"{WORKER}:{mark(stack)}"), finding["site"]
    else:
        assert not finding["backend"] and finding["site"].endswith(f"{WORKER}:{mark(stack)}")
    hang_to_disk = inc["written_at"] - stacks[0]["starts"][stack]
    assert HANG_S <= hang_to_disk <= HANG_S + 2 * HEARTBEAT_S, hang_to_disk


def test_the_ddp_report_names_the_bucket_all_reduce(stacks):
    inc = merged_by_stack(stacks)["ddp"]
    (finding,) = inc["findings"]
    assert (finding["op"], finding["numel"], finding["dtype"]) == ("gloo:all_reduce", 16 * 16 + 16, "float32")
    assert inc["incident"]["reason"].endswith(" (in gloo:all_reduce)")
    assert inc["summary"].startswith(f"rank 0 waiting in gloo:all_reduce backend #{finding['seq']} (272 x float32")
    assert inc["culprits"][0]["last_seq"] == finding["seq"] - 1
