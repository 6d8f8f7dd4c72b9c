"""The watchdog's fence rung on 3 real gloo ranks under torchrun.

Launches (tests/workers/fence_worker.py), each 3 ranks under torchrun, RecoveringStep(allow_shrink=True)
under a watchdog whose top rung is ``fence``, rank 2 stuck for good in a sleep loop at step 2:
``stuck``: rank 2's own watchdog names it the culprit (2 s hang timeout), marks it fenced and exits it with
    status 0; ranks 0-1, blocked in DDP's all_reduce, fail on the closed connection (the group's timeout is
    60 s), their commit fails, and they go on as a world of 2.
``left_behind``: the step bound (1.5 s) ends the survivors' op before any verdict (20 s hang timeout), so
    nobody names rank 2; ranks 0-1 finish as a world of 2 and rank 2's watchdog, seeing their generation 1,
    ends it with status 0 (the left-behind fence).
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

K = 2  # the step at which rank 2 is stuck for good (fence_worker.K)
CLEAN = {"ok": True, "attempts": 1, "rebuilds": 0, "commits": [[True, []]], "error": None}


@pytest.fixture(scope="module")
def fence_job():
    # Hang after 2 s, abort, fence 2 s later, a 3 s commit and a 3 s rebuild: about 15 s of a
    # 25 s run here. Hang guard: over 3x a loaded run's; torchrun must exit 0 (run_ranks checks).
    return run_ranks("fence_worker", 3, "stuck", timeout_s=150)


def test_a_rank_stuck_for_good_is_fenced_and_the_others_go_on_as_a_world_of_two(fence_job):
    pid2 = fence_job[2]["pid"]
    for r in (0, 1):
        res = fence_job[r]
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K]["ok"] is True and steps[K]["attempts"] == 2 and steps[K]["generation"] == 1
        assert steps[K]["world_sizes"] == [3, 2]
        assert steps[K]["commits"][0][0] is False and steps[K]["commits"][1] == [True, []]
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [2]}] * 2
        assert res["final"] == [r, 2]
        assert res["equal_across_ranks"] is True  # bit for bit
        assert res["max_diff_to_reference"] < 1e-12  # 3 ranks' gradients before K, 2 ranks' after
        # The blocked all_reduce failed because rank 2's process went away, not on the group's
        # 60 s timeout: gloo says the peer closed the connection.
        [err] = res["errors"]
        assert err["step"] == K
        assert "Connection closed by peer" in err["error"] or "Connection reset by peer" in err["error"], err
        assert "Timed out" not in err["error"]
        # Rank 2's fence mark, left in the store before it exited.
        note = res["fence_note"]
        assert (note["rank"], note["pid"]) == (2, pid2)
        # The survivors' ladder for the hang: report, abort, and a fence rung that names rank 2.
        first = res["incidents"][0]
        rungs = [(a["rung"], a["done"]) for a in first["actions"]]
        assert rungs[0] == ("report", True)
        fence = [a for a in first["actions"] if a["rung"] == "fence"]
        assert fence == [] or (fence[0]["done"] is False and fence[0]["culprits"] == [2])
    # Rank 2's own dump of the incident says it fenced itself (exit status 0).
    incidents = fence_job.out_dir / "incidents"
    dumps = [json.loads(p.read_text()) for p in sorted(incidents.glob("*/rank2.json"))]
    fenced = [a for d in dumps for a in d["actions"] if a["rung"] == "fence" and a["done"]]
    assert len(fenced) == 1
    assert (fenced[0]["fenced"], fenced[0]["code"], fenced[0]["marked"], fenced[0]["culprits"]) == (True, 0, True, [2])


@pytest.fixture(scope="module")
def left_behind_job():
    # A 1.5 s group timeout, 3 s commit and rebuild, peers silent after 3 s, a 2 s grace: rank 2
    # is gone about 15 s after it got stuck. Hang guard over 5x; torchrun must exit 0.
    return run_ranks("fence_worker", 3, "left_behind", timeout_s=150)


def test_a_stuck_rank_nobody_names_is_fenced_once_the_others_went_on_without_it(left_behind_job):
    """The failure drill's stuck run: the group's timeout ends the survivors' op before any verdict
    names rank 2, so the fence rung never acts on it; its watchdog sees the newer world and ends it."""
    pid2 = left_behind_job[2]["pid"]
    for r in (0, 1):
        res = left_behind_job[r]
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K]["ok"] is True and steps[K]["generation"] == 1 and steps[K]["world_sizes"][-1] == 2
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [2]}] * 2
        assert res["final"] == [r, 2]
        assert res["equal_across_ranks"] is True
        assert res["max_diff_to_reference"] < 1e-12
        [err] = res["errors"]  # the group's own 1.5 s timeout, not a peer's exit
        assert err["step"] == K and "Connection closed by peer" not in err["error"], err
        note = res["fence_note"]
        assert (note["rank"], note["pid"], note["incident"]) == (2, pid2, "left-behind-g0")
        assert res["rank2_gone"] is True
        # No verdict named rank 2 the culprit before the survivors left: no rung of theirs fenced it.
        assert not [i for i in res["incidents"] if any(a["rung"] == "fence" and a.get("done") for a in i["actions"])]
    # Rank 2's own incidents (its peers fell silent) never fenced it by the rung: not the culprit.
    incidents = left_behind_job.out_dir / "incidents"
    dumps = [json.loads(p.read_text()) for p in sorted(incidents.glob("*/rank2.json"))]
    assert not [a for d in dumps for a in d["actions"] if a["rung"] == "fence" and a["done"]]
