"""``python -m ncclguard status`` during a desync (ncclguard/cli/status_read.py ``mark_waits``): a
rank waiting in an op, seen from its heartbeat's recorded op or from its backend numbers, and the
rank it waits for, shown as the culprit with the verdict's judgment, at 80 columns. Heartbeats are
made here and put in a real TCPStore; no process is launched."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ncclguard.cli import main
from ncclguard.cli.status import EXIT_CODES
from ncclguard.cli.status_read import RankRow, mark_waits
from ncclguard.incidents.model import Heartbeat
from ncclguard.store.keys import index_key
from ncclguard.watching.base.index import WatchIndex


@pytest.fixture(scope="module")
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store
    del store


def publish(server, session: str, beats: list[Heartbeat], heartbeat_s: float = 1.0) -> None:
    idx = WatchIndex(
        run_id="run-a", restart="0", session=session, generation=0, world_size=len(beats), heartbeat_s=heartbeat_s,
        peer_timeout_s=30.0, hang_timeout_s=10.0, written=time.time(),
    )  # fmt: skip
    server.set(index_key(session), idx.model_dump_json())
    for hb in beats:
        server.set(idx.keys.heartbeat(hb.rank), hb.model_dump_json())


def beat(rank: int, now: float, **kw) -> Heartbeat:
    fields = {
        "rank": rank, "host": "node", "pid": 100 + rank, "beat": 14, "time": now, "phase": "",
        "site": "ddp_hang.py:51", "last_seq": {}, "last_completed": {}, "inflight": [], **kw,
    }  # fmt: skip
    return Heartbeat(**fields)


JUDGED = "stuck: nothing moved for 6.0 s (cpu, threads, children, net, io, ops, stack); at ddp_hang.py:27"


def test_the_ddp_hang_at_80_columns_shows_the_waiting_rank_and_the_culprit(server, capsys, monkeypatch) -> None:
    # docs/examples/ddp_hang.py 14 s in: rank 0 in DDP's all_reduce #12 (issued from C++: nothing in
    # Python's records), rank 1 in evaluate() at #11.
    now = time.time()
    publish(
        server,
        "desync",
        [
            beat(0, now - 0.5, backend_seq={"0": 12}, backend_still={"0": 8.5}, judged={"1": JUDGED}),
            beat(1, now - 0.5, site="ddp_hang.py:27", backend_seq={"0": 11}, backend_still={"0": 9.0}),
        ],
    )
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "desync"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert code == EXIT_CODES["suspect"] and max(len(line) for line in lines) <= 80, out
    head = next(i for i, line in enumerate(lines) if line.startswith("ranks "))
    rows = lines[head + 1 : head + 3]
    assert rows[0].split()[:3] == ["0", "1", "waiting"] and "s backend op #12" in rows[0], out
    assert rows[1].split()[:4] == ["1", "1", "culprit", "stuck"] and "at ddp_hang.py" in rows[1], out
    assert not any(" ok " in row for row in rows)
    assert "  - ranks 0 wait in backend op #12 on 0 (up to " in out and "s) for ranks 1, which have not" in out
    assert "  - rank 1 is stuck: nothing moved for 6.0 s" in out


def row(rank: int, **kw) -> RankRow:
    return RankRow.model_validate({"rank": rank, "state": "ok", "age_s": 0.5, **kw})


def test_waits_from_recorded_ops_and_from_backend_numbers_and_what_is_no_wait() -> None:
    recorded = [
        row(0, last_seq={"0": 7}, op_key=("0", 7), inflight="all_reduce(SUM) #7 on 0", inflight_s=30.0),
        row(1, last_seq={"0": 7}, op_key=("0", 7), inflight="all_reduce(SUM) #7 on 0", inflight_s=29.0),
        row(2, last_seq={"0": 6}, judged={}),
    ]
    recorded[1].judged = {"2": "moving: moved 0.4 s ago: net +1.2 MB; at upload.py:9"}
    mark_waits(recorded, 5.0)
    assert [(r.state, r.waits_for, r.waited_by) for r in recorded] == [
        ("waiting", [2], []),
        ("waiting", [2], []),
        ("culprit", [], [0, 1]),
    ]
    assert recorded[2].judgment is not None and recorded[2].judgment.startswith("moving: ")
    skew = [  # a healthy step: numbers differ for less than two beats
        row(0, backend_seq={"0": 41}, backend_still={"0": 0.3}),
        row(1, backend_seq={"0": 40}, backend_still={"0": 0.2}),
    ]
    mark_waits(skew, 1.0)
    assert [r.state for r in skew] == ["ok", "ok"]
    computing = [  # a long step with no op: the numbers agree
        row(0, backend_seq={"0": 40}, backend_still={"0": 60.0}),
        row(1, backend_seq={"0": 40}, backend_still={"0": 61.0}),
    ]
    mark_waits(computing, 1.0)
    assert [r.state for r in computing] == ["ok", "ok"]
    stale = [  # a stale rank keeps its state; a waiting rank is only marked while it beats
        row(0, state="stale", backend_seq={"0": 12}, backend_still={"0": 60.0}),
        row(1, backend_seq={"0": 11}, backend_still={"0": 60.0}),
    ]
    mark_waits(stale, 1.0)
    assert [r.state for r in stale] == ["stale", "ok"]
    deepspeed = [  # the copy of the world "1" moves; the default group "0" stands everywhere
        row(0, backend_seq={"0": 3, "1": 57}, backend_still={"0": 300.0, "1": 40.0}),
        row(1, backend_seq={"0": 3, "1": 56}, backend_still={"0": 300.0, "1": 41.0}),
    ]
    mark_waits(deepspeed, 1.0)
    assert [r.state for r in deepspeed] == ["waiting", "culprit"] and deepspeed[0].inflight == "backend op #57 on 1"


def test_a_rank_whose_watchdog_stopped_on_purpose_is_finished_not_stale(server, capsys) -> None:
    # Rank 1 ended its script 40 s ago (past peer_timeout_s, 30 s): its last heartbeat says finished.
    # Rank 2 went silent as long ago without saying so: stale, and the job is suspect for it alone.
    # Heartbeats every 5 s: rank 0's, 0.5 s old, is "ok" up to 15 s, whatever the load on this machine
    # between the publication and the read (at 1 s a loaded run once read it "late").
    now = time.time()
    publish(
        server, "ending", [beat(0, now - 0.5), beat(1, now - 40, finished=True), beat(2, now - 40)], heartbeat_s=5.0
    )
    code = main(["status", "--store", f"127.0.0.1:{server.port}", "--session", "ending"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("ranks "))
    states = [line.split()[2] for line in lines[head + 1 : head + 4]]
    assert states == ["ok", "finished", "stale"], out
    assert code == EXIT_CODES["suspect"] and "heartbeat stopped: ranks 2" in out, out
