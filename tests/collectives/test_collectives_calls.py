"""Which call each rank is in (kinds, sites, counts, tags) and how deadlines nest in the group's
timeout: the pure parts, and rounds between threads on one real torch store (no process groups)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch.distributed as dist

from ncclguard.collectives.calls import CallPrint, begin_call, call_site, check_tag, compare_prints, meet_prints
from ncclguard.collectives.groups import GroupInfo
from ncclguard.config import configure
from ncclguard.deadlines import check_below_group_timeout, default_deadline, group_cap_s
from ncclguard.world import World, announce, current_world

# ---------------------------------------------------------------- deadlines in the group's timeout


@pytest.mark.parametrize(
    "group_timeout, cap",
    [
        (600.0, 539.5),  # NCCL's default: 600 * 0.9 - 0.5
        (1800.0, 1619.5),  # gloo's default
        (3.0, 2.2),
        (1.0, 0.5),  # never below half the group's timeout
    ],
)
def test_default_deadline_is_capped_below_the_group_timeout(group_timeout, cap):
    assert group_cap_s(group_timeout) == pytest.approx(cap)
    assert default_deadline(1800.0, group_timeout) == pytest.approx(cap)
    assert default_deadline(0.25, group_timeout) == 0.25  # a policy deadline already below stays
    assert default_deadline(1800.0, None) == 1800.0  # unknown group timeout: no cap


def test_cap_follows_the_configuration():
    configure(deadline_headroom=0.5, postmortem_grace_s=0.0)
    assert group_cap_s(600.0) == 300.0


def test_explicit_deadline_at_or_above_the_group_timeout_is_refused():
    check_below_group_timeout(2.9, 3.0, "7")
    check_below_group_timeout(1e9, None, "7")  # unknown group timeout: nothing to compare
    for seconds in (3.0, 5.0):
        with pytest.raises(
            ValueError, match=r"timeout=\d s is not below the timeout of group '7' \(3 s\).*capped at 2\.2 s"
        ):
            check_below_group_timeout(seconds, 3.0, "7")


# ---------------------------------------------------------------- fingerprints (pure)


def _p(kind: str, site: str, **data) -> CallPrint:
    return CallPrint(kind=kind, site=site, **data)


def test_different_kinds_in_one_round_name_each_ranks_call_and_site():
    why, note = compare_prints({0: _p("barrier", "a.py:3"), 1: _p("all_reduce", "b.py:9", numel=4)})
    assert note is None
    assert why is not None and why.startswith(
        "the ranks are in different calls (rank 0: barrier at a.py:3; rank 1: all_reduce at b.py:9)"
    )


def test_same_kind_from_two_sites_goes_on_with_a_note():
    why, note = compare_prints({0: _p("barrier", "a.py:3"), 1: _p("barrier", "a.py:5")})
    assert why is None
    assert note == "one barrier called from different lines (rank 0: barrier at a.py:3; rank 1: barrier at a.py:5)"
    assert compare_prints({0: _p("barrier", "a.py:3"), 1: _p("barrier", "a.py:3")}) == (None, None)


def test_same_kind_with_different_data_is_a_disagreement():
    why, _ = compare_prints({0: _p("all_reduce", "a.py:3", numel=10), 1: _p("all_reduce", "a.py:3", numel=12)})
    assert why == "ranks disagree, nothing was sent (rank 0: {'numel': 10}; rank 1: {'numel': 12})"


def test_unreadable_fingerprint_is_a_failure():
    why, _ = compare_prints({0: _p("barrier", "a.py:3"), 1: None})
    assert (
        why == "a rank's fingerprint could not be read (rank 0: barrier at a.py:3; rank 1: an unreadable fingerprint)"
    )


def _site_here() -> str:
    return call_site(skip_prefix="test_collectives_calls_no_such_module")


def test_call_site_is_the_first_frame_outside_the_package():
    line = _site_here.__code__.co_firstlineno + 1
    assert _site_here() == f"{__file__}:{line}"
    # From inside ncclguard, the frames of the package are skipped: this test module is the caller.
    assert call_site().startswith(f"{__file__}:")


@pytest.mark.parametrize("tag", ["", "a b", "x" * 129, "../../etc", 3, "é"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(ValueError, match="tag must be a short name"):
        check_tag(tag)
    check_tag("eval-12")
    check_tag(None)


# ---------------------------------------------------------------- rounds between threads


def _ranks(store: dist.Store, name: str, size: int = 2) -> list[GroupInfo]:
    return [GroupInfo(group=None, name=name, rank=r, size=size, backend="gloo", store=store) for r in range(size)]


def _both(fns):
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # a hang guard above the rounds' 30 s deadline
    return out


def _meet_all(calls):
    # 30 s: a hang guard; every rank arrives long before (a loaded machine may start a thread seconds late).
    return _both([lambda c=c: meet_prints(c, c.print(), time.monotonic() + 30) for c in calls])


def test_one_count_for_every_kind_and_refused_calls_take_a_number():
    info = _ranks(dist.HashStore(), "count-1")[0]
    names = [begin_call(info, k).round for k in ("barrier", "all_reduce", "barrier")]
    assert names == ["call/count-1/0", "call/count-1/1", "call/count-1/2"]
    assert begin_call(info, "barrier", tag="t").round == "call/count-1/tag/t#0"
    assert begin_call(info, "barrier", tag="t").round == "call/count-1/tag/t#1"  # a tag may be reused
    assert begin_call(info, "barrier").round == "call/count-1/3"  # tags take no number


def test_kinds_differ_both_ranks_fail_at_once():
    infos = _ranks(dist.HashStore(), "kinds-1")
    calls = [begin_call(infos[0], "barrier"), begin_call(infos[1], "all_reduce")]
    t0 = time.monotonic()
    met = _meet_all(calls)
    assert time.monotonic() - t0 < 10  # told at once, not at the 30 s deadline (a hang guard)
    for m in met:
        assert not m.ok and m.missing == [] and "different calls" in m.mismatch
        assert m.prints[0]["kind"] == "barrier" and m.prints[1]["kind"] == "all_reduce"


def test_two_sites_of_one_kind_are_logged_once(caplog):
    infos = _ranks(dist.HashStore(), "sites-1")
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        for _ in range(3):  # a loop that calls one barrier from two lines logs it once
            calls = [begin_call(info, "barrier") for info in infos]
            calls[0]._site, calls[1]._site = "x.py:1", "x.py:2"
            met = _meet_all(calls)
            assert all(m.ok for m in met)
    notes = [r.getMessage() for r in caplog.records if "different lines" in r.getMessage()]
    assert len(notes) == 1 and "rank 0: barrier at x.py:1; rank 1: barrier at x.py:2" in notes[0]


def test_a_tagged_round_every_rank_passed_realigns_the_counts():
    infos = _ranks(dist.HashStore(), "tag-1")
    begin_call(infos[0], "barrier")  # rank 0 made a call rank 1 did not: counts differ by one
    tagged = [begin_call(info, "barrier", tag="sync") for info in infos]
    met = _meet_all(tagged)
    assert all(m.ok for m in met)
    assert begin_call(infos[0], "all_reduce").round == begin_call(infos[1], "all_reduce").round == "call/tag-1/sync#0/0"


def test_a_new_world_starts_the_counts_afresh_and_the_old_one_keeps_its_own():
    # Commit note: rendezvous.reset_for_new_world() is gone; the counts belong to the World, so a
    # new world (what rebuild_world announces) starts them at 0 and nothing resets them by hand.
    info = _ranks(dist.HashStore(), "reset-1")[0]
    begin_call(info, "barrier")
    before = current_world()
    try:
        announce(World(generation=before.generation))  # the same generation: a world of the user's own
        assert begin_call(info, "barrier").round == "call/reset-1/0"
        assert begin_call(info, "barrier").round == "call/reset-1/1"
    finally:
        announce(before)
    assert begin_call(info, "barrier").round == "call/reset-1/1"  # the old world's count went on
