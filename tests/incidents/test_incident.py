"""The culprit analysis, the merged report and `python -m ncclguard report`, on statements written
out by hand (the shapes the watchdog publishes; tests/watching/test_watchdog_multirank.py gets them from
real ranks)."""

from __future__ import annotations

import json

import pytest

from ncclguard.cli import main
from ncclguard.incidents.files import analyse, load_incident, merge, rank_ranges, render, write_json

NOW = 1_000_000.0


def rec(
    seq: int,
    op: str = "all_reduce(SUM)",
    *,
    group: str = "0",
    numel: int = 4,
    dtype: str = "float32",
    age: float = 10.0,
    phase: str = "train step=3",
    site: str = "/job/train.py:40",
) -> dict:
    return {
        "seq": seq,
        "op": op,
        "group": group,
        "numel": numel,
        "dtype": dtype,
        "start": NOW - age,
        "state": "started",
        "end": None,
        "phase": phase,
        "site": site,
        "error": None,
        "async_op": False,
        "peer": None,
        "thread": 1,
    }


def statement(
    rank: int,
    *,
    last: dict | None = None,
    done: dict | None = None,
    inflight: list | None = None,
    phase: str = "train step=3",
    site: str = "/job/train.py:40",
    groups: dict | None = None,
    world: int = 4,
) -> dict:
    inflight = inflight or []
    return {
        "rank": rank,
        "host": "node1",
        "pid": 100 + rank,
        "beat": 7,
        "time": NOW,
        "phase": phase,
        "site": site,
        "last_seq": last or {},
        "last_completed": done or {},
        "inflight": inflight,
        "blocked_in": inflight[0] if inflight else None,
        "world_size": world,
        "stack": ["/job/main.py:10 in <module>: main()", f"{site} in loop: step()"],
        "recent": [],
        "groups": groups or {"0": list(range(world))},
        "peers": {},
    }


def waiting(rank: int, seq: int, world: int = 4, **kw) -> dict:
    return statement(rank, last={"0": seq}, done={"0": seq - 1}, inflight=[rec(seq, **kw)], world=world)


def test_rank_ranges():
    assert rank_ranges([0, 1, 2, 3, 4, 5, 7]) == "0-5,7"
    assert rank_ranges([3, 1, 0, 5, 6, 7]) == "0-1,3,5-7"
    assert rank_ranges([2]) == "2"
    assert rank_ranges([]) == ""


def test_the_seeds_desync_names_rank_6_and_where_it_is():
    world = 8
    sts = {
        r: waiting(r, 56731, world, numel=467019003, age=600.0, phase="train step=1201") for r in range(world) if r != 6
    }
    sts[6] = statement(
        6, last={"0": 56730}, done={"0": 56730}, phase="eval batch=37", site="/job/eval.py:88", world=world
    )
    out = analyse(sts, {}, {}, world, now=NOW, waiting_after_s=5.0)
    assert out["summary"] == (
        "ranks 0-5,7 waiting in all_reduce(SUM) #56731 (467019003 x float32, phase train step=1201) for 600.0 s; "
        "rank 6 last completed #56730, now in phase eval batch=37 at eval.py:88"
    )
    assert out["victims"] == [0, 1, 2, 3, 4, 5, 7]
    assert [(c["rank"], c["why"], c["phase"], c["site"], c["last_completed"]) for c in out["culprits"]] == [
        (6, "behind", "eval batch=37", "/job/eval.py:88", 56730)
    ]
    (finding,) = out["findings"]
    assert (finding["kind"], finding["group"], finding["seq"], finding["waiting"]) == (
        "desync",
        "0",
        56731,
        [0, 1, 2, 3, 4, 5, 7],
    )


def test_ranks_in_the_same_place_are_named_together():
    sts = {0: waiting(0, 12)}
    for r in (1, 2, 3):
        sts[r] = statement(r, last={"0": 11}, done={"0": 11}, phase="eval batch=7", site="/job/eval.py:88")
    out = analyse(sts, {}, {}, 4, now=NOW, waiting_after_s=5.0)
    assert out["summary"] == (
        "rank 0 waiting in all_reduce(SUM) #12 (4 x float32, phase train step=3) for 10.0 s; "
        "ranks 1-3 last completed #11, now in phase eval batch=7 at eval.py:88"
    )
    text = render(
        merge(
            {"id": "x", "kind": "hang", "reason": "r", "by": 0, "created": NOW, "group": "0", "seq": 12},
            sts,
            {},
            {},
            4,
            merged_by=0,
            waiting_after_s=5.0,
        )
    )
    assert (
        "  ranks 1-3 (host:pid node1:101, node1:102, node1:103): not in the collective the others wait in (#12 on group 0); last completed #11"
        in text
    )
    assert text.count("main-thread stack of rank") == 1


