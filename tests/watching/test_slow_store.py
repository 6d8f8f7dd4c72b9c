"""A hang found while the job's store is slow is raised once the store answers, never dropped.

Seen in CI (a loaded run): torch's store-client timeouts on every rank for a few seconds, and rank 0's
hang, due at 1.5 s, was raised at 7.6 s. Read from the code then: a detection was marked reported
before the store took it, so a raise that timed out lost it for good; and a claim tried again took a
new token, so it lost its own claim. No processes: one rank's watch of a world of two, over torch's
HashStore behind the watchdog's bounded store client, which fails as a stalled server does.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from ncclguard.errors import StoreTimeout
from ncclguard.incidents.model import IncidentKind, OpRecord
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import Keys, WatchdogStore
from ncclguard.watching.ladder.actions import Ladder, build_ladder
from ncclguard.watching.sensors.story import MainThreadTrack
from ncclguard.watching.world_watch import WorldWatch
from ncclguard.world import World


class SlowServer:
    """torch's HashStore that answers ``answering`` more calls, then times out as a stalled
    server's client does (a ``DistStoreError``, torch's timeout), until ``answering`` is None."""

    def __init__(self) -> None:
        self.inner, self.answering, self.calls = dist.HashStore(), None, []

    def __getattr__(self, name):
        def call(*args):
            if self.answering is not None:
                if self.answering <= 0:
                    raise dist.DistStoreError(f"wait timeout after 500ms, keys: {args[:1]}")
                self.answering -= 1
            self.calls.append(name)
            return getattr(self.inner, name)(*args)

        return call


def watch_over(server: SlowServer, tmp_path) -> WorldWatch:
    config = WatchdogConfig(heartbeat_s=0.5, hang_timeout_s=1, incident_dir=tmp_path)
    watch = WorldWatch(
        config,
        World(rank=0, size=2),
        Ladder(build_ladder("report"), config.escalate_after_s),
        None,
        threading.Condition(),
        MainThreadTrack(threading.main_thread().ident),
        1.0,
    )
    # gone_after 60 s: every failure here is a slow store, not a lost one.
    watch.desk.store = WatchdogStore(server, Keys("t"), 2.0, 60.0)
    op = OpRecord(
        seq=7, op="all_reduce(SUM)", group="0", numel=4096, dtype="float32", start=time.time() - 10, site="/job/t.py:9"
    )
    watch.state.inflight = lambda: [op]  # an all_reduce in flight for 10 s, past the 1 s bound
    return watch


def raised(server: SlowServer) -> list[str]:
    keys = Keys("t")
    count = int(server.inner.add(keys.count, 0))
    present = [keys.incident(n) for n in range(1, count + 1) if server.inner.check([keys.incident(n)])]
    return [server.inner.get(key).decode() for key in present]  # a number without its incident: missing


def test_a_hang_found_while_the_store_times_out_is_raised_once_it_answers(tmp_path):
    server = SlowServer()
    watch = watch_over(server, tmp_path)
    server.answering = 0
    watch.check_hang(1.0)  # found: no store call needed to find it
    with pytest.raises(StoreTimeout):
        watch.raise_found()
    assert raised(server) == []
    watch.check_hang(1.0)  # found once: the op is reported, so not found again
    server.answering = None
    watch.raise_found()
    docs = raised(server)
    assert len(docs) == 1 and '"kind":"hang"' in docs[0].replace(" ", "") and "all_reduce(SUM) #7" in docs[0]
    watch.raise_found()  # nothing left to raise
    assert len(raised(server)) == 1
    watch.desk.poll()
    assert [c.doc.kind for c in watch.desk.cases] == [IncidentKind.HANG]
    watch.desk.close()


@pytest.mark.parametrize("answered", [1, 2])
def test_a_raise_cut_after_its_claim_keeps_the_claim_and_its_number(tmp_path, answered):
    """``answered`` 1: the claim taken, the number's ``add`` timed out; 2: the number taken too,
    the incident's ``set`` timed out. Tried again, the raise goes on from where it was cut."""
    server = SlowServer()
    watch = watch_over(server, tmp_path)
    watch.check_hang(1.0)
    server.answering = answered
    with pytest.raises(StoreTimeout):
        watch.raise_found()
    assert server.calls == ["compare_set", "add"][:answered]
    server.answering = None
    watch.raise_found()
    docs = raised(server)
    assert len(docs) == 1 and "all_reduce(SUM) #7" in docs[0]
    assert int(server.inner.add(Keys("t").count, 0)) == 1  # one number taken, none skipped
    watch.desk.close()


def test_a_raise_the_store_refuses_for_good_is_handled_on_this_rank(tmp_path):
    """A store that never answers again (``StoreUnreachable`` once it failed for ``gone_after``):
    the hang that waited is handled on this rank alone, not dropped."""
    server = SlowServer()
    watch = watch_over(server, tmp_path)
    watch.desk.store = WatchdogStore(server, Keys("t"), 2.0, 0.0)  # gone at its first failure
    server.answering = 0
    watch.check_hang(1.0)
    with pytest.raises(Exception) as info:
        watch.raise_found()
    watch.desk.store_gone(info.value)
    watch.raise_found()
    kinds = [c.doc.kind for c in watch.desk.cases]
    assert kinds == [IncidentKind.STORE_GONE, IncidentKind.HANG], kinds
    assert watch.desk._raising == {}  # the claim begun in the store that went is not kept
    watch.desk.close()
