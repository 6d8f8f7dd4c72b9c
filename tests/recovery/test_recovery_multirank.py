"""rebuild_world on real gloo ranks: after a timeout, after a SIGKILL, with a rank that does not
come, 20 times in a row, with the job's store gone, and with a member's handshake failing.

Launches (tests/workers/recovery_worker.py), each 3 ranks:
``timeout_and_loop`` torchrun: bad arguments refused before any communication; rank 2 skips an all_reduce,
    ranks 0-1 time out, every rank rebuilds and collectives and DDP work; then 20 such failures and rebuilds
    in a row, with threads, descriptors, memory and store keys counted before and after.
``killed`` spawn: rank 1 is SIGKILLed; without ``allow_shrink`` ranks 0 and 2 get a falsy result naming it
    and nothing changes; with it they go on as a world of 2.
``absent`` spawn: rank 2, alive, comes after ranks 0-1 gave up (falsy for all, rank 2 late); all three then
    rebuild together; then ranks 0-1 time out on an op rank 2 never joins and shrink without it, and rank 2,
    arriving late, is left out.
``store_lost`` spawn: rank 0, whose process serves the job's store, is SIGKILLed; ranks 1-2's rebuild is
    falsy at once and says the store did not answer.
``handshake`` torchrun, 2 ranks, the world made with every default: rank 1's handshake into the rebuilt
    world fails; rank 0, which records the world, gives up within the rebuild's timeout, and rank 1 waits
    its bound out; with no group, neither commits nor reduces; a second rebuild brings both into generation 2.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank
# Hang guard for a refusal that comes at once (milliseconds measured) and not at its own 20 s timeout:
# over 3x the 4 s a loaded fresh-clone run once took for one store answer.
AT_ONCE_GUARD_S = 15.0


@pytest.fixture(scope="module")
def timeout_job():
    # 3 ranks: failure, rebuild, checks, DDP, then 20 failures and rebuilds (about 30 s here, 62 s
    # at load average 11). Hang guard: over 3x that.
    return run_ranks("recovery_worker", 3, "timeout_and_loop", timeout_s=200)


@pytest.fixture(scope="module")
def killed_job():
    # Hang guards: over 3x the 29 s and 23 s of loaded runs.
    return run_ranks("recovery_worker", 3, "killed", launcher="spawn", expect_rc={1: -9}, timeout_s=120)


@pytest.fixture(scope="module")
def absent_job():
    return run_ranks("recovery_worker", 3, "absent", launcher="spawn", timeout_s=120)


@pytest.fixture(scope="module")
def handshake_job():
    # 2 ranks: one rebuild whose handshake fails on rank 1 (about 6 s here). Hang guard: the bound
    # rank 0 had before (450 s) ends the launch instead.
    return run_ranks("recovery_worker", 2, "handshake", timeout_s=90)


def assert_world(checks: dict, rank: int, size: int, launch_ranks: list[int]) -> None:
    assert checks == {
        "rank": rank,
        "world_size": size,
        "plain": True,
        "safe": True,
        "chunked": True,
        "barrier": True,
        "launch_ranks": True,
    }, launch_ranks


def test_bad_arguments_are_refused_before_any_communication(timeout_job):
    for rank in range(3):
        bad = timeout_job[rank]["bad_args"]
        assert {k: v[0] for k, v in bad.items()} == {
            "timeout_zero": "ValueError",
            "timeout_negative": "ValueError",
            "timeout_nan": "ValueError",
            "timeout_str": "TypeError",
            "shrink_str": "TypeError",
            "shrink_int": "TypeError",
        }
        assert "pass e.g. timeout=" in bad["timeout_zero"][1]
        assert timeout_job[rank]["bad_args_no_arrival"] is True


def test_after_a_timeout_the_world_is_rebuilt_and_everything_works(timeout_job):
    for rank in (0, 1):
        assert timeout_job[rank]["failure"] == {"ok": False, "type": "CollectiveTimeout", "refused": True}
    for rank in range(3):
        r = timeout_job[rank]
        rebuilt = r["rebuild"]
        assert rebuilt["ok"] is True and rebuilt["bool"] is True
        assert (rebuilt["generation"], rebuilt["rank"], rebuilt["world_size"]) == (1, rank, 3)
        assert rebuilt["rank_map"] == {"0": 0, "1": 1, "2": 2}
        assert rebuilt["missing"] == [] and rebuilt["error"] is None
        assert rebuilt["elapsed"] < 10  # hang guard: a rebuild with every rank alive takes milliseconds
        assert r["generation"] == 1
        assert r["recorder_after"] == {"records": 0, "seq": {}}  # the abandoned ops are forgotten
        assert r["new_timeout_s"] == 20.0  # the old world's collective timeout, not the handshake's
        assert r["callback"][0] == [1, 3, True]
        assert r["old_group_replaced"] is True
        assert_world(r["world"], rank, 3, [0, 1, 2])
        assert r["ddp"]["equal_across_ranks"] is True
        assert r["ddp"]["matches_reference"] is True, r["ddp"]
        # The abandoned world was released by the reaper (its DDP-era references included).
        assert r["reaper_idle_before"] is True and r["old_group_freed"] is True


def test_twenty_rebuilds_leave_threads_sockets_memory_and_store_keys_bounded(timeout_job):
    for rank in range(3):
        r = timeout_job[rank]
        assert r["sync_before_loop"] is True
        assert r["loop"]["all_ok"] is True and r["loop"]["all_exact"] is True
        assert len(r["loop"]["rebuild_to_good_s"]) == 20
        assert r["loop"]["callbacks"] == 21
        assert r["nn_functional_sum"] == [6.0, 6.0]
        assert r["reaper_idle_after"] is True
        before, after, peak = (r["resources"][k] for k in ("before", "after", "peak"))
        # Stated bound: once the reaper is idle, at most one thread and two descriptors more than
        # before the 20 rebuilds (measured: equal), and 16 MiB of resident memory (measured:
        # under 1 MiB). Each gloo group has 3 threads: the reaper frees abandoned groups during
        # the loop, not only at its end, so never are all 20 alive at once (measured: at most 3 on
        # a quiet machine, 12 under a CI run beside other jobs).
        assert after["threads"] <= before["threads"] + 1, r["resources"]
        assert after["fds"] <= before["fds"] + 2, r["resources"]
        assert after["rss_kib"] - before["rss_kib"] <= 16 * 1024, r["resources"]
        assert peak["threads"] < before["threads"] + 3 * 20, r["resources"]
        # One verdict key per rebuild stays; everything else of the old generations is deleted.
        keys = r["store_keys"]
        assert keys["after"] - keys["before"] <= 20 + 6, keys


def test_a_killed_rank_is_named_without_shrink_and_left_out_with_it(killed_job):
    assert sorted(killed_job.results) == [0, 1, 2]  # rank 1 saved before it was killed
    for rank, new_rank in ((0, 0), (2, 1)):
        r = killed_job[rank]
        assert r["failure"]["ok"] is False
        refused = r["no_shrink"]
        assert refused["ok"] is False and refused["bool"] is False
        assert refused["missing"] == [1] and "ranks [1] did not reach rebuild_world" in refused["error"]
        assert refused["wall"] < 7.0  # hang guard: 3x the 2.0 s (the timeout) loaded runs took
        assert r["unchanged"] == {"same_group": True, "world_size": 3, "rank": rank, "generation": 0}
        shrunk = r["shrink"]
        assert shrunk["ok"] is True
        assert (shrunk["generation"], shrunk["rank"], shrunk["world_size"]) == (1, new_rank, 2)
        assert shrunk["rank_map"] == {"0": 0, "2": 1} and shrunk["missing"] == [1]
        assert shrunk["wall"] < 7.0  # hang guard: 3x the 2.0 s measured
        assert_world(r["world"], new_rank, 2, [0, 2])
        assert r["ddp"]["equal_across_ranks"] is True and r["ddp"]["matches_reference"] is True


def test_a_rank_that_does_not_call_is_named_and_a_late_one_is_told(absent_job):
    for rank in (0, 1):
        r = absent_job[rank]
        assert r["absent"]["ok"] is False and r["absent"]["missing"] == [2] and r["absent"]["late"] is False
        assert r["absent"]["wall"] < 7.0  # the 2 s timeout: 2.0 s measured; 3x hang guard
        assert "ranks [2] did not reach rebuild_world within 2 s" in r["absent"]["error"]
        assert r["unchanged"] == {"same_group": True, "world": 3}
    late = absent_job[2]["absent"]
    # At once, not at its own 20 s timeout (milliseconds measured). The bound only has to tell the two
    # apart: 15 s leaves a loaded machine's stalls room (a store answer took over 4 s in one fresh-clone run).
    assert late["ok"] is False and late["late"] is True and late["elapsed"] < AT_ONCE_GUARD_S
    assert "gave up waiting for ranks 2" in late["error"]
    # Every rank calls again: the attempts line up and the world of 3 is rebuilt.
    for rank in range(3):
        r = absent_job[rank]
        assert r["together"]["ok"] is True and r["together"]["generation"] == 1
        assert_world(r["world3"], rank, 3, [0, 1, 2])
    # Ranks 0-1 shrink; rank 2 comes after them and is told it was left out.
    for rank in (0, 1):
        r = absent_job[rank]
        assert r["stalled_failure"] is False
        assert r["left_out"]["ok"] is True and r["left_out"]["world_size"] == 2
        assert r["left_out"]["generation"] == 2 and r["left_out"]["missing"] == [2]
        # Never waits on the stalled peer: the rebuild takes its timeout, the old group's
        # destructor (blocked on the queued op) runs on the reaper's thread meanwhile. (Rank 2
        # leaves only after this; the group's own timeout is 20 s.) Hang guard: 3x the 2.0 s measured.
        assert r["left_out"]["wall"] < 7.0
        assert r["reaper_busy_with_the_old_group"] >= 1
        assert_world(r["world2"], rank, 2, [0, 1])
        assert r["reaper_idle_once_rank2_left"] is True
    gone = absent_job[2]["left_out"]
    # At once, not at its own 20 s timeout (milliseconds measured; 15 s as above).
    assert (
        gone["ok"] is False and gone["late"] is True and gone["generation"] == 1 and gone["elapsed"] < AT_ONCE_GUARD_S
    )
    assert "had gone on to generation 2 without it" in gone["error"]


def test_a_lost_store_gives_a_falsy_result_at_once():
    # Under this launcher rank 0's process serves the job's store (under torchrun the agent does).
    job = run_ranks("recovery_worker", 3, "store_lost", launcher="spawn", expect_rc={0: -9}, timeout_s=60)
    for rank in (1, 2):
        lost = job[rank]["lost"]
        assert lost["ok"] is False and lost["wall"] < 3
        assert "the job's store did not answer" in lost["error"] and "exit 75" in lost["error"]
        assert (lost["generation"], lost["world_size"]) == (0, 3)


def test_a_failed_rebuild_carries_a_rebuild_failed_that_agrees_with_its_result(absent_job, killed_job):
    failed = [absent_job[r]["absent"] for r in range(3)] + [killed_job[r]["no_shrink"] for r in (0, 2)]
    failed.append(absent_job[2]["left_out"])
    for res in failed:
        assert res["ok"] is False and res["error_type"] == "RebuildFailed" and res["error_fields_agree"] is True
    assert absent_job[0]["together"]["error_type"] is None and absent_job[0]["together"]["error"] is None


def test_the_rank_that_records_the_world_gives_up_its_handshake_within_the_rebuilds_timeout(handshake_job):
    """tests/workers/recovery_worker.py ``handshake``: the world made with every default, rank 1's
    handshake into the rebuilt world fails, and rank 0 (the recorder) gives up within the caller's
    4 s, not a quarter of the world's 1,800 s: its next meeting finds the others still there."""
    assert handshake_job[0]["world_timeout_s"] == 1800.0
    failed = handshake_job[1]["rebuild"]
    assert failed["ok"] is False and "injected: this rank's handshake failed" in failed["error"], failed
    recorder = handshake_job[0]["rebuild"]
    assert recorder["ok"] is False and recorder["bool"] is False, recorder
    assert "the new group of generation 1 could not be built" in recorder["error"], recorder
    # The bound is max(time left, 4 / 4, 2 s) after the meeting: about 4 s. 30 s: a hang guard
    # (7x), far under the 450 s the recorder's bound was.
    assert recorder["wall"] < 30.0, recorder
    # Rank 1, whose handshake failed at once, waited the bound out (at least its 2 s floor): left
    # at once, it met again about 4 s before rank 0, whose arrival then came as its 4 s ran out.
    assert failed["wall"] >= 2.0, failed


