"""A job's end is no incident: ranks that end at different times, each as a user's script ends,
under a watchdog whose ladder exits (tests/workers/job_end_worker.py, 3 gloo ranks under
``ncclguard.testing.launch``, where rank 0's process hosts the store).

Without what a stopped watchdog says (the worker's ``off``), a rank done early is taken for lost
and the store's end for an incident, and the exit rung ends the ranks still at work with 75: the
control shows that the launch sees that harm.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.ending import Closing, closing_wait_s

pytestmark = pytest.mark.multirank
WORKER = "job_end_worker"
# As in the worker: the store's host waits at most this long in its destroy_process_group().
CLOSING_S = closing_wait_s(WatchdogConfig(heartbeat_s=0.5, peer_timeout_s=4.0, store_timeout_s=2.0, hang_timeout_s=30))


def incident_dirs(job, rank: int) -> list[str]:
    where = Path(job.out_dir) / f"incidents{rank}"
    return sorted(p.name for p in where.iterdir()) if where.exists() else []


@pytest.fixture(scope="module")
def ended():
    # Hang guard: the job takes ~12 s (6 s together, 3 s alone, start-up); 90 s on a loaded machine.
    return run_ranks(WORKER, 3, "on", launcher="spawn", timeout_s=90)


def test_every_rank_ends_with_status_0_and_no_incident(ended):
    assert ended.returncodes == {0: 0, 1: 0, 2: 0}  # run_ranks checks it too; said here as the claim
    for r in (0, 1, 2):
        assert ended.results[r]["incidents"] == [] and ended.results[r]["incidents_after"] == [], ended.results[r]
        assert incident_dirs(ended, r) == [], r


def test_destroy_process_group_leaves_the_watchdog_running(ended):
    # It goes on until the interpreter's exit (a script may make a group again); it says finished then.
    for r in (0, 1, 2):
        assert ended.results[r]["running"] is True, r


def test_the_stores_host_said_it_and_waited_for_every_rank(ended):
    # Rank 0 waited in its destroy_process_group() until ranks 1 (still at work) and 2 (done)
    # knew; the bound is the library's (a hang guard here: 3x it plus a second of load).
    assert ended.results[0]["closing"] is True
    assert ended.results[0]["destroy_s"] < 3 * CLOSING_S + 1.0, ended.results[0]
    assert "ranks knew the job is ending" not in ended.output, ended.output
    # Rank 1 read it, then saw the store go and took that for the job's end.
    assert ended.results[1]["closing"] is True
    assert "the store's host finished" in ended.output
    assert "the store is gone with its host" in ended.output
    # Rank 2 ended first, while the store lived: it never read the mark, and did not need to.
    assert ended.results[2]["closing"] is False


def test_without_it_a_rank_done_early_is_lost_and_the_exit_rung_ends_the_others():
    # Hang guard as above; ranks 0 and 1 exit 75 (the exit rung) before their work is done.
    job = run_ranks(WORKER, 3, "off", launcher="spawn", timeout_s=90, expect_rc={0: 75, 1: 75, 2: 0})
    assert incident_dirs(job, 2) == []
    for r in (0, 1):
        assert incident_dirs(job, r), r
    assert "watchdog: peer lost: no heartbeat from rank 2" in job.output


def test_a_destroy_waits_for_the_watchdogs_thread_only_when_another_thread_asks():
    # Closing.ask would wait up to CLOSING_S + 2 store timeouts (7.2 s here) for the watchdog's thread.
    # With no thread, or asked from that thread itself (a destroy from a rung), nobody would answer:
    # it must not wait. The bound below tells the two apart and is a hang guard as well.
    cfg = WatchdogConfig(heartbeat_s=0.5, peer_timeout_s=4.0, store_timeout_s=2.0, hang_timeout_s=30)
    t0 = time.monotonic()
    Closing(cfg, lambda: None).ask()
    own: list[threading.Thread] = []
    closing = Closing(cfg, lambda: own[0])
    own.append(threading.Thread(target=closing.ask))
    own[0].start()
    own[0].join(30)
    assert not own[0].is_alive() and time.monotonic() - t0 < 3.0


def test_a_torch_without_the_teardown_hook_gets_a_warning_and_the_watchdog_goes_on(monkeypatch, caplog):
    # The gate refuses (as on a torch older than the hook's API): one warning, no raise, no hook.
    from ncclguard import _torch_compat as compat
    from ncclguard.watching import ending

    monkeypatch.setattr(compat, "TORCH_VERSION", (1, 13))
    with caplog.at_level("WARNING", logger="ncclguard"):
        ending.hook_destroy(lambda: None)
    assert ending._hook.undo is None
    assert "distributed_c10d._update_default_pg" in caplog.text and "look to the other ranks" in caplog.text
    ending.unhook_destroy()  # nothing to take away: no error
