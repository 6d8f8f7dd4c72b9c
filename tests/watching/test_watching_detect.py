"""Detectors as pure functions of synthetic snapshots: hangs, lost peers, completion, the op the
main thread is blocked in, and the backend's numbers (a desync, a stuck transport) with the
state of torch's flight recorder on each suspect."""

from __future__ import annotations

import pytest

from ncclguard.incidents.model import BackendOp, IncidentKind, OpRecord
from ncclguard.recording.flight import FlightRecorder
from ncclguard.watching.sensors.detect import (
    Detection,
    OpState,
    SeqView,
    backend_op_state,
    blocked_in,
    completed,
    ended_since,
    find_backend_desync,
    find_backend_stuck,
    find_hangs,
    find_lost,
    op_key,
)

NOW = 1000.0


def rec(seq: int, age: float, *, op: str = "all_reduce(SUM)", group: str = "0", peer=None, **kw) -> OpRecord:
    return OpRecord(
        seq=seq, op=op, group=group, numel=4, dtype="float32", start=NOW - age, site="/job/t.py:5", peer=peer, **kw
    )


def test_an_op_in_flight_past_the_timeout_is_a_hang_once():
    inflight = [rec(3, 10.0), rec(4, 1.0), rec(1, 12.0, group="5")]
    found = find_hangs(2, inflight, NOW, 5.0, reported=set())
    assert [(d.signature, d.op_key) for d in found] == [("hang/0/3", ("0", 3)), ("hang/5/1", ("5", 1))]
    first = found[0]
    assert first.kind is IncidentKind.HANG and first.op == "all_reduce(SUM)"
    assert first.reason == "rank 2 waited 10.0 s in all_reduce(SUM) #3 on group 0 (4 x float32, issued at /job/t.py:5)"
    assert find_hangs(2, inflight, NOW, 5.0, reported={("0", 3), ("5", 1)}) == []
    assert find_hangs(2, inflight, NOW, 30.0, reported=set()) == []


def test_send_recv_hangs_are_numbered_apart_and_signed_per_rank():
    (d,) = find_hangs(1, [rec(2, 9.0, op="recv", peer=0)], NOW, 5.0, set())
    assert (d.signature, d.group, d.op_key) == ("hang/0:p2p/2/r1", "0:p2p", ("0:p2p", 2))
    # A collective #2 on the same group is another op.
    assert op_key(rec(2, 0.0)) == ("0", 2) != d.op_key


def test_peers_that_went_stale_make_one_incident():
    assert find_lost({}) is None
    d = find_lost({5: 7.04, 3: 6.5})
    assert d == Detection(
        IncidentKind.PEERS_LOST, "no heartbeat from rank 3 for 6.5 s, rank 5 for 7.0 s", "lost/3", ranks=(3, 5)
    )
    assert d.op_key is None
    # Each lost rank named with its host where its last beat told it (hosts may share a name: the address).
    named = find_lost({5: 7.04, 3: 6.5}, {3: "nodeB (198.18.0.2)"})
    assert (
        named is not None
        and named.reason == "no heartbeat from rank 3 on nodeB (198.18.0.2) for 6.5 s, rank 5 for 7.0 s"
    )


def test_completed_reads_the_newest_record_of_the_op_and_failed_is_not_completed():
    fr = FlightRecorder(size=10)
    a = fr.start("all_reduce(SUM)", "0", 4, "float32", site="s")
    fr.finish(a)
    b = fr.start("all_reduce(SUM)", "0", 4, "float32", site="s")
    fr.finish(b, RuntimeError("Connection closed by peer"))
    s = fr.start("send", "0", 4, "float32", site="s", peer=1)
    fr.finish(s)
    records = fr.records()
    assert completed(records, ("0", 1)) and not completed(records, ("0", 2))
    assert completed(records, ("0:p2p", 1)) and not completed(records, ("0", 3))
    # The plain-data form reads the same.
    assert completed([OpRecord.model_validate(r.to_dict()) for r in records], ("0", 1))


