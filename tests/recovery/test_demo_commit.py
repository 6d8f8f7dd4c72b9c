"""The demo's act "steps every rank agrees on", run as a user runs it: python -m ncclguard demo --only demo_commit."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank


def test_the_commit_act_shows_a_failed_step_agreed_on_and_redone():
    # 17 s here; the bound is a hang guard (the act bounds its ranks at 120 s itself).
    out = subprocess.run(
        [sys.executable, "-m", "ncclguard", "demo", "--only", "demo_commit"],
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    for rank in range(3):
        assert f"rank {rank}: step 3, first commit: ok=False, failed ranks [0, 1, 2]" in out.stdout
    assert "Every rank read the same outcomes: True; the step was redone on world generation 1: True." in out.stdout
    assert "All 6 steps committed on every rank: True; parameters identical: True." in out.stdout