def test_after_a_failed_handshake_no_rank_commits_alone_and_a_second_rebuild_brings_the_world_back(handshake_job):
    """The same launch: neither rank has a group after the failed handshake; ``should_commit`` is
    falsy on both without communicating (it used to commit each rank as a world of one), naming
    both and saying what to do, and so are ``safe_all_reduce`` and ``safe_barrier``; ``rebuild_world`` called again with the same timeout makes
    generation 2 of both ranks, whose all_reduce and commit work."""
    for r in (0, 1):
        res = handshake_job[r]
        assert res["initialized"] is False
        commit = res["no_group_commit"]
        assert commit["ok"] is False and commit["failed"] == [0, 1], commit
        why = "world generation 1 has no process group (the handshake of the rebuild that made it failed)"
        assert why + ": call rebuild_world again on every rank" in commit["error"], commit
        # Neither a world of one: nothing reduced, the barrier not met.
        reduced = res["no_group_reduce"]
        assert (reduced["ok"], reduced["error"], reduced["tensor"]) == (False, "GroupFailed", [r + 1.0] * 4), reduced
        met = res["no_group_barrier"]
        assert (met["ok"], met["error"]) == (False, "BarrierFailed") and why in met["message"], met
        again = res["again"]
        assert (again["ok"], again["generation"], again["world_size"], again["rank"]) == (True, 2, 2, r), again
        assert res["sum"] == 3.0 and res["commit"] is True
