"""The three causes of a straggler and the clocks (ncclguard/watching/sensors/straggler/): the input pipeline
told apart from compute, slow links named from the kernel's TCP figures (a link slow from the start
included, and one culprit: the host every slow link touches), clock offsets measured through a real
store and taken out of the arrivals, and an incident raised again when a straggler comes back.

The figures come from the lockstep model of tests/watching/test_straggler.py; the edges (torch's DataLoader,
real TCP sockets on loopback, a real TCPStore) are exercised for real.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from test_straggler import arrivals_lockstep, backend_windows, defaults, lockstep, steady
from torch.utils.data import DataLoader, Dataset

from ncclguard.incidents.model import StragglerWindow
from ncclguard.testing.launch import free_port
from ncclguard.watching.sensors.straggler import assess
from ncclguard.watching.sensors.straggler.clocks import ClockTicker, OffsetFilter, join_tickers
from ncclguard.watching.sensors.straggler.inputs import (
    InputClock,
    input_wait,
    inputs,
    time_dataloaders,
    untime_dataloaders,
)
from ncclguard.watching.sensors.straggler.links import (
    LINK_MIN_BYTES,
    LinkMeter,
    culprit,
    link_rates,
    locate,
    slow_links,
)

MB = 1e6


def with_inputs(wins: list[StragglerWindow], input_s: list[float]) -> list[StragglerWindow]:
    return [w.model_copy(update={"input_s": s}) for w, s in zip(wins, input_s, strict=True)]


def input_lockstep(models: list[float], loads: list[float], transfer: float, n: int) -> list[StragglerWindow]:
    """Windows of 100 s of ranks whose step is a batch (``loads[r]``), the model (``models[r]``), the op."""
    count = 100.0 / (max(m + i for m, i in zip(models, loads, strict=True)) + transfer)
    wins = lockstep([m + i for m, i in zip(models, loads, strict=True)], transfer, 100.0, n, 100.0 * (n + 1))
    return with_inputs(wins, [i * count for i in loads])


# ----------------------------------------------------------------- the input pipeline


def test_a_rank_whose_data_loader_slows_is_an_input_straggler_and_one_whose_model_slows_is_not() -> None:
    for cause, model, load in (("input", 0.8, 0.4), ("compute", 1.0, 0.2)):
        tracker = defaults()
        found = []
        for n in range(3):  # healthy: 0.8 s of model and 0.2 s of batch a step; rank 0 needs 0.2 s more
            own, *peers = input_lockstep([model, 0.8, 0.8], [load, 0.2, 0.2], 0.3, n)
            found.append(tracker.feed(own, dict(enumerate(peers, 1))))
        hits = [d for d in found if d is not None]
        assert len(hits) == 1 and hits[0].straggler is not None, cause
        report = hits[0].straggler
        assert (report.cause, report.rank, report.culprit) == (cause, 0, "rank 0")
        assert report.slowdown == pytest.approx(1.2, rel=1e-3)
        assert hits[0].signature == f"straggler/{cause}/0/1"
        if cause == "input":
            assert "input straggler (its data loader)" in hits[0].reason and "waiting for batches" in report.where
            ev = report.windows[-1]
            assert ev.input_frac is not None and ev.peers_input_frac is not None and ev.input_frac > ev.peers_input_frac
        else:
            assert "compute straggler" in hits[0].reason and report.where.startswith("compute in phase 'train'")


def test_without_every_ranks_input_time_the_cause_is_compute() -> None:
    own, *peers = input_lockstep([0.8, 0.8, 0.8], [0.4, 0.2, 0.2], 0.3, 0)
    untimed = peers[1].model_copy(update={"input_s": None})
    a = assess(own, {1: peers[0], 2: untimed}, 1.15, 0.05)
    assert a is not None and a.compute_slow and a.cause == "compute" and a.evidence.input_frac is None
    told = assess(own, {1: peers[0], 2: peers[1]}, 1.15, 0.05)
    assert told is not None and told.compute_slow and told.cause == "input"


@settings(max_examples=200, deadline=None)
@given(
    # From 1.22: the detector's threshold is 1.15, and a rank 20.1% slow, 3% fast by jitter, against
    # a peer 3% slow measures (0.97 + 0.201) / 1.03 = 1.137 (hypothesis found it). 1.22 stays above 1.15
    # under the worst jitter: (0.97 + 0.22) / 1.03 = 1.155.
    slow=st.floats(1.22, 3.0),
    load=st.floats(0.05, 0.5),  # the healthy step's share in the data loader
    peers=st.integers(1, 16),
    into_input=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_any_20_percent_straggler_is_named_with_the_cause_its_extra_time_went_to(
    slow, load, peers, into_input, seed
) -> None:
    rng = random.Random(seed)
    tracker = defaults()
    hits = []
    for n in range(3):
        extra = (slow - 1.0) * 1.0  # a step of 1.0 outside collectives: (1 - load) model, load batch
        models = [(1 - load) * (1 + rng.uniform(-0.03, 0.03)) for _ in range(peers + 1)]
        loads = [load * (1 + rng.uniform(-0.03, 0.03)) for _ in range(peers + 1)]
        if into_input:
            loads[0] += extra
        else:
            models[0] += extra
        own, *rest = input_lockstep(models, loads, 0.5, n)
        if (d := tracker.feed(own, dict(enumerate(rest, 1)))) is not None:
            hits.append(d)
    assert len(hits) == 1 and hits[0].straggler is not None
    assert hits[0].straggler.cause == ("input" if into_input else "compute")


class Slow(Dataset):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.ones(1)


def test_torchs_dataloader_is_timed_on_the_main_thread_only_and_nested_waits_count_once() -> None:
    assert time_dataloaders() and time_dataloaders()  # once; the second call does nothing
    try:
        before = inputs.seconds
        t0 = time.perf_counter()
        batches = list(DataLoader(Slow(0.02), batch_size=None))
        took = time.perf_counter() - t0
        spent = inputs.seconds - before
        assert len(batches) == 6 and 6 * 0.02 <= spent <= took
        before = inputs.seconds
        other = threading.Thread(target=lambda: list(DataLoader(Slow(0.02), batch_size=None)))
        other.start()
        other.join(30)
        assert inputs.seconds == before  # another thread's batches are its own business
        t0 = time.perf_counter()
        with input_wait():  # a pipeline of its own around a DataLoader: counted once
            list(DataLoader(Slow(0.01), batch_size=None))
        took = time.perf_counter() - t0
        # Counted once: no more than the block took (counted twice, the batches' 0.06 s at least would
        # come on top), whatever a loaded machine made the block take; a bound in seconds was not.
        assert 6 * 0.01 <= inputs.seconds - before <= took
    finally:
        untime_dataloaders()
    before = inputs.seconds
    list(DataLoader(Slow(0.0), batch_size=None))
    assert inputs.seconds == before  # torch's own __next__ again


def test_an_input_clock_counts_only_its_thread() -> None:
    clock = InputClock()
    assert clock.timed(lambda: time.sleep(0.01) or 7) == 7 and clock.seconds >= 0.01
    clock.main = -1  # another thread's clock
    before = clock.seconds
    assert clock.timed(lambda: time.sleep(0.01) or 8) == 8 and clock.seconds == before


# ----------------------------------------------------------------- links


def star_samples(rates: dict[tuple[str, str], float], moved: float = 400 * MB) -> dict[str, list]:
    """Each sender's samples: ``moved`` bytes over each link at its rate (bytes a second)."""
    out: dict[str, list] = {}
    for (a, b), rate in rates.items():
        out.setdefault(a, []).append((a, b, moved, moved / rate))
    return out