def test_blocked_in_is_the_main_threads_newest_synchronous_op():
    main, other = 11, 22
    inflight = [
        rec(1, 9.0, thread=main),
        rec(2, 8.0, thread=main, async_op=True),
        rec(3, 7.0, thread=other),
    ]
    assert blocked_in(inflight, main) == inflight[0]
    assert blocked_in(inflight[1:], main) is None
    assert blocked_in([], main) is None


def still(seq: int, s: float) -> SeqView:
    return SeqView(seq, s)


def test_a_rank_ahead_of_a_still_peer_waits_for_it_by_the_backends_numbers():
    own = {"0": still(9, 2.0), "3": still(4, 2.0)}
    peers = {1: {"0": still(8, 5.0), "3": still(4, 9.0)}, 2: {"0": still(9, 2.0)}}
    (d,) = find_backend_desync(0, own, peers, busy_groups=set(), hang_timeout_s=1.5, reported=set())
    assert (d.kind, d.signature, d.op_key, d.op) == (IncidentKind.BACKEND_DESYNC, "desync/0/9", ("0", 9), None)
    assert d.reason == "rank 0 stood 2.0 s at backend op #9 on group 0, not issued yet by rank 1 at #8"


@pytest.mark.parametrize(
    "own, peer, busy, reported",
    [
        (still(9, 1.0), still(8, 5.0), set(), set()),  # this rank has not stood still long enough
        (still(9, 2.0), still(8, 1.0), set(), set()),  # the peer moved lately: it is catching up
        (still(9, 2.0), still(9, 5.0), set(), set()),  # the same number: nobody waits for anybody
        (still(8, 2.0), still(9, 5.0), set(), set()),  # this rank is the one behind: the ranks ahead speak
        (still(9, 2.0), still(8, 5.0), {"0"}, set()),  # a recorded op in flight: find_hangs names its line
        (still(9, 2.0), still(8, 5.0), set(), {("0", 9)}),  # reported already
    ],
)
def test_no_backend_desync_without_a_still_rank_behind_a_still_rank_ahead(own, peer, busy, reported):
    assert find_backend_desync(0, {"0": own}, {1: {"0": peer}}, busy, 1.5, reported) == []
    assert find_backend_desync(0, {"0": own}, {1: {"5": peer}}, set(), 1.5, set()) == []  # not in the group


def test_a_peer_read_a_beat_ago_counts_as_still_for_that_beat_longer():
    # The peer's number is known as of its last heartbeat: 1.3 s still when read, up to 0.3 s before.
    own, peer = {"0": still(9, 1.6)}, {1: {"0": still(8, 1.3)}}
    assert find_backend_desync(0, own, peer, set(), 1.5, set()) == []
    (d,) = find_backend_desync(0, own, peer, set(), 1.5, set(), peer_lag_s=0.3)
    assert d.op_key == ("0", 9)


def test_every_rank_still_at_one_number_is_a_stuck_suspect():
    own = {"0": still(9, 2.0), "3": still(4, 2.0)}
    peers = {1: {"0": still(9, 5.0), "3": still(4, 9.0)}, 2: {"0": still(9, 1.8)}}
    found = find_backend_stuck(0, own, peers, busy_groups=set(), hang_timeout_s=1.5, skip=set())
    assert [(d.kind, d.signature, d.op_key, d.op) for d in found] == [
        (IncidentKind.BACKEND_STUCK, "stuck/0/9", ("0", 9), None),
        (IncidentKind.BACKEND_STUCK, "stuck/3/4", ("3", 4), None),
    ]
    assert found[0].reason == "rank 0 stood 2.0 s at backend op #9 on group 0, as did rank 1, rank 2"
    # A group no watched peer is in: this rank's open op is a hang all the same (the merge sorts it out).
    (alone,) = find_backend_stuck(0, {"5": still(2, 2.0)}, peers, set(), 1.5, set())
    assert alone.reason == "rank 0 stood 2.0 s at backend op #2 on group 5"


