"""The straggler figures in the incident model: a rank's windows, the evidence, the report."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ncclguard.incidents.base import Model

__all__ = ["MAX_ARRIVALS", "MAX_LINKS", "Arrival", "LinkSample", "StragglerReport", "StragglerWindow", "WindowEvidence"]


# A collective's backend number and the time.time() a rank reached it (torch's time_created_ns).
Arrival = tuple[Annotated[int, Field(ge=0)], Annotated[float, Field(allow_inf_nan=False)]]
MAX_ARRIVALS = 32  # arrivals a window carries: about 1 KB of the heartbeat
# A TCP connection's traffic over a window, from the sender's side (Linux TCP_INFO): its local and
# peer addresses, the bytes the peer acknowledged, and the seconds it had data in flight less the
# time the receiver's window held it back (docs/stragglers.md, "Links").
LinkSample = tuple[
    Annotated[str, Field(max_length=64)],
    Annotated[str, Field(max_length=64)],
    Annotated[float, Field(ge=0, allow_inf_nan=False)],
    Annotated[float, Field(ge=0, allow_inf_nan=False)],
]
MAX_LINKS = 8  # link samples a window carries, the busiest first


class StragglerWindow(Model):
    """One rank's figures over one straggler window (published in its heartbeat).

    ``compute_s`` is the window's time outside collectives, ``wait_s`` the time its main thread spent
    inside synchronous collectives; ``op_wait_s`` the median time of one of them that moves 16,384
    elements or more (the transfer itself when this rank is the last to arrive)."""

    n: int = Field(ge=0)  # the window's number on this rank
    end: float  # time.time() when it closed
    length_s: float = Field(gt=0)  # the span covered (the records may not reach back the whole window)
    compute_s: float = Field(ge=0)
    wait_s: float = Field(ge=0)
    ops: int = Field(0, ge=0)  # collectives completed in the window
    op_wait_s: float = Field(0.0, ge=0)  # the median time of one op large enough to time the link
    transfer_ops: int = Field(0, ge=0)  # those ops (16,384 elements or more)
    steps: int | None = Field(None, ge=0)  # step marks in the window (ncclguard.mark_step)
    # The time its main thread was runnable but not running (waiting for a CPU: Linux's schedstat run
    # delay), None where the OS does not tell: compute the host took from it, not work it did.
    run_delay_s: float | None = Field(None, ge=0)
    phase: str = Field("", max_length=200)  # where most of the compute went
    op: str = Field("", max_length=80)  # where most of the wait went
    # When the main thread's records hold too few ops (a loop that only calls DDP: its bucket
    # all_reduce is issued from C++) and the backend ran more: the newest collectives of the world
    # group in the window as torch's flight recorder numbers and times them, (collective_seq_id,
    # time.time() when this rank reached the op), and torch's name of the op ("gloo:all_reduce").
    arrivals: list[Arrival] = Field(default_factory=list, max_length=MAX_ARRIVALS)
    backend_op: str = Field("", max_length=80)
    # The main thread's run delay between its first and last arrival (the span the arrivals judge),
    # from the watchdog's samples at each tick; None where not sampled.
    arrivals_run_delay_s: float | None = Field(None, ge=0)
    # The main thread's time in the input pipeline (a DataLoader's next batch), None where not timed;
    # this rank's wall clock less the reference rank's, as the store's notifications measure it;
    # its TCP connections' traffic (none where they are not TCP, or the OS does not tell).
    input_s: float | None = Field(None, ge=0)
    clock_offset_s: float | None = Field(None, allow_inf_nan=False)
    links: list[LinkSample] = Field(default_factory=list, max_length=MAX_LINKS)


class WindowEvidence(Model):
    """One window of a straggler incident as the raising rank assessed it."""

    n: int
    end: float
    compute_frac: float  # the rank's share of the window spent computing
    wait_frac: float  # ... and waiting in collectives
    peers_compute_frac: float  # the median over its fresh watched peers
    peers_wait_frac: float
    slowdown: float  # work_frac / peers_work_frac where known, otherwise compute_frac / peers_compute_frac
    # Where every rank compared tells its run delay: the share it was runnable without a CPU, and the
    # compute share less it (what the rank itself took), its own and its peers' median.
    run_delay_frac: float | None = None
    work_frac: float | None = None
    peers_work_frac: float | None = None
    op_wait_s: float  # the transfer: the least median op time among the rank and its peers
    baseline_op_wait_s: float | None = None  # the least seen in earlier windows
    phase: str = Field("", max_length=200)
    op: str = Field("", max_length=80)
    # Where the compute and wait figures come from: "records", ncclguard's records of the main
    # thread's synchronous collectives; "backend", the arrivals torch's flight recorder timed (ops
    # issued from C++ included), over ``common_ops`` ops every rank compared holds.
    source: Literal["records", "backend"] = "records"
    common_ops: int | None = None
    # The shares of the window spent in the input pipeline, its own and its peers' median (None
    # where a rank compared does not time it); the clock offset taken out of its arrivals; every
    # link compared (source, destination, bytes, busy seconds).
    input_frac: float | None = None
    peers_input_frac: float | None = None
    clock_offset_s: float | None = None
    links: list[LinkSample] = Field(default_factory=list, max_length=64)


class StragglerReport(Model):
    """What a ``straggler`` incident says: who, how much slower, where the time goes, and the evidence."""

    rank: int  # the slow rank (compute, input), or the rank that raised it (link)
    cause: Literal["compute", "link", "input"]
    slowdown: float  # compute: its compute over its peers'; link: the transfer over its baseline
    where: str  # one line: "compute in phase 'train step=3'", "the transfer itself in all_reduce"
    ranks: list[int] = Field(default_factory=list, max_length=1024)  # link: the ranks whose transfers slowed
    culprit: str = Field("", max_length=200)  # one line: "rank 2", "host 198.18.1.3", "the link a <-> b"
    windows: list[WindowEvidence] = Field(default_factory=list, max_length=100)