def ring(hosts: int, slow: int | None, healthy: float, slowed: float) -> dict[tuple[str, str], float]:
    """A ring's links, those of host ``slow`` (both ways) at ``slowed`` bytes a second."""
    addr = [f"10.0.0.{i + 1}" for i in range(hosts)]
    return {(addr[i], addr[(i + 1) % hosts]): slowed if slow in (i, (i + 1) % hosts) else healthy for i in range(hosts)}


def test_a_host_whose_link_is_slow_from_the_start_is_named_against_the_other_links() -> None:
    rates = link_rates(star_samples(ring(3, 2, 400 * MB, 45 * MB)).values())
    # 100 ops of 4 MB a link: the slow links take 89 ms an op, the other 10 ms; the op takes 90 ms.
    slow = slow_links(rates, 2.0, 0.05, 4.0, transfer_s=0.090, ops=100)
    assert sorted(slow) == [("10.0.0.2", "10.0.0.3"), ("10.0.0.3", "10.0.0.1")]
    assert all(ref == pytest.approx(400 * MB) for ref in slow.values())  # what the sizes take on the other link
    assert culprit(slow) == "host 10.0.0.3"
    # The same links, but the op takes 4x what the slow link costs it: it waits for something else.
    assert slow_links(rates, 2.0, 0.05, 4.0, transfer_s=0.400, ops=100) == {}
    # Without the op's time (a loop that only calls DDP) a link must be 5x slower than the others.
    assert sorted(slow_links(rates, 2.0, 0.05, 4.0)) == sorted(slow)  # 8.9x
    milder = link_rates(star_samples(ring(3, 2, 400 * MB, 100 * MB)).values())
    assert slow_links(milder, 2.0, 0.05, 4.0) == {}  # 4x: not without the op's time
    assert slow_links(link_rates(star_samples(ring(3, None, 400 * MB, 0)).values()), 2.0, 0.05, 4.0) == {}
    # Slower than the others but costing under min_share of the window: not a slow link.
    small = link_rates(star_samples(ring(3, 2, 400 * MB, 45 * MB), moved=LINK_MIN_BYTES * 2).values())
    assert slow_links(small, 2.0, 0.05, 4.0) == {}


