"""The verdict drives the engine, with every default: real gloo ranks under torchrun, each under its
supervisor (``--restarts=1``, as ``ncclguard run --ncclguard-restarts 1`` runs it) with ``NCCLGUARD_AUTO=1``;
no timeout set anywhere (the group keeps gloo's 30 min, the step bound its 300 s default).

Launches (tests/workers/verdict_worker.py), RecoveringStep(allow_shrink=True) or an adapter's:
``stuck`` 3 ranks: 12 healthy steps (the step bound is learned), then rank 2 sleeps for good at step 12 and
    ranks 0-1 go on as a world of 2; at step 15 rank 1 beats with no backend count (as inside a rebuild's
    ``init_process_group``), then stops itself (SIGSTOP): rank 0, the only rank waiting, asks rank 1's
    supervisor to confirm (one view is no verdict), the supervisor sees it stopped and ends it, and rank 0
    finishes alone.
``busy`` 2 ranks: 12 steps of 1 s, then rank 1 computes in Python for 15 s at step 12: reported, no action;
    the run ends on its 2 ranks.
``upload`` 3 ranks, ``RecoveringStep(module, opt)`` with every default (it heals under restarts): 12
    healthy steps, then at step 12 rank 0 uploads for 25 s inside its step, its main thread blocked in
    ``sendall`` to a slow reader in another process (the test's): only its network bytes move.
    Reported ("net"), no action; the run ends on its 3 ranks. A drill (`make drills`; its test says what stays
    in the suite).
``hf`` 3 ranks: the HF Trainer with its defaults and ``guard_trainer(recover=True, allow_shrink=True)``, rank 2
    asleep for good at step 12, ranks 0-1 finish 16 steps; then an Accelerate loop through
    ``recovering_step``, rank 1 asleep for good at its step 3, rank 0 finishes alone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import psutil
import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

DEFAULTS = ["--restarts=1"]  # what ncclguard run --ncclguard-restarts 1 runs each rank under


def _env(tmp: str) -> dict[str, str]:
    # The watchdog as ncclguard run starts it, every setting at its default but where incidents go.
    return {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": tmp}


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory):
    # Two stuck ranks: rank 2 acted on about 10-12 s after its step began (the learned floor, then
    # 10 s without progress), rank 1 about 20 s after (its beat counts nothing: judged as a silent
    # rank, two beats past the floor). Hang guard: 240 s, under the 300 s step bound that would
    # otherwise be the first thing to end the survivors' wait.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("verdict_worker", 3, "stuck", timeout_s=240, supervise=DEFAULTS, env=_env(where))


def test_a_rank_asleep_then_a_stopped_rank_are_acted_on_within_the_learned_bound(stuck_job):
    res = stuck_job[0]
    results = res["results"]
    asleep, stopped = 12, 15
    assert [r["ok"] for r in results] == [True] * 18
    assert all(r["attempts"] == 1 and r["size"] == 3 for r in results[:asleep])
    # Step 12: rank 2 asleep for good; redone on a world of 2. Step 15: rank 1 stopped; redone alone.
    assert (results[asleep]["attempts"], results[asleep]["size"], results[asleep]["generation"]) == (2, 2, 1)
    assert all(r["attempts"] == 1 and r["size"] == 2 for r in results[asleep + 1 : stopped])
    assert (results[stopped]["attempts"], results[stopped]["size"], results[stopped]["generation"]) == (2, 1, 2)
    assert res["final"] == [0, 1, 2]
    # Learned after the warm-up: the floor (10 s), far below the 300 s step bound; kept across both rebuilds.
    steps = res["steps"]
    assert steps["0"]["judge_s"] == 30.0  # before the warm-up: the default
    assert steps[str(asleep)]["judge_s"] == 10.0 and steps[str(stopped)]["judge_s"] == 10.0
    assert res["judge_s"] == 10.0
    assert json.loads(res["stored"])["counts"]["step"] >= 10
    # The survivors went on well within the bound: each recovered step took far less than 300 s.
    for k in (asleep, stopped):
        assert results[k]["elapsed_s"] < 100, results[k]
    # What decided: rank 1 (then in a world of 2) was judged stuck because its process is stopped,
    # though its last beat said nothing of its count (read as level, it was never judged: once in CI).
    # Judged as a silent rank (two heartbeats past the 10 s floor); without that, this launch hangs.
    # Rank 0 waited alone for it: one view, so the one judge had it ask rank 1's supervisor to confirm
    # (ncclguard/watching/judge/rules.py, rule 4); the supervisor's own look saw it stopped and ended it.
    events = res["events"]
    acted = [e for e in events if e["what"] in ("acted", "ended")]
    assert acted, events
    last = acted[-1]
    assert (last["what"], last["rank"], last["state"]) == ("ended", 1, "stuck") and "stopped" in last["evidence"], last
    assert last["restarted"] is False and last["waited_s"] < 100, last
    asked = [e for e in events if e["what"] == "asked" and e["rank"] == 1]
    assert [(e["confirm"], e["state"], e["posted"]) for e in asked] == [(True, "stuck", True)], events
    assert "stopped" in asked[0]["evidence"], asked
    assert not [e for e in events if e["what"] == "acted" and e["rank"] == 1]  # nothing acted on one view
    assert not [e for e in events if e["what"] == "busy"]
    # Rank 2 asleep: acted on by the survivors, by itself (exit 0), or both; nothing moved.
    on2 = [e for e in stuck_job[1].get("events", []) if e["rank"] == 2] + [e for e in acted if e["rank"] == 2]
    assert all(e["state"] == "stuck" for e in on2)


@pytest.fixture(scope="module")
def busy_job(tmp_path_factory):
    # Steps of 1 s, then a 15 s busy step after the warm-ups (judge and hang bounds 10 s): about 50 s
    # here. Hang guard 200 s.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("verdict_worker", 2, "busy", timeout_s=200, supervise=DEFAULTS, env=_env(where))


def test_a_busy_rank_is_reported_never_acted_on_and_the_run_ends_on_its_full_world(busy_job):
    for r in (0, 1):
        res = busy_job[r]
        assert [(x["ok"], x["attempts"], x["size"], x["generation"]) for x in res["results"]] == [(True, 1, 2, 0)] * 14
        assert res["final"] == [r, 2, 0]
        assert not [e for e in res["events"] if e["what"] != "busy"], res["events"]
    busy = [e for e in busy_job[0]["events"] if e["what"] == "busy"]
    assert busy and busy[0]["rank"] == 1 and busy[0]["state"] == "moving", busy
    assert "cpu" in busy[0]["evidence"] or "stack" in busy[0]["evidence"]
    # The busy step's 15 s interval raised the learned bound: 5 x 15 s, at most half the 300 s step bound.
    assert 70.0 <= busy_job[0]["judge_s"] <= 150.0
    # The watchdog's hang bound, learned at 10 s (the steps set no phase), was used: rank 0 reported
    # the 15 s wait about 10 s into it, not at the 300 s it held before. Reported only, the incident
    # failed no step (every step above committed at its first attempt).
    hang = busy_job[0]["hang"]
    assert hang["hang_s"] == 10.0 and hang["state"]["counts"]["unphased"] >= 10
    found = [re.search(r"(?:stood|waited) (\d+\.\d) s", i["reason"]) for i in busy_job[0]["incidents"]]
    stood = [float(m.group(1)) for m in found if m]
    assert stood and all(10.0 <= x < 15.0 for x in stood), busy_job[0]["incidents"]
    assert all([a["rung"] for a in i["actions"]] == ["report"] for i in busy_job[0]["incidents"])


# The upload's receiver: a process of this test, not of the rank's tree (its CPU and its socket are not
# the rank's). It takes one connection, reads 64 KiB every 50 ms for argv[1] seconds, then drains
# what is left and closes (the sender's sendall returns, then its recv ends).
SLOW_READER = textwrap.dedent(
    """
    import socket, sys, time
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    end, got = time.monotonic() + float(sys.argv[1]), 0
    while time.monotonic() < end:
        data = conn.recv(64 << 10)
        if not data:
            break
        got += len(data)
        time.sleep(0.05)
    while data := conn.recv(1 << 20):
        got += len(data)
    conn.close()
    print(got, flush=True)
    """
)


UPLOAD_S = 25.0  # 2.5 x the learned judge bound (its 10 s floor)


@pytest.fixture(scope="module")
def upload_job(tmp_path_factory):
    # 12 quick steps (the judge bound learned at its 10 s floor), then rank 0's 25 s upload, judged
    # about 15 times by each waiting rank. About 45 s here. Hang guard 180 s, under the 300 s step bound.
    where = str(tmp_path_factory.mktemp("incidents"))
    reader = subprocess.Popen([sys.executable, "-c", SLOW_READER, str(UPLOAD_S)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None
        port = reader.stdout.readline().strip()
        args = ("upload", port, str(UPLOAD_S))
        job = run_ranks("verdict_worker", 3, *args, timeout_s=180, supervise=DEFAULTS, env=_env(where))
        reader.wait(timeout=30)  # it drained the upload and closed
        return job, int(reader.stdout.readline() or 0)
    finally:
        for child in _children(reader.pid):
            child.kill()
        reader.kill()
        reader.wait(timeout=30)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# A drill (`make drills`; benchmarks/busy_drill.py --upload-s is its long form): the network-bytes evidence stays in
# the suite on a process blocked in sendall to a slow reader
# (tests/watching/test_progress_evidence.py::test_a_process_blocked_in_sendall_to_a_slow_reader_is_moving_by_its_network_bytes),
# a busy rank reported and never acted on with every default in this module's busy test and, with heal on by default
# under restarts, in tests/watching/test_slow_save_multirank.py.
@pytest.mark.drill
def test_a_rank_busy_uploading_with_only_its_network_bytes_moving_is_never_acted_on(upload_job):
    """Under restarts the engine heals by default: a rank judged stuck would be ended and restarted.
    Rank 0's main thread is blocked in sendall for 25 s, 2.5 x the judge bound; its CPU, I/O and
    stack stand still, only its socket's bytes move (its reader is in another process, not its tree)."""
    job, read = upload_job
    upload, steps = job[0]["plan"]
    up = job[0]["upload"]
    assert up["s"] >= UPLOAD_S - 1.0 and read == up["bytes"], (up, read)  # it lasted, and all of it arrived
    for r in (0, 1, 2):
        res = job[r]
        assert res["heal"] is True and res["life"] == 0  # heals by default under restarts; never restarted
        rows = [(x["ok"], x["attempts"], x["size"], x["generation"]) for x in res["results"]]
        assert rows == [(True, 1, 3, 0)] * steps, rows
        assert res["final"] == [r, 3, 0]
        assert res["steps"][str(upload)]["judge_s"] == 10.0  # learned: the floor, well under the upload
        # Nothing but busy reports, about rank 0, on its network bytes (no acted, awaiting, asked, ...).
        assert all(e["what"] == "busy" and e["rank"] == 0 and "net +" in e["evidence"] for e in res["events"]), (
            r,
            res["events"],
        )
        assert all([a["rung"] for a in i["actions"]] == ["report"] for i in res["incidents"]), res["incidents"]
    assert not job[0]["events"]  # it never judged itself stuck (nor anyone else)
    busy = job[1]["events"] + job[2]["events"]
    assert busy and all(e["behind_s"] < UPLOAD_S for e in busy), busy  # judged while it uploaded
    assert not [r for r in job.results if r >= 10]  # no process restarted


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    # About 26 s here for the Trainer (the rank asleep acted on ~10 s into its step), then about 15 s
    # for the Accelerate loop. Hang guard 240 s, under the 300 s step bound.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("verdict_worker", 3, "hf", timeout_s=240, supervise=DEFAULTS, env=_env(where))


