"""The watchdog on real gloo ranks: desyncs and frozen ranks named, a killed rank and a dead store
reported, the raise and exit rungs, and SIGALRM against a blocked collective.

Three launches (tests/workers/diagnosis_worker.py): ``desync`` (torchrun, 3 ranks, ladder
report then a custom rung), ``raise_lost`` (spawn, 4 ranks, action raise; ranks 3 and 0 are SIGKILLed) and ``exit``
(spawn, 2 ranks, action exit).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.cli import main
from ncclguard.watching.watchdog import EXIT_CODE

pytestmark = pytest.mark.multirank
HEARTBEAT_S = 0.3  # as in the worker
HANG_S = 1.5
SKEW_S = 0.25  # how much earlier than rank 2 the others may enter an op (a loaded machine)
PEER_S = 4.0  # the worker's peer_timeout_s: above a loaded machine's starved beats (tests/workers/diagnosis_worker.py)
# Hang guard on a report: over 3x the 1.6-2.2 s from the hang to the report on disk that loaded runs
# took (docs/diagnosis.md; the bound hang_timeout_s + 2 * heartbeat_s is 2.1 s). How soon it comes
# is a latency: benchmarks/watchdog_scale.py --ranks --gloo-ranks 3 measures it on this scenario.
REPORT_GUARD_S = 7.0
WORKER = "diagnosis_worker.py"


def mark(name: str) -> int:
    """The line of the worker that ends in ``# MARK: <name>``."""
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


def listing(where: Path) -> list[str]:
    """The files of an incident directory, without a write in progress when the rank exited
    (``.<name>.<pid>.<thread>.tmp``: write_json renames it into place when done) and without timeline.png
    (drawn from a thread of its own when matplotlib is installed; tests/watching/test_views_multirank.py
    checks it)."""
    return sorted(p.name for p in where.iterdir() if not p.name.startswith(".") and p.name != "timeline.png")


def incidents(job) -> list[Path]:
    return sorted((job.out_dir / "incidents").iterdir())


def merged(where: Path) -> dict:
    return json.loads((where / "incident.json").read_text())