def test_one_pair_of_hosts_is_located_against_its_own_past_and_named_as_the_link() -> None:
    both = {("a", "b"): 40 * MB, ("b", "a"): 40 * MB}
    rates = link_rates(star_samples(both).values())
    assert slow_links(rates, 2.0, 0.05, 4.0) == {}  # no other link to compare with
    assert locate(rates) == {}  # and no past: nothing named
    slow = locate(rates, {("a", "b"): 400 * MB, ("b", "a"): 400 * MB})
    assert sorted(slow) == [("a", "b"), ("b", "a")] and culprit(slow) == "the link a <-> b"
    assert slow[("a", "b")] == pytest.approx(10**0.5)  # its drop (10x) against no other link (1x)
    assert culprit([("a", "b")]) == "the link a -> b"
    assert culprit([("a", "b"), ("c", "d")]) == "" and culprit([]) == ""


def test_a_host_whose_links_dropped_is_located_though_the_others_vary() -> None:
    # Mid-run, host 10.0.0.3's links drop to 130 MB/s from 400; the other link varies 200-800 MB/s.
    rates = ring(3, 2, 600 * MB, 130 * MB)
    before = {k: 400 * MB for k in rates}
    got = locate(link_rates(star_samples(rates).values()), before)
    assert culprit(got) == "host 10.0.0.3"
    # Everything slower alike (the host's load): no link stands out, nobody is named.
    alike = locate(link_rates(star_samples({k: 130 * MB for k in rates}).values()), before)
    assert culprit(alike) == ""


@settings(max_examples=200, deadline=None)
@given(hosts=st.integers(3, 12), slow=st.integers(0, 11), factor=st.floats(8.0, 50.0), seed=st.integers(0, 2**32))
def test_any_host_with_a_link_slow_from_the_start_is_named_alone(hosts, slow, factor, seed) -> None:
    # Healthy links vary within 1.5x of each other (a loaded host); one host's links are `factor` slower.
    rng = random.Random(seed)
    slow %= hosts
    rates = {k: v * rng.uniform(1.0, 1.5) for k, v in ring(hosts, slow, 200 * MB, 200 * MB / factor).items()}
    found = slow_links(link_rates(star_samples(rates).values()), 2.0, 0.05, 4.0)
    assert culprit(found) == f"host 10.0.0.{slow + 1}"


