"""Rank side of tests/env/test_netns_faults.py: one rank per network namespace, the store in A.

Usage: netfault_worker.py linkdown|slowlink. Each rank writes ``moving.rank<r>`` into the test's
directory once the first chunk of its large call is done (its flight record says so), so the test
acts on the link while the call moves, not after a sleep that a loaded machine can outlast.
In ``slowlink`` a thread reads both ranks' heartbeats from the store while the call runs (the
watchdog's own protocol: ``WatchdogStore``), to see the call's progress in them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

import ncclguard
from ncclguard.collectives.all_reduce import CollectiveResult
from ncclguard.errors import StoreTimeout
from ncclguard.recording.flight import recorder
from ncclguard.watching.base.watchdog_store import Keys, WatchdogStore

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])


def _start(peer_timeout_s: float) -> int:
    init = ncclguard.init_process_group("gloo", timeout=30)
    put("interface", init.plan.interface if init.plan else None)
    rank = dist.get_rank()
    ncclguard.start_watchdog(
        heartbeat_s=0.3,
        hang_timeout_s=1.5,
        peer_timeout_s=peer_timeout_s,
        incident_dir=str(OUT / "incidents"),
        action="report",
    )
    warm = torch.ones(4)
    put("warm_ok", bool(ncclguard.safe_all_reduce(warm, timeout=10)) and warm.tolist() == [2.0] * 4)
    return rank


def _tell_when_moving(rank: int) -> None:
    """Writes ``moving.rank<rank>`` once a chunked call in flight has a chunk done (within 60 s)."""

    def watch() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if any(rec.chunks and rec.chunks_done >= 1 for rec in recorder.inflight()):
                (OUT / f"moving.rank{rank}").write_text(str(time.time()))
                return
            time.sleep(0.005)

    threading.Thread(target=watch, name="moving", daemon=True).start()


def _big_call(numel: int, chunk_numel: int, timeout: float) -> tuple[torch.Tensor, CollectiveResult, float]:
    rank = dist.get_rank()
    t = torch.full((numel,), float(rank + 1))
    _tell_when_moving(rank)
    t0 = time.monotonic()
    res = ncclguard.safe_all_reduce(t, timeout=timeout, chunk_numel=chunk_numel)
    return t, res, time.monotonic() - t0


def linkdown() -> None:
    _start(peer_timeout_s=1.5)  # rank 1 cut off is reported lost well within the 6 s wait below
    _, res, took = _big_call(numel=12_000_000, chunk_numel=500_000, timeout=5.0)
    put("ok", bool(res))
    put("took_s", took)
    put("error_type", type(res.error).__name__ if res.error else None)
    put("error", str(res.error) if res.error else None)
    put("missing_ranks", getattr(res.error, "missing_ranks", None))
    put("chunk", list(res.error.chunk) if getattr(res.error, "chunk", None) else None)
    put("reduced_numel", res.reduced_numel)
    wd = ncclguard.current_watchdog()
    assert wd is not None
    seen = wd.wait_for_incident(timeout=6.0)
    put("incidents", [{"kind": i.get("kind"), "doc": i.get("doc")} for i in seen])
    rankkit.done()


def _sample_progress(stop: threading.Event, samples: list[dict]) -> None:
    """Every 0.1 s, the chunked calls in flight in both ranks' heartbeats, as the store has them."""
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    store = WatchdogStore.connect(addr, Keys.from_env("main"), 5.0, 30.0)
    while not stop.is_set():
        try:
            beats = store.read_heartbeats([0, 1])
        except StoreTimeout:
            continue
        for r, hb in beats.items():
            for rec in hb.inflight:
                if rec.chunks:
                    samples.append(
                        {"rank": r, "beat": hb.beat, "seq": rec.seq, "op": rec.op, "chunks_done": rec.chunks_done,
                         "chunks": rec.chunks, "bytes_done": rec.bytes_done}
                    )  # fmt: skip
        stop.wait(0.1)


def slowlink() -> None:
    # No rank is lost here: a peer timeout far above a loaded machine's starved beats (1.9 s once)
    # keeps a lost incident from joining the one hang the test expects while the call runs.
    _start(peer_timeout_s=6.0)
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sample_progress, args=(stop, samples), daemon=True)
    sampler.start()
    t, res, took = _big_call(numel=12_000_000, chunk_numel=500_000, timeout=20.0)
    stop.set()
    sampler.join(10)
    put("ok", bool(res))
    put("took_s", took)
    put("exact", bool(res) and bool((t == 3.0).all()))
    put("chunks", res.chunks)
    put("progress_samples", samples)
    wd = ncclguard.current_watchdog()
    assert wd is not None
    # The call outlasts hang_timeout_s: the watchdog reports it while it runs, progress included.
    seen = wd.wait_for_incident(timeout=10.0, merged=True)
    put("incidents", [{"kind": i.get("kind"), "dir": i.get("dir"), "doc": i.get("doc")} for i in seen])
    rankkit.done()


if __name__ == "__main__":
    {"linkdown": linkdown, "slowlink": slowlink}[sys.argv[1]]()