@pytest.mark.parametrize(
    "own, peer, busy, skip",
    [
        (still(9, 1.0), still(9, 5.0), set(), set()),  # this rank has not stood still long enough
        (still(9, 2.0), still(9, 1.0), set(), set()),  # the peer moved lately
        (still(9, 2.0), still(8, 5.0), set(), set()),  # the peer is behind: a desync, not this
        (still(9, 2.0), still(10, 5.0), set(), set()),  # the peer is ahead: this rank is the one behind
        (still(9, 2.0), still(9, 5.0), {"0"}, set()),  # a recorded op in flight: find_hangs names its line
        (still(9, 2.0), still(9, 5.0), set(), {("0", 9)}),  # reported, or read and found completed
    ],
)
def test_no_stuck_suspect_unless_everyone_stood_still_at_one_number(own, peer, busy, skip):
    assert find_backend_stuck(0, {"0": own}, {1: {"0": peer}}, busy, 1.5, skip) == []


def test_a_peer_read_a_beat_ago_is_still_long_enough_for_a_stuck_suspect_too():
    own, peer = {"0": still(9, 1.6)}, {1: {"0": still(9, 1.3)}}
    assert find_backend_stuck(0, own, peer, set(), 1.5, set()) == []
    assert len(find_backend_stuck(0, own, peer, set(), 1.5, set(), peer_lag_s=0.3)) == 1


def op(completed: bool | None, age: float = 5.0) -> BackendOp:
    return BackendOp(seq=9, name="gloo:all_reduce", created=NOW - age, completed=completed)


@pytest.mark.parametrize(
    "backend_op, stuck_state, desync_state",
    [
        (op(False), OpState.OPEN, OpState.OPEN),
        (op(True), OpState.CLOSED, OpState.CLOSED),  # completed here: the numbers were a beat old
        (op(False, age=0.5), OpState.YOUNG, OpState.YOUNG),  # open, younger than the timeout: look again
        # Nothing tells (no recorder entry, no state): every rank computing stands still too, so no
        # stuck transport on numbers alone; a peer behind everyone still is a desync all the same.
        (op(None), OpState.CLOSED, OpState.OPEN),
        (None, OpState.CLOSED, OpState.OPEN),
    ],
)
def test_torchs_recorder_decides_whether_a_suspect_is_a_hang(backend_op, stuck_state, desync_state):
    assert backend_op_state(backend_op, NOW, 1.5, unknown_is_open=False) is stuck_state
    assert backend_op_state(backend_op, NOW, 1.5, unknown_is_open=True) is desync_state


def test_a_call_that_returned_since_the_number_moved_closes_the_groups_newest_op():
    """The race the desync launch once lost on a loaded machine: rank 0's recorded all_reduce returned,
    its peer's number (read a beat before) still behind, and gloo's recorder held no entry to say
    the op was closed; a backend desync was raised for an op that had completed."""
    moved_at = {"0": NOW - 2.0, "5": NOW - 2.0, "7": NOW - 2.0, "8": NOW - 2.0}
    records = [
        rec(16, 2.1, group="0", state="completed", end=NOW - 0.1),  # issued, then returned after the move
        rec(3, 9.0, group="5", state="completed", end=NOW - 8.0),  # returned before the number moved again
        rec(1, 2.1, group="7", state="failed", end=NOW - 0.2),  # failed counts: it is no longer open here
        rec(2, 2.1, group="7", peer=1, state="completed", end=NOW - 0.1),  # send/recv: not the group's counter
        rec(4, 2.1, group="9", state="completed", end=NOW - 0.1),  # a group not asked about
        rec(5, 9.0, group="8", state="completed", end=NOW - 0.1, async_op=True),  # waited for after the move
        rec(17, 1.0, group="5"),  # in flight: the hang detector speaks for it
    ]
    assert ended_since(records, moved_at) == {"0", "7"}
    assert ended_since(records, {}) == set()