@settings(max_examples=200, deadline=None)
@given(hosts=st.integers(3, 12), seed=st.integers(0, 2**32))
def test_links_within_2x_of_each_other_are_never_slow_from_the_start(hosts, seed) -> None:
    rng = random.Random(seed)
    rates = {k: 200 * MB * rng.uniform(0.51, 1.0) for k in ring(hosts, None, 1, 1)}
    pace = max(400 * MB / v for v in rates.values()) / 100  # the slowest link paces each of 100 ops
    assert slow_links(link_rates(star_samples(rates).values()), 2.0, 0.05, 4.0, transfer_s=pace, ops=100) == {}


def test_the_link_meter_reads_a_real_tcp_connection_and_does_not_blame_a_slow_reader() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    got = bytearray()
    reading = threading.Event()

    def drain() -> None:
        reading.wait(30)
        try:
            while chunk := conn.recv(1 << 20):
                got.extend(chunk)
        except OSError:
            pass  # closed at the end

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        meter = LinkMeter()
        assert meter.read(everything=True) == []  # the first read sets the counters
        sender = threading.Thread(target=lambda: peer.sendall(b"x" * (16 << 20)), daemon=True)
        t0 = time.perf_counter()
        sender.start()
        time.sleep(0.5)  # the reader is asleep: the send stalls on the receiver's window
        reading.set()
        sender.join(30)
        deadline = time.monotonic() + 30
        while len(got) < 16 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        took = time.perf_counter() - t0
        samples = meter.read(everything=True)
        # Loopback: one address both ways; the sending socket's peer acknowledged the 16 MiB.
        (sent,) = [s for s in samples if s[2] > 0]
        assert (sent[0], sent[1], sent[2]) == ("127.0.0.1", "127.0.0.1", 16 << 20)
        # The half second the reader slept held the data back by its window, not by the link: not busy.
        assert took >= 0.5 and 0 <= sent[3] < 0.25, (took, sent)
        assert len(got) == 16 << 20
    finally:
        peer.close()
        conn.close()
        server.close()


# ----------------------------------------------------------------- clocks


def test_the_offset_is_the_least_sample() -> None:
    f = OffsetFilter(size=3)
    assert f.estimate is None
    for released, ref in ((100.031, 100.0), (200.050, 200.0), (300.090, 300.0), (400.040, 400.0)):
        f.add(released, 0.001, ref)  # samples 0.030, 0.049, 0.089, 0.039
    assert f.estimate == pytest.approx(0.039)  # 0.030 dropped out: only the newest 3 are kept


def test_clock_offsets_are_measured_through_a_real_store() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ticking, waiting = threading.Event(), threading.Event()
    ticking.set()
    waiting.set()
    ref = ClockTicker(f"127.0.0.1:{port}", "t/clock", True, 0.2, ticking.is_set)
    ahead = ClockTicker(f"127.0.0.1:{port}", "t/clock", False, 0.2, waiting.is_set, clock=lambda: time.time() + 0.05)
    same = ClockTicker(f"127.0.0.1:{port}", "t/clock", False, 0.2, waiting.is_set)
    try:
        for t in (ref, ahead, same):
            t.start()
        # Each sample is late by how long the threads took to run; the estimate, the least of the newest
        # samples, is right once one came on time, which a loaded machine may make take more ticks
        # than 6. So it is read until it holds, within a hang guard (60 s).
        deadline = time.monotonic() + 60
        while True:
            got = (ahead.ticks, same.ticks, ahead.estimate, same.estimate)
            close = None not in got[2:] and abs(got[2] - 0.05) <= 0.005 and abs(got[3]) <= 0.005
            if (min(got[:2]) >= 6 and close) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got[0] >= 6 and got[1] >= 6, got
        assert ref.estimate == 0.0
        assert got[2] == pytest.approx(0.05, abs=0.005), got  # the least of 6 or more samples
        assert got[3] == pytest.approx(0.0, abs=0.005), got
    finally:
        waiting.clear()  # the waiters end at the next tick, which the reference still gives
        for t in (ahead, same):
            t.join(60)
        ticking.clear()
        ref.join(60)
        del server
    assert not any(t.is_alive() for t in (ref, ahead, same))