def test_a_culprit_waiting_in_another_collective_is_shown_there():
    sts = {r: waiting(r, 12) for r in (0, 1, 2)}
    sts[3] = statement(
        3,
        last={"0": 11, "5": 4},
        done={"0": 11, "5": 3},
        inflight=[rec(4, "broadcast", group="5", numel=10, phase="eval batch=2", site="/job/eval.py:51")],
        groups={"0": [0, 1, 2, 3], "5": [1, 3]},
    )
    out = analyse(sts, {}, {}, 4, now=NOW, waiting_after_s=5.0)
    assert out["summary"].startswith(
        "ranks 0-2 waiting in all_reduce(SUM) #12 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 3 last completed #11, now in broadcast #4 on group 5 (phase eval batch=2) at eval.py:51"
    )
    # Group 5: rank 3 waits in #4 for rank 1, which never issued it: rank 1 is a culprit there.
    assert [(c["rank"], c["why"], c["group"]) for c in out["culprits"]] == [(1, "behind", "5"), (3, "behind", "0")]


def test_ranks_that_disagree_at_the_same_number_are_a_mismatch():
    sts = {r: waiting(r, 5) for r in (0, 1, 2)}
    sts[3] = waiting(3, 5, op="broadcast", numel=10, site="/job/eval.py:9")
    out = analyse(sts, {}, {}, 4, now=NOW, waiting_after_s=5.0)
    (finding,) = out["findings"]
    assert finding["kind"] == "mismatch" and finding["suspects"] == [3]
    assert [v["ranks"] for v in finding["variants"]] == [[0, 1, 2], [3]]
    assert [(c["rank"], c["why"]) for c in out["culprits"]] == [(3, "mismatch")]
    assert out["victims"] == [0, 1, 2]
    assert out["summary"] == (
        "ranks disagree at all_reduce(SUM) #5: ranks 0-2 in all_reduce(SUM) (4 x float32) at train.py:40; "
        "rank 3 in broadcast (10 x float32) at eval.py:9"
    )


def test_everyone_in_the_same_collective_is_a_stuck_transport_not_a_desync():
    sts = {r: waiting(r, 5) for r in range(4)}
    out = analyse(sts, {}, {}, 4, now=NOW, waiting_after_s=5.0)
    assert [f["kind"] for f in out["findings"]] == ["stuck"]
    assert out["culprits"] == [] and out["victims"] == [0, 1, 2, 3]
    assert out["summary"].endswith("every member is there: a stuck transport, not a desync")


def test_a_lost_rank_during_a_desync_comes_from_its_last_heartbeat():
    sts = {r: waiting(r, 5) for r in (0, 1, 2)}
    heartbeat = statement(3, last={"0": 4}, done={"0": 4}, phase="eval batch=1", site="/job/eval.py:20")
    out = analyse(sts, {3: heartbeat}, {3: 9.04}, 4, now=NOW, waiting_after_s=5.0)
    assert out["summary"] == (
        "ranks 0-2 waiting in all_reduce(SUM) #5 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 3 lost (no heartbeat for 9.0 s), last completed #4"
    )
    assert [(c["rank"], c["why"], c["stale_s"]) for c in out["culprits"]] == [(3, "lost", 9.0)]
    assert out["lost"] == [3]


def test_a_rank_behind_the_others_but_ahead_of_the_one_behind_it_waits_for_it_a_victim_not_a_culprit():
    # 4 ranks (the stuck drill's): 1 and 3 wait in the backward's #12; rank 0 waits in #9, a broadcast
    # relayed through rank 2, which never issued #9: #9 cannot complete on rank 0, which waits for rank 2.
    sts = {r: waiting(r, 12) for r in (1, 3)}
    sts[0] = waiting(0, 9, op="broadcast", phase="train step=3")
    sts[2] = statement(2, last={"0": 8}, done={"0": 8}, site="/job/train.py:30")
    out = analyse(sts, {}, {}, 4, now=NOW, waiting_after_s=5.0)
    assert [(c["rank"], c["why"], c["last_completed"]) for c in out["culprits"]] == [(2, "behind", 8)]
    assert out["victims"] == [0, 1, 3]
    (finding,) = out["findings"]
    assert [b["rank"] for b in finding["behind"]] == [0, 2]  # where each stands, as it was
    # Rank 2 stopped (SIGSTOP: no heartbeat since): lost, and rank 0 still its victim.
    stopped = {r: sts[r] for r in (0, 1, 3)}
    out = analyse(stopped, {2: sts[2]}, {2: 12.0}, 4, now=NOW, waiting_after_s=5.0)
    assert [(c["rank"], c["why"]) for c in out["culprits"]] == [(2, "lost")]
    assert out["victims"] == [0, 1, 3]


