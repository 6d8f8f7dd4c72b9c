"""The World across changes, on real gloo ranks: after a same-size rebuild and after a shrink that
leaves a live rank out, the watchdog follows the new world and reports in its numbering.

Launches (tests/workers/world_worker.py):
``same_size`` 3 ranks, spawn: every rank rebuilds (generation 1, same numbers); rank 2 then evaluates while
    ranks 0-1 wait in an instrumented all_reduce: the merged hang incident names rank 2, ranks 0-1 its victims.
``shrink`` 4 ranks, spawn: rank 1, alive, comes late to the rebuild and is left out; old ranks 0, 2, 3 become
    0, 1, 2; new rank 1 evaluates while 0 and 2 wait in an all_reduce Python does not record
    (instrument=False): a desync reported in the new numbering, without the left-out rank."""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def same_size_job():
    return run_ranks("world_worker", 3, "same_size", launcher="spawn", timeout_s=120)


@pytest.fixture(scope="module")
def shrink_job():
    return run_ranks("world_worker", 4, "shrink", launcher="spawn", timeout_s=120)


def test_after_a_same_size_rebuild_the_watchdog_reports_a_hang_in_generation_1(same_size_job):
    for rank in range(3):
        r = same_size_job[rank]
        assert r["rebuild"] == {"ok": True, "generation": 1, "rank": rank, "size": 3}
        assert r["world"] == {"generation": 1, "rank": rank, "size": 3}
        assert r["watchdog_follows"] == {"generation": 1, "rank": rank, "world_size": 3}
        assert r["sum"] == [3.0] * 4
        rep = r["report"]
        assert rep["merged"] is True and rep["count"] == 1
        assert rep["kind"] == "hang" and rep["generation"] == 1
        assert rep["rank_map"] == {"0": 0, "1": 1, "2": 2} and rep["left_out"] == []
        assert "-g1-" in rep["id"]
        assert rep["culprits"] == [2] and rep["victims"] == [0, 1]
        assert rep["world_size"] == 3 and rep["statements_from"] == [0, 1, 2] and rep["missing_statements"] == []
        assert (
            rep["summary_head"][2] == "world generation 1, ranks in its numbering (rebuilt: every rank kept its number)"
        )


def test_a_desync_after_a_shrink_is_reported_in_the_new_numbering_without_the_left_out_rank(shrink_job):
    for old, new in ((0, 0), (2, 1), (3, 2)):
        r = shrink_job[old]
        assert r["rebuild"] == {
            "ok": True,
            "generation": 1,
            "rank": new,
            "size": 3,
            "rank_map": {"0": 0, "2": 1, "3": 2},
            "missing": [1],
        }
        assert r["world"] == {"generation": 1, "rank": new, "size": 3, "left_out": [1]}
        # The watchdog watches the three members under their new numbers.
        assert r["watchdog_follows"] == {"generation": 1, "rank": new, "world_size": 3}
        assert r["sum"] == [3.0] * 4
        rep = r["report"]
        assert rep["merged"] is True and rep["count"] == 1
        # No Python record of the all_reduce (instrument=False): the backend's numbers tell.
        assert rep["kind"] == "desync" and rep["generation"] == 1
        assert rep["rank_map"] == {"0": 0, "2": 1, "3": 2} and rep["left_out"] == [1]
        # New rank 1 (old rank 2) is elsewhere; new ranks 0 and 2 wait for it; merged from 3 of 3.
        assert rep["culprits"] == [1] and rep["victims"] == [0, 2]
        assert rep["world_size"] == 3 and rep["statements_from"] == [0, 1, 2] and rep["missing_statements"] == []
        assert "world generation 1, ranks in its numbering (rebuilt: old rank 2 is rank 1 now, " in rep["summary"]
        assert "old rank 3 is rank 2 now; left out: rank 1)" in rep["summary"]
        assert "from the statements of 3/3 ranks" in rep["summary_head"][1]  # any member may merge
    left = shrink_job[1]
    assert left["rebuild"] == {"ok": False, "late": True, "generation": 0}
    # The left-out rank is in no new world: its watchdog stays in generation 0 until it stops.
    assert left["watchdog_follows"] == {"generation": 0, "rank": 1, "world_size": 4}
