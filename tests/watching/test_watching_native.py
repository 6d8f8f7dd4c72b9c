"""Stacks from outside (py-spy) without a job: a child process holding the GIL, another host,
this process itself, and how the report shows them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ncclguard._naming import HOSTNAME
from ncclguard.incidents.model import Incident, IncidentDoc, IncidentKind, OutsideStack
from ncclguard.incidents.render import render
from ncclguard.watching.sensors.native import PY_SPY_TIMEOUT_S, dump_stacks, find_py_spy, how_to_get, outside_stacks

HOLDER = "import ctypes, sys\nprint('ready', flush=True)\nctypes.PyDLL(None).sleep(int(sys.argv[1]))\n"


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_a_process_holding_the_gil_is_dumped_with_its_native_frames():
    # The child holds the GIL in C for 120 s, past the 30 s hang guard below plus a dump's 20 s (it is
    # killed at the end): with 20 s, a loaded machine's slow dumps could outlast it.
    child = subprocess.Popen([sys.executable, "-c", HOLDER, "120"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        # Dumped until it shows the C call: a loaded machine may take a while to get the child there.
        give_up = time.monotonic() + 30  # a hang guard
        while True:
            time.sleep(0.2)
            t0 = time.monotonic()
            stacks = outside_stacks({3: (HOSTNAME, child.pid)})
            took = time.monotonic() - t0
            if "sleep (libc" in (stacks["3"].text or "") or time.monotonic() > give_up:
                break
    finally:
        child.kill()
        child.wait(10)
    st = stacks["3"]
    # The last dump ended within py-spy's own bound (native.PY_SPY_TIMEOUT_S, 20 s): a hang guard, not
    # a speed (a dump takes 1-5 s on a loaded machine).
    assert (st.rank, st.pid, st.error) == (3, child.pid, None) and took < PY_SPY_TIMEOUT_S
    assert '"MainThread"' in st.text and "sleep (libc" in st.text and "<module> (<string>:3)" in st.text


def test_no_dump_of_another_host_of_this_process_or_of_a_dead_pid():
    assert outside_stacks({0: (HOSTNAME, os.getpid())}) == {}  # its own statement has its stacks
    far = outside_stacks({5: ("node9", 4242)})["5"]
    assert (far.text, far.error) == (None, "on another host (node9)")
    assert far.how == how_to_get("node9", 4242) and far.how.startswith(
        "on host node9: `py-spy dump --native --pid 4242`"
    )
    if find_py_spy() is not None:
        text, error = dump_stacks(2**22 + 12345, timeout_s=10)  # no such process
        assert text is None and error is not None and error.startswith("py-spy failed (status ")


def test_the_report_shows_the_main_threads_block_or_how_to_get_it():
    dump = 'Process 7: python x.py\n\nThread 7 (idle): "MainThread"\n    sleep (libc.so.6)\n    hold (x.py:3)\nThread 8 (idle): "other"\n    wait (y.py:1)\n'
    incident = Incident(
        incident=IncidentDoc(kind=IncidentKind.PEERS_LOST, reason="no heartbeat from rank 1", id="x", ranks=[1]),
        written_at=0.0,
        merged_by=0,
        world_size=3,
        statements_from=[0],
        missing_statements=[1, 2],
        outside_stacks={
            "1": OutsideStack(rank=1, host="h", pid=7, text=dump, how=how_to_get("h", 7)),
            "2": OutsideStack(rank=2, host="node9", pid=8, error="on another host (node9)", how=how_to_get("node9", 8)),
        },
    )
    text = render(incident)
    assert (
        "STACKS FROM OUTSIDE (ranks that could not speak for themselves)\n"
        "  rank 1 (pid 7, py-spy dump --native, innermost first):\n"
        '    Thread 7 (idle): "MainThread"\n    sleep (libc.so.6)\n    hold (x.py:3)\n'
        "  rank 2 (pid 8): none (on another host (node9)); on host node9: `py-spy dump --native --pid 8`"
    ) in text


FLAKY_PY_SPY = """#!{python}
import pathlib, sys
count = pathlib.Path({count!r})
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if n < {fails}:
    print("Error: Failed to get stack traces", file=sys.stderr)
    sys.exit(1)
print('Thread 7 (idle): "MainThread"')
"""


@pytest.mark.parametrize(("fails", "whole"), [(2, True), (3, False)])
def test_a_read_that_raced_the_process_is_tried_again_up_to_three_times(tmp_path, monkeypatch, fails, whole):
    # py-spy's read races the running process now and then ("Failed to get stack traces", seen on a
    # loaded CI machine); it cannot be provoked on demand, so an executable that fails `fails` times
    # stands in for it here, and the real py-spy is exercised by the tests above.
    exe, count = tmp_path / "py-spy", tmp_path / "count"
    exe.write_text(FLAKY_PY_SPY.format(python=sys.executable, count=str(count), fails=fails))
    exe.chmod(0o755)
    monkeypatch.setattr("ncclguard.watching.sensors.native.find_py_spy", lambda: str(exe))
    text, error = dump_stacks(4242, timeout_s=60)
    assert int(count.read_text()) == 3
    if whole:
        assert (text, error) == ('Thread 7 (idle): "MainThread"\n', None)
    else:
        assert (text, error) == (None, "py-spy failed (status 1): Error: Failed to get stack traces")