def test_a_lost_rank_alone_makes_the_others_victims_and_its_stale_state_is_not_evidence():
    sts = {r: statement(r, last={"0": 5}, done={"0": 5}, phase="idle", site="/job/loop.py:3") for r in (0, 1, 2)}
    # Its last beat still showed #5 in flight: old news, not a reason to call the others "behind".
    heartbeat = statement(3, last={"0": 5}, done={"0": 4}, inflight=[rec(5, age=30.0)])
    out = analyse(sts, {3: heartbeat}, {3: 2.0}, 4, now=NOW, waiting_after_s=5.0)
    assert [f["kind"] for f in out["findings"]] == ["lost"]
    assert (
        out["summary"]
        == "rank 3 lost: no heartbeat for 2.0 s, last seen in all_reduce(SUM) #5 (phase train step=3) at train.py:40"
    )
    assert out["victims"] == [0, 1, 2]


def test_young_ops_in_flight_are_not_a_hang():
    sts = {r: waiting(r, 5, world=3, age=0.01) for r in (0, 1)}
    sts[2] = statement(2, last={"0": 4}, done={"0": 4}, world=3)
    out = analyse(sts, {}, {}, 3, now=NOW, waiting_after_s=1.0)
    assert out["findings"] == [] and out["culprits"] == []
    assert out["summary"] == "no rank is stuck in a collective and every peer is alive"


def test_a_rank_that_did_not_answer_is_listed_apart():
    sts = {r: waiting(r, 5, world=3) for r in (0, 1)}
    heartbeat = statement(2, last={"0": 4}, done={"0": 4}, phase="eval", site="/job/eval.py:5", world=3)
    out = analyse(sts, {2: heartbeat}, {}, 3, now=NOW, waiting_after_s=5.0)
    assert [f["kind"] for f in out["findings"]] == ["desync", "silent"]
    assert [(c["rank"], c["why"], c["site"]) for c in out["culprits"]] == [(2, "behind", "/job/eval.py:5")]


def test_subgroup_members_only():
    groups = {"0": [0, 1, 2], "3": [0, 1]}
    sts = {
        0: statement(0, last={"3": 1}, inflight=[rec(1, group="3")], groups=groups, world=3),
        1: statement(1, phase="data", site="/job/data.py:7", groups=groups, world=3),
        2: statement(2, phase="eval", site="/job/eval.py:5", groups=groups, world=3),
    }
    out = analyse(sts, {}, {}, 3, now=NOW, waiting_after_s=5.0)
    assert out["summary"] == (
        "rank 0 waiting in all_reduce(SUM) #1 on group 3 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 1 issued nothing on this group yet, now in phase data at data.py:7"
    )
    assert [c["rank"] for c in out["culprits"]] == [1]


def p2p(seq: int, op: str, peer: int, age: float = 10.0, site: str = "/job/pipe.py:30") -> dict:
    return {**rec(seq, op, group="0", age=age, phase="train step=3", site=site), "peer": peer}


def test_a_recv_waiting_for_a_rank_that_never_sends_names_that_rank():
    sts = {
        0: statement(0, last={"0:p2p": 3}, inflight=[p2p(3, "recv", peer=1)], world=2),
        1: statement(1, last={"0:p2p": 2}, done={"0:p2p": 2}, phase="eval", site="/job/eval.py:12", world=2),
    }
    out = analyse(sts, {}, {}, 2, now=NOW, waiting_after_s=5.0)
    assert out["summary"] == (
        "rank 0 waiting in recv from rank 1 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 1 now in phase eval at eval.py:12"
    )
    assert [(c["rank"], c["why"], c["waiter"]) for c in out["culprits"]] == [(1, "p2p", 0)]
    assert out["victims"] == [0]


def test_two_ranks_sending_to_each_other_are_a_deadlock_without_culprit():
    sts = {
        0: statement(0, inflight=[p2p(1, "send", peer=1)], world=2),
        1: statement(1, inflight=[p2p(1, "send", peer=0)], world=2),
    }
    out = analyse(sts, {}, {}, 2, now=NOW, waiting_after_s=5.0)
    assert out["culprits"] == [] and out["victims"] == [0, 1]
    assert out["summary"].startswith(
        "rank 0 waiting in send to rank 1 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 1 waits back in send: a point-to-point deadlock"
    )