def test_the_hf_trainer_with_every_default_goes_on_without_a_rank_asleep_for_good(hf_job):
    """guard_trainer(trainer, recover=True, allow_shrink=True) and TrainingArguments' defaults
    (ddp_timeout 1,800 s): the verdict reaches the HF adapter through the one engine."""
    for r in (0, 1):
        res = hf_job[r]
        assert res["global_step"] == 16 and res["final"] == [r, 2, 1]
        [rec] = res["recoveries"]
        assert rec["step"] == 12 and rec["world_size"] == 2 and rec["s"] < 100, rec
        assert res["judge_s"] == 10.0
        _acted_on_stuck_only(res["events"], rank=2, may_be_empty=True)
        # Acted on once nothing of rank 2 moved, or once it had judged itself and exited 0 before this
        # rank sampled it ("stopped (SIGSTOP) or gone": seen on a loaded fresh clone); stuck either way.
        # A lone busy report ("moved 9.1 s ago: net +1.7 MB") with no action is allowed: the sleeper
        # judged itself and left before this rank's next sample (seen once in CI).
        # A release (the peers freed once rank 2's notice is read) is no judgement of rank 2.
        acted = [e["evidence"] for e in res["events"] if e["what"] not in ("busy", "released")]
        assert all("nothing moved" in e or "or gone" in e for e in acted), res["events"]


