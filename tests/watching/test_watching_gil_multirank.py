"""A rank that cannot speak for itself: it holds the GIL in a C call (``ctypes.PyDLL(None).sleep``),
so its own watchdog thread stops too. Its peer names it lost, with its last heartbeat, and dumps
its Python and native stacks from outside with py-spy (one launch of
tests/workers/diagnosis_worker.py ``gil``, torchrun, 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.watching.sensors.native import find_py_spy

pytestmark = pytest.mark.multirank
WORKER = "diagnosis_worker.py"


def mark(name: str) -> int:
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def gil():
    return run_ranks("diagnosis_worker", 2, "gil", timeout_s=90)


def test_a_rank_holding_the_gil_is_named_lost_with_its_stacks_from_outside(gil):
    found = sorted((gil.out_dir / "incidents").iterdir())
    first = json.loads((found[0] / "incident.json").read_text())
    assert first["incident"]["kind"] == "lost" and first["incident"]["ranks"] == [1]
    (culprit,) = first["culprits"]
    assert (culprit["rank"], culprit["why"]) == (1, "lost")
    # Its last heartbeat came before the C call: that is where it was last seen from inside.
    assert culprit["site"].endswith(f"{WORKER}:{mark('gil-before')}")
    stack = first["outside_stacks"]["1"]
    assert stack["pid"] == first["ranks"]["1"]["pid"]
    if find_py_spy() is None:
        assert stack["text"] is None and stack["error"] == "py-spy is not installed"
        assert stack["how"].endswith("(pip install py-spy; run as root or with kernel.yama.ptrace_scope=0)")
        return
    text = stack["text"]
    assert stack["error"] is None and "Thread " in text and '"MainThread"' in text
    # Native frames (libc's sleep under ctypes' call) and the Python line that holds the GIL.
    assert "sleep (libc" in text and "ffi_call" in text
    assert f"hold_gil ({WORKER}:{mark('gil')})" in text
    summary = (found[0] / "summary.txt").read_text()
    assert "STACKS FROM OUTSIDE (ranks that could not speak for themselves)" in summary
    assert f"    hold_gil ({WORKER}:{mark('gil')})\n" in summary
    assert '"ncclguard-watchdog"' not in summary  # the main thread's block only