def test_a_send_met_by_its_peers_receive_is_a_transfer_under_way_not_a_deadlock():
    """A snapshot swap as the 100M-parameter drill's watchdog saw it: every rank sends to the next and
    receives from the one before, 800 MB each way, for seconds. The peer's receive is posted."""
    sts = {
        0: statement(0, inflight=[p2p(1, "isend", peer=1), p2p(2, "irecv", peer=2)], world=3),
        1: statement(1, inflight=[p2p(1, "isend", peer=2), p2p(2, "irecv", peer=0)], world=3),
        2: statement(2, inflight=[p2p(1, "isend", peer=0), p2p(2, "irecv", peer=1)], world=3),
    }
    out = analyse(sts, {}, {}, 3, now=NOW, waiting_after_s=5.0)
    assert out["culprits"] == [] and out["victims"] == [0, 1, 2]
    assert "deadlock" not in out["summary"].replace("not a deadlock", "")
    assert out["summary"].startswith(
        "rank 0 waiting in isend to rank 1 (4 x float32, phase train step=3) for 10.0 s; "
        "rank 1 has its irecv posted: the transfer is under way (a large message or a slow link), not a deadlock"
    )


def _dumps(tmp_path):
    """Rank dumps as the watchdog writes them, without the merged file (its merger died)."""
    sts = {
        0: waiting(0, 12, world=2),
        1: statement(1, last={"0": 11}, done={"0": 11}, phase="eval batch=7", site="/job/eval.py:88", world=2),
    }
    doc = {
        "id": "20250101-000000-001",
        "kind": "hang",
        "reason": "rank 0 waited 10.0 s in all_reduce(SUM) #12",
        "by": 0,
        "created": NOW,
        "group": "0",
        "seq": 12,
        "n": 1,
    }
    where = tmp_path / "incidents" / doc["id"]
    for r, st in sts.items():
        write_json(
            where / f"rank{r}.json",
            {
                "kind": "ncclguard-rank-dump",
                "version": 1,
                "incident": doc,
                "statement": st,
                "threads": {},
                "records": [],
                "heartbeats": {},
                "waiting_after_s": 5.0,
                "actions": [],
            },
        )
    return where


def test_report_merges_rank_dumps_when_no_merged_file_was_written(tmp_path, capsys):
    where = _dumps(tmp_path)
    incident, found, merged_here = load_incident(tmp_path / "incidents")  # the root: newest incident
    assert (found, merged_here, incident["merged_by"]) == (where, True, -1)
    assert main(["report", str(where)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"(no incident.json in {where}: merged here from its rank dumps")
    assert "rank 0 waiting in all_reduce(SUM) #12 (4 x float32, phase train step=3) for " in out
    assert "rank 1 last completed #11, now in phase eval batch=7 at eval.py:88" in out
    assert "CULPRITS (not where the others are)\n  rank 1 (host:pid node1:101): not in the collective" in out
    assert "merged by `ncclguard report` from the statements of 2/2 ranks" in out


def test_report_json_and_list(tmp_path, capsys):
    where = _dumps(tmp_path)
    incident = merge(
        json.loads((where / "rank0.json").read_text())["incident"],
        {0: waiting(0, 12, world=2), 1: statement(1, last={"0": 11}, done={"0": 11}, world=2)},
        {},
        {},
        2,
        merged_by=0,
        waiting_after_s=5.0,
    )
    write_json(where / "incident.json", incident)
    assert main(["report", "--json", str(where)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((where / "incident.json").read_text())
    assert main(["report", "--list", str(tmp_path / "incidents")]) == 0
    assert capsys.readouterr().out == f"20250101-000000-001  2 rank dump(s)  {incident['summary']}\n"


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda p: p / "nowhere", "is not a directory"),
        (lambda p: p, "no incident under"),
    ],
)
def test_report_explains_a_wrong_directory(tmp_path, capsys, make, phrase):
    assert main(["report", str(make(tmp_path))]) == 2
    assert phrase in capsys.readouterr().out


def test_report_refuses_a_file_that_is_not_an_incident(tmp_path, capsys):
    (tmp_path / "incident.json").write_text(json.dumps({"kind": "something-else"}))
    assert main(["report", str(tmp_path)]) == 2
    assert "is not an ncclguard incident" in capsys.readouterr().out