def test_an_accelerate_loop_with_every_default_goes_on_without_a_rank_asleep_for_good(hf_job):
    """The verdict reaches the Accelerate adapter (recovering_step, a RecoveringStep of its own):
    after the Trainer, ranks 0-1 run an Accelerate loop; launch rank 1 sleeps for good at its step 3."""
    acc = hf_job[0]["accelerate"]
    results = acc["results"]
    assert [(x["ok"], x["attempts"], x["size"]) for x in results] == [(True, 1, 2)] * 3 + [(True, 2, 1)] + [
        (True, 1, 1)
    ] * 2
    assert results[3]["elapsed_s"] < 100, results[3]  # the verdict, not the 300 s step bound
    assert acc["final"] == [0, 1, 2] and acc["processes"] == [1, 0]  # Accelerate follows the shrink
    # A new engine: its judge bound came from the job's store (the Trainer's engine learned it), no warm-up.
    assert acc["judge_s"] == [10.0] * 6
    # Empty on rank 0 when rank 1 judged itself and exited before rank 0's verdict sampled it (seen
    # on a loaded fresh clone; the step was still redone on a world of 1, checked above).
    _acted_on_stuck_only(acc["events"], rank=1, may_be_empty=True)
    assert "accelerate_stall_at" in hf_job[1]


def _acted_on_stuck_only(events: list[dict], rank: int, may_be_empty: bool = False) -> None:
    """The verdict acted on the rank asleep for good, and only once it was stuck. Before that it may
    have reported the rank once as behind but moving, with no action: on a loaded fresh clone the
    rank reached its sleep 5 s after its peers began to wait, so at the 10 s bound it had moved 5 s
    ago ("busy"), and it was acted on once nothing of it had moved for 10 s."""
    assert all(e["rank"] == rank for e in events), events
    acted = [e for e in events if e["what"] not in ("busy", "released")]  # a release judges no rank
    busy = [e for e in events if e["what"] == "busy"]
    # Empty when the sleeper judged itself and exited first (possibly after one busy report here).
    assert (acted or may_be_empty) and all(e["state"] == "stuck" for e in acted), events
    assert len(busy) <= 1 and all(e["state"] == "moving" for e in busy), events
    assert not (busy and acted) or events.index(busy[0]) < events.index(acted[0]), events
