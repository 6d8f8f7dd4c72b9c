"""Every python block of README.md and docs/ marked ``<!-- runnable: N ranks -->`` (the line right
before its fence; tests/house/test_docs.py finds the blocks and checks the marks) runs as pasted:
written to a file as it stands on the page and run on this CPU machine, on N gloo ranks under
``python -m torch.distributed.run --standalone`` (1 rank: plain ``python``), each rank exits 0.
``NCCLGUARD_AUTO`` is unset, so that what runs is what the page shows.

Each marked block is a few steps on a small model, measured on a 2-core machine: 4-8 s each when it
was lightly loaded (about 35 s for the six), 6-19 s at a load of 5-7 (about 70 s), 14-24 s at a
load of 9-10 (112 s), once 49 s; the hang guard is 180 s a block.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_docs import REPO, Block, blocks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]  # past each block's own hang guard

HANG_GUARD_S = 180
RUNNABLE = [b for b in blocks(REPO) if b.lang == "python" and b.ranks]


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kills the launcher and every rank it started (torchrun puts each rank in a session of its own)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in [*children, psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)


def run_block(block: Block, where: Path) -> tuple[int | None, str]:
    """Runs ``block`` as ``where/snippet.py`` (in ``where``, so the files it writes stay there) on
    its ranks; returns the exit status (None past the hang guard) and the output."""
    script = where / "snippet.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if k != "NCCLGUARD_AUTO"}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, str(script)]
    if block.ranks and block.ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.ranks}"]
    with open(where / "output.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
            rc = None
        log.seek(0)
        return rc, log.read()


def test_some_blocks_are_marked_runnable() -> None:
    # The marks are what this test runs: losing them all would pass it without running anything.
    assert len(RUNNABLE) >= 5, [b.where for b in RUNNABLE]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_a_block_marked_runnable_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    rc, output = run_block(block, tmp_path)
    ran = f"{block.where} on {block.ranks} rank(s)"
    assert rc is not None, f"{ran}: did not end within {HANG_GUARD_S} s\n{output[-6000:]}"
    assert rc == 0, f"{ran}: exit status {rc}\n{output[-6000:]}"