def dump(where: Path, rank: int) -> dict:
    return json.loads((where / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def desync():
    return run_ranks("diagnosis_worker", 3, "desync", timeout_s=240)


@pytest.fixture(scope="module")
def raise_lost():
    return run_ranks("diagnosis_worker", 4, "raise_lost", timeout_s=90, launcher="spawn", expect_rc={0: -9, 3: -9})


@pytest.fixture(scope="module")
def exit_job():
    return run_ranks(
        "diagnosis_worker", 2, "exit", timeout_s=60, launcher="spawn", expect_rc={0: EXIT_CODE, 1: EXIT_CODE}
    )


# ----------------------------------------------------------------------------- desync launch


def test_every_instrumented_op_is_recorded_alike_on_every_rank(desync):
    world = 3
    expected = [
        (1, "all_reduce(SUM)", 4, "float32", False),
        (2, "all_gather", 4, "float32", False),
        (3, "all_gather_single", 4, "float32", False),
        (4, "all_gather_into_tensor", 4, "float32", False),
        (5, "reduce_scatter(SUM)", 4 * world, "float32", False),
        (6, "reduce_scatter_tensor(SUM)", 4 * world, "float32", False),
        (7, "broadcast", 4, "float32", False),
        (8, "reduce(SUM)", 4, "float32", False),
        (9, "barrier", 0, "", False),
        (10, "all_to_all", 2 * world, "float32", False),
        (11, "all_to_all_single", 2 * world, "float32", False),
        (12, "gather", 4, "float32", False),
        (13, "scatter", 4, "float32", False),
        (14, "all_reduce(SUM)", 4, "float32", True),
    ]
    for r in range(world):
        assert set(desync[r]["ops"].values()) == {"ok"}, desync[r]["ops"]
        recs = desync[r]["records"]
        collectives = [x for x in recs if x["peer"] is None]
        assert [(x["seq"], x["op"], x["numel"], x["dtype"], x["async_op"]) for x in collectives] == expected
        assert {(x["group"], x["state"], x["phase"]) for x in recs} == {("0", "completed", "train step=1")}
        assert all(x["site"].rsplit(":", 1)[0].endswith(WORKER) for x in recs)
        nxt, prv = (r + 1) % world, (r - 1) % world
        first = [("send", nxt), ("recv", prv)] if r % 2 == 0 else [("recv", prv), ("send", nxt)]
        p2p = [(x["seq"], x["op"], x["peer"], x["async_op"]) for x in recs if x["peer"] is not None]
        assert p2p == [(1, *first[0], False), (2, *first[1], False), (3, "isend", nxt, True), (4, "irecv", prv, True)]
    # Same numbers, ops and sites on every rank: what lets the report line the ranks up.
    strip = lambda recs: [x for x in recs if x["peer"] is None]  # noqa: E731
    assert strip(desync[0]["records"]) == strip(desync[1]["records"]) == strip(desync[2]["records"])


def test_desync_names_the_skipping_rank_with_phase_and_site_within_hang_timeout_plus_two_heartbeats(desync):
    where = incidents(desync)[0]
    inc = merged(where)
    (finding,) = inc["findings"]
    assert (finding["kind"], finding["group"], finding["seq"], finding["op"]) == ("desync", "0", 15, "all_reduce(SUM)")
    assert (finding["numel"], finding["dtype"], finding["phase"]) == (4, "float32", "train step=4")
    assert finding["site"].endswith(f"{WORKER}:{mark('desync')}")
    assert finding["waiting"] == [0, 1] and inc["victims"] == [0, 1]
    (culprit,) = inc["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["last_completed"], culprit["phase"]) == (
        2,
        "behind",
        14,
        "eval batch=7",
    )
    assert culprit["site"].endswith(f"{WORKER}:{mark('eval')}")
    assert culprit["inflight"] is None
    assert inc["summary"].startswith("ranks 0-1 waiting in all_reduce(SUM) #15 (4 x float32, phase train step=4) for ")
    assert inc["summary"].endswith(
        f" s; rank 2 last completed #14, now in phase eval batch=7 at {WORKER}:{mark('eval')}"
    )
    hang_to_disk = inc["written_at"] - min(desync[0]["desync_start"], desync[1]["desync_start"])
    assert HANG_S <= hang_to_disk <= REPORT_GUARD_S, hang_to_disk
    # The waiting ranks were released when rank 2 came back, after the report was on disk.
    assert min(desync[0]["desync_released"], desync[1]["desync_released"]) > inc["written_at"]


def test_a_rank_frozen_in_python_is_named(desync):
    inc = merged(incidents(desync)[1])
    assert inc["victims"] == [0, 2]
    (culprit,) = inc["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["last_completed"], culprit["phase"]) == (
        1,
        "behind",
        15,
        "checkpoint step=9",
    )
    assert culprit["site"].endswith(f"{WORKER}:{mark('frozen')}")
    # A rank whose statement came after the merge (a loaded machine: once in a full run here) is also
    # named in a "silent" finding; the desync is the one finding besides it.
    (finding,) = [f for f in inc["findings"] if f["kind"] != "silent"]
    assert (finding["seq"], finding["numel"], finding["dtype"], finding["phase"]) == (16, 8, "float64", "train step=5")
    # The frozen rank waits in a threading.Event (rankkit.when): threading's frames are innermost. Its
    # stack is in the merged report, or (its statement came after the merge: the report holds its
    # heartbeat) in its own dump of the incident.
    stack = inc["ranks"]["1"].get("stack") or dump(incidents(desync)[1], 1)["statement"]["stack"]
    own = [frame for frame in stack if "/threading.py:" not in frame]
    assert own[-1].startswith(f"{Path(finding['site']).parent}/{WORKER}:{mark('frozen')} in frozen")


def test_sigalrm_cannot_interrupt_a_blocked_gloo_collective_but_the_watchdog_reports_it(desync):
    alarm = desync[0]["alarm"]
    released = min(desync[r]["released_at"] for r in (1, 2))
    returned = desync[0]["alarm_start"] + desync[0]["alarm_elapsed"]
    # The 1 s alarm was delivered only when the op returned, once ranks 1-2 joined it: seconds later.
    assert returned >= released - 0.05 and desync[0]["alarm_elapsed"] > 1.5, (desync[0], released)
    assert (alarm["raised"], alarm["context"]) == ("DeadlineExceeded", None)  # the op itself succeeded
    inc = merged(incidents(desync)[2])
    slow = desync[0]["group_names"]["slow"]
    (finding,) = [f for f in inc["findings"] if f["kind"] != "silent"]  # a late statement adds "silent"
    assert (finding["kind"], finding["group"], finding["seq"], finding["waiting"]) == ("desync", slow, 1, [0])
    assert [(c["rank"], c["last_seq"]) for c in inc["culprits"]] == [(1, 0), (2, 0)]
    # On disk while the op was still blocked: ranks 1-2 joined it only after.
    assert inc["written_at"] < released


def test_every_rank_dumped_every_incident(desync):
    found = incidents(desync)
    # The three incidents of the scenario come first. While rank 0 then sits in the slow group's
    # all_reduce, a starved machine can keep a rank's heartbeats from the store for seconds (CI, a
    # slower host: 4.2 s, 8.1 s, and ~10 s while rank 0 drew an earlier incident's picture): that is
    # told as it is, in incidents of their own after the three, naming a silent or lost rank, and
    # nothing else (the worker's peer timeout keeps a lost one out of the third: DESYNC_PEER_S).
    expected, told_late = found[:3], found[3:]
    assert len(expected) == 3
    for where in told_late:
        kinds = {f["kind"] for f in merged(where)["findings"]}
        assert kinds & {"silent", "lost"} and kinds <= {"desync", "silent", "lost"}, merged(where)["summary"]
    for where in expected:
        assert listing(where) == ["incident.json", "rank0.json", "rank1.json", "rank2.json", "summary.txt"]
        for r in range(3):
            d = dump(where, r)
            assert d["kind"] == "ncclguard-rank-dump" and d["statement"]["rank"] == r
            threads = " ".join(d["threads"])
            assert "MainThread" in threads and "ncclguard-watchdog" in threads
            assert sorted(d["heartbeats"]) == ["0", "1", "2"]
            assert d["records"] and d["actions"][0]["rung"] == "report"
    for r in range(3):
        assert [i["id"] for i in desync[r]["incidents"]][:3] == [p.name for p in expected]


def test_report_command_prints_the_merged_incident(desync, capsys):
    where = incidents(desync)[0]
    assert main(["report", str(where)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ncclguard incident {where.name}: rank ")
    assert merged(where)["summary"] in out
    assert "VICTIMS (waiting for the culprits): ranks 0-1" in out
    assert out == (where / "summary.txt").read_text() + f"\nincident directory: {where}\n"


def test_a_custom_action_is_a_rung_of_the_ladder_on_every_rank(desync):
    """The worker's ladder is ["report", Marker()]: a user's Action, climbed like the built-in rungs."""
    found = incidents(desync)
    # Incident 3 (rank 0 alone in the slow group's all_reduce) never resolves: every rank takes the rung.
    for r in range(3):
        actions = dump(found[2], r)["actions"]
        assert [(a["rung"], a["done"]) for a in actions] == [("report", True), ("marker", True)], actions
        mark_file = desync.out_dir / "marks" / f"{found[2].name}.rank{r}"
        assert actions[1]["path"] == str(mark_file) and mark_file.read_text() == "hang"
        assert dump(found[2], r)["ladder"] == ["report", "marker"]
    # Incidents 1-2 resolve when the culprit comes back: each rank took the rung or saw it cleared first.
    for where in found[:2]:
        for r in range(3):
            rungs = [(a["rung"], a["done"]) for a in dump(where, r)["actions"]]
            assert rungs in ([("report", True), ("marker", True)], [("report", True), ("resolved", True)]), rungs
            assert (desync.out_dir / "marks" / f"{where.name}.rank{r}").exists() == (rungs[1][0] == "marker")


# ----------------------------------------------------------------------------- raise and lost launch


def test_raise_ends_a_python_level_stall_and_skips_ranks_blocked_in_cpp(raise_lost):
    stall = raise_lost[2]["stall"]
    assert stall["raised"] == "CollectiveTimeout"
    # After the hang timeout, long before its 30 s sleep. The timeout runs from the waiting ranks' entry
    # into the all_reduce, and rank 2's clock starts once it left the one before, a little later than
    # they did: its raise came 1.476 s after its t0 in one fresh-clone CI run (SKEW_S allows for that).
    assert HANG_S - SKEW_S <= stall["elapsed"] <= REPORT_GUARD_S
    (first,) = raise_lost[2]["first"]
    assert stall["message"].startswith(f"ncclguard watchdog, incident {first['id']}: rank ")
    assert [a["rung"] for a in first["actions"]] == ["report", "raise"] and first["actions"][1]["done"] is True
    for r in (0, 1, 3):
        # Blocked in the all_reduce: not raised. Depending on when its watchdog got there, the op had
        # completed (resolved), it was still blocked (skipped), or it completed between the check and
        # the signal (dropped by the handler). Never an exception: the rank's exit code 0 says so too.
        actions = raise_lost[r]["first"][0]["actions"]
        rungs = [(a["rung"], a["done"]) for a in actions]
        assert rungs in ([("report", True), ("raise", False)], [("report", True), ("resolved", True)]), rungs
        if rungs[1][0] == "raise":
            why = actions[1]["why"]
            assert "blocked in C++ (all_reduce(SUM) #2)" in why or why.startswith(
                "dropped: op #2 on group 0 completed"
            ), why
    # Rank 2 came back once raised: everyone was released (hang guard: over 3x the 3.1 s this once
    # allowed, long before the 30 s stall would have ended by itself; 1.55 s measured under load).
    assert all(raise_lost[r]["released"] <= REPORT_GUARD_S + 3.0 for r in range(4))
    inc = merged(Path(first["dir"]))
    assert [(c["rank"], c["phase"]) for c in inc["culprits"]] == [(2, "eval batch=7")]


def test_a_sigkilled_rank_is_reported_lost_by_the_survivors(raise_lost):
    docs = [i for i in raise_lost[1]["incidents"] if i["kind"] == "lost"]
    assert len(docs) == 1 and docs[0]["doc"]["ranks"] == [3]
    inc = merged(Path(docs[0]["dir"]))
    assert [(c["rank"], c["why"]) for c in inc["culprits"]] == [(3, "lost")]
    assert inc["victims"] == [0, 1, 2] and inc["lost"] == [3]
    # The dead rank's statement is missing; on a starved host a survivor's can come after the merge too
    # (CI on a slower host: [0, 3]), and is then in its own dump.
    assert 3 in inc["missing_statements"] and set(inc["missing_statements"]) <= {0, 1, 2, 3}
    assert inc["summary"].startswith("rank 3 lost: no heartbeat for ")
    for r in (0, 1, 2):
        lost = raise_lost[r]["lost"]
        assert (lost["raised"], lost["missing"]) == ("CollectiveTimeout", [3])
        # peer_timeout_s after the last beat seen, plus detection, merge, raise (1.16-1.23 s measured
        # under load when it was 1.2 s). Hang guard: 3x (PEER_S + 5 beats), within the worker's 25 s
        # idle. No lower bound: a rank starved before its kill beat last earlier.
        assert 0 < lost["elapsed"] <= 3 * (PEER_S + 5 * HEARTBEAT_S)
    assert all(raise_lost[r]["survivors_met"] for r in (0, 1, 2))


def test_a_dead_store_is_reported_not_waited_on(raise_lost):
    for r in (1, 2):
        store = raise_lost[r]["store"]
        assert store["raised"] == "CollectiveTimeout" and "the rendezvous store is gone" in store["message"]
        assert store["elapsed"] < 3.0  # hang guard: 6x the 0.49 s a loaded run took
        (doc,) = [i for i in raise_lost[r]["incidents"] if i["kind"] == "store"]
        inc = merged(Path(doc["dir"]))
        assert [f["kind"] for f in inc["findings"]] == ["store"]
        assert inc["summary"].startswith("the rendezvous store at 127.0.0.1:")
        # Not waited on: told by the closed connection, not by gone_after (PEER_S) of silence.
        assert "no answer for" not in inc["summary"], inc["summary"]
        assert listing(Path(doc["dir"])) == ["incident.json", f"rank{r}.json", "summary.txt"]


# ----------------------------------------------------------------------------- exit launch


def test_exit_climbs_the_ladder_and_ends_every_rank_with_the_documented_code(exit_job):
    assert exit_job.returncodes == {0: EXIT_CODE, 1: EXIT_CODE} and EXIT_CODE == 75
    # Whichever rank exits first takes the store with it (rank 0 hosts it): the other may also
    # write a store incident before its own exit rung.
    (where,) = [
        p
        for p in incidents(exit_job)
        if json.loads(next(p.glob("rank*.json")).read_text())["incident"]["kind"] == "hang"
    ]
    inc = merged(where)
    assert [(c["rank"], c["phase"]) for c in inc["culprits"]] == [(1, "eval batch=3")]
    ladders = {r: [(a["rung"], a["done"]) for a in dump(where, r)["actions"]] for r in (0, 1)}
    assert ladders[0] == [("report", True), ("raise", False), ("abort", True), ("exit", True)]
    assert ladders[1] == [("report", True), ("raise", True), ("abort", True), ("exit", True)]
    assert dump(where, 0)["actions"][-1]["code"] == EXIT_CODE
    # The stubborn stall swallowed each raise it got: the hang's, and one for each other incident rank 1
    # opened before its exit rung (a store incident once rank 0, which hosts the store, had exited: 2
    # raises in one run of the full suite).
    opened = sum((p / "rank1.json").exists() for p in incidents(exit_job))
    assert 1 <= exit_job[1]["raised"] <= opened, (exit_job[1]["raised"], opened)
    # Each rung waited escalate_after_s (0.4 s) for the hang to clear; the upper bound is a hang guard
    # (3x the 1.3 s once asserted). A rung is stamped with the tick's reading its wait counts from, so
    # load lengthens the wait and never shortens it (stamped later in the tick, two rungs of a loaded
    # fresh clone came 0.265 s apart); 0.01 s allows for the wall clock's steps against the monotonic one.
    times = [a["time"] for a in dump(where, 0)["actions"]]
    assert 0.39 <= times[2] - times[1] < 4.0 and 0.39 <= times[3] - times[2] < 4.0, times