def test_a_waiting_ticker_ends_soon_after_its_watch_and_exit_waits_for_it() -> None:
    """At a rank's exit a ticker may wait for a tick that comes late or never (the reference rank
    done, with a 5 s period). It waits a slice at a time, so it ends within about a slice once its
    watch is over, and join_tickers (the exit's wait) sees it end: a ticker left running started new
    store calls after the exit's wait, and the process aborted at finalization."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    watching = threading.Event()
    watching.set()
    waiter = ClockTicker(f"127.0.0.1:{port}", "t/late", False, 5.0, watching.is_set)  # no reference ticks
    try:
        waiter.start()
        time.sleep(1.5)  # connected, and inside a wait for tick 0
        assert waiter.is_alive()
        watching.clear()
        t0 = time.monotonic()
        assert join_tickers() == 0
        # A slice (1 s) and the end of a call; the bound is a hang guard, 3x what a loaded run needs.
        assert time.monotonic() - t0 < 6.0
        assert not waiter.is_alive()
    finally:
        watching.clear()
        waiter.join(30)
        del server


def test_a_clock_offset_told_is_taken_out_of_the_arrivals() -> None:
    # Rank 0's clock runs 10 ms ahead: read as is, it arrives 10 ms late at every op (1.22x, a false
    # straggler: tests/watching/test_straggler.py); told its offset, it is as fast as its peers.
    arr = arrivals_lockstep(steady([0.05, 0.05, 0.05]), 0.005)
    arr[0] = [(s, t + 0.010) for s, t in arr[0]]
    wins = backend_windows(arr)
    blind = assess(wins[0], {1: wins[1], 2: wins[2]}, 1.15, 0.05)
    assert blind is not None and blind.compute_slow
    told = [w.model_copy(update={"clock_offset_s": off}) for w, off in zip(wins, (0.010, 0.0, 0.0), strict=True)]
    a = assess(told[0], {1: told[1], 2: told[2]}, 1.15, 0.05)
    assert a is not None and not a.compute_slow and a.evidence.slowdown == pytest.approx(1.0, abs=1e-3)
    assert a.evidence.clock_offset_s == 0.010
    for me in (1, 2):  # and its peers see no straggler either
        rest = {r: told[r] for r in range(3) if r != me}
        b = assess(told[me], rest, 1.15, 0.05)
        assert b is not None and not b.compute_slow


@settings(max_examples=150, deadline=None)
@given(offsets=st.lists(st.floats(-0.5, 0.5), min_size=3, max_size=8), me=st.integers(0, 7))
def test_any_clock_offsets_told_make_no_straggler_of_equal_ranks(offsets, me) -> None:
    me %= len(offsets)
    tracker = defaults()
    for n in range(6):
        arr = arrivals_lockstep(steady([0.05] * len(offsets)), 0.005, start=100.0 * n)
        wins = backend_windows([[(s, t + off) for s, t in a] for a, off in zip(arr, offsets, strict=True)], n)
        wins = [w.model_copy(update={"clock_offset_s": off}) for w, off in zip(wins, offsets, strict=True)]
        own = wins.pop(me)
        assert tracker.feed(own, dict(enumerate(wins))) is None


# ----------------------------------------------------------------- an incident per episode


def test_a_straggler_that_recovers_and_comes_back_is_reported_again() -> None:
    tracker = defaults()
    found = []
    for n in range(12):  # slow in windows 0-2, healthy 3-6, slow again 7-9, healthy after
        k = 1.3 if n in (0, 1, 2, 7, 8, 9) else 1.0
        own, *peers = lockstep([k, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, dict(enumerate(peers, 1))))
    assert [n for n, d in enumerate(found) if d is not None] == [1, 8]
    assert [d.signature for d in found if d is not None] == ["straggler/compute/0/1", "straggler/compute/0/2"]


def test_a_straggler_back_too_soon_is_the_same_incident() -> None:
    tracker = defaults()
    found = []
    for n in range(8):  # slow 0-2, one healthy window, slow 4-6
        k = 1.3 if n != 3 else 1.0
        own, *peers = lockstep([k, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, dict(enumerate(peers, 1))))
    assert [n for n, d in enumerate(found) if d is not None] == [1]


def test_a_slow_host_is_named_from_the_windows_of_its_peers_with_its_ranks() -> None:
    tracker = defaults()
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    found = []
    for n in range(3):  # host 10.0.0.3 (rank 2) slow from the first window on
        wins = lockstep([1.0, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1))
        samples = star_samples(ring(3, 2, 400 * MB, 40 * MB))
        wins = [w.model_copy(update={"links": samples.get(hosts[r], [])}) for r, w in enumerate(wins)]
        found.append(tracker.feed(wins[0], {1: wins[1], 2: wins[2]}))
    hits = [d for d in found if d is not None]
    assert len(hits) == 1 and found[1] is hits[0] and hits[0].straggler is not None
    report = hits[0].straggler
    assert (report.cause, report.culprit, report.ranks) == ("link", "host 10.0.0.3", [2])
    assert hits[0].signature == "straggler/link/host-10.0.0.3/1"
    assert report.slowdown == pytest.approx(10.0, rel=1e-3)
    assert "a slow link: host 10.0.0.3" in hits[0].reason
    assert report.windows[-1].links and all(len(link) == 4 for link in report.windows[-1].links)


def test_links_slow_in_turn_are_noise_not_a_culprit() -> None:
    tracker = defaults()
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    for n in range(6):  # each window another link dips 3x
        rates = ring(3, None, 400 * MB, 0)
        dip = list(rates)[n % 3]
        rates[dip] /= 3
        samples = star_samples(rates)
        wins = lockstep([1.0, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1))
        wins = [w.model_copy(update={"links": samples.get(hosts[r], [])}) for r, w in enumerate(wins)]
        assert tracker.feed(wins[0], {1: wins[1], 2: wins[2]}) is None


def test_a_window_in_which_a_rank_straggles_says_nothing_of_the_links() -> None:
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    samples = star_samples(ring(3, 2, 400 * MB, 40 * MB))
    for computes in ([1.3, 1.0, 1.0], [1.0, 1.0, 1.3]):  # the slow rank judging itself, or a peer of it
        wins = lockstep(computes, 0.3, 10.0, 0, 10.0)
        wins = [w.model_copy(update={"links": samples.get(hosts[r], [])}) for r, w in enumerate(wins)]
        a = assess(wins[0], {1: wins[1], 2: wins[2]}, 1.15, 0.05, 0.1, baseline_compute_per_op=1.0)
        assert a is not None and a.straggling and not a.link_slow and a.slow_links is None
    healthy = lockstep([1.0, 1.0, 1.0], 0.3, 10.0, 0, 10.0)
    healthy = [w.model_copy(update={"links": samples.get(hosts[r], [])}) for r, w in enumerate(healthy)]
    b = assess(healthy[0], {1: healthy[1], 2: healthy[2]}, 1.15, 0.05)
    assert b is not None and not b.straggling and b.link_slow and b.slow_links is not None


def test_a_transfer_halfway_to_the_threshold_stays_out_of_the_baseline() -> None:
    tracker = defaults()
    found = []
    for n in range(12):  # 0.2 s an op for 3 windows, then 1.7x for 6 (under the 2x threshold), then 2.2x
        transfer = 0.2 if n < 3 else (0.34 if n < 9 else 0.44)
        own, *peers = lockstep([1.0, 1.0], transfer, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, {1: peers[0]}))
    assert tracker.baseline == pytest.approx(0.2)  # the 1.7x windows never entered it
    assert [n for n, d in enumerate(found) if d is not None] == [10]
    det = found[10]
    assert det is not None and det.straggler is not None and det.straggler.cause == "link"
    assert det.straggler.slowdown == pytest.approx(2.2, rel=1e-3)
