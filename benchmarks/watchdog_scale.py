"""The watchdog's store protocol at 64, 256 and 1,024 simulated ranks against one real TCPStore.

Each simulated rank is a real :class:`ncclguard.watching.watchdog.Watchdog` whose loop
(``Watchdog._run``: heartbeats, watched peers, the hang and desync detectors, incident claim,
statements, merge, the ladder) runs on a thread of its own, with its own TCPStore client, against
one TCPStore server; only the rank's state is synthetic (:class:`SimState`: no process group, so
the backend sequence number follows a schedule). Ranks live in a few worker processes (``--procs``)
with one thread each; nothing else is shared between them.

Schedule: every rank's backend number in group ``"0"`` goes up by one every ``--step`` seconds from
``t0``. After ``--steps`` steps the culprit (rank ``N // 3``) stops one op short: from then on the
others wait in op ``#steps + 1`` (issued, never matched) and the culprit stays at ``#steps`` in an
"eval" phase. That is a desync, which the watchdog must report within ``hang_timeout_s`` plus two
heartbeats of its start.

Measured per size: store requests per second per rank in a steady window before the desync (each
client counts its requests: ``set``, ``get``, ``add``, ``check``, ``multi_get``, ``compare_set``),
requests per heartbeat per rank, requests per beat the ranks actually made in the window (the
protocol's cost whatever the load), the time from the desync's start to ``incident.json`` on disk, who
the report names, and the resident memory of the worker processes (minus their size once torch
and ncclguard are imported) and of the server's process.

``--gloo-ranks 16`` also runs the desync scenario of ``tests/workers/diagnosis_worker.py`` on that
many real gloo ranks (torchrun, through ``tests/harness.py``, bounded): rank 2 skips an all_reduce
and evaluates while the others wait; measured: the time to the report, who it names, and the
resident memory of all the ranks together.

The latencies (``raised_after_s``, ``on_disk_after_s`` from the desync's start, per size and run)
are also gathered under ``"latency"`` with their min, median and max against the bound.
``tests/watching/test_watching_scale.py`` runs this protocol at 32 and 128 ranks but asserts only who is
named, requests per beat done, and a generous hang guard; its figures are measured here, under the
test's settings::

    python benchmarks/watchdog_scale.py --ranks 32 128 --procs 2 --heartbeat 2 --hang 4 --warm 4 \
        --window 8 --connect-timeout 120 --max-report-wait 70 --max-wait 120 --together --repeat 1 \
        --json benchmarks/results/watchdog_scale_ci.json

Usage: python benchmarks/watchdog_scale.py [--ranks 64 256 1024] [--gloo-ranks 16] [--together] [--repeat N] [--json benchmarks/results/watchdog_scale.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

RESULT = "RESULT "
GROUP = "0"
# c10d's TCPStore client and server look up each peer's name (getnameinfo, for their log lines) on
# every connect; on this machine /etc/hosts has no entry for ::ffff:127.0.0.1, the lookup goes to the
# DNS server, and about 1 in 30 went unanswered for glibc's default 5 s, stalling the server's loop
# (strace: poll on a socket to port 53, 5000 ms). One second and one try keeps 1,024 connects short.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process, MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Schedule:
    """Every rank's backend sequence number as a function of time (see the module's docstring)."""

    def __init__(self, t0: float, step: float, steps: int, culprit: int) -> None:
        self.t0, self.step, self.steps, self.culprit = t0, step, steps, culprit

    @property
    def hang_start(self) -> float:
        """``time.time()`` when the others issue the op the culprit never issues."""
        return self.t0 + self.steps * self.step

    def seq(self, rank: int, now: float) -> int:
        n = max(1, int((now - self.t0) // self.step) + 1)
        return min(n, self.steps if rank == self.culprit else self.steps + 1)


def _counted(name: str) -> Any:
    """A method of :class:`CountingStore` that counts one request and forwards it."""

    def method(self: CountingStore, *args: Any) -> Any:
        self.counter[0] += 1
        return getattr(self._inner, name)(*args)

    method.__name__ = name
    return method


class CountingStore:
    """A TCPStore client that counts its requests (``counter[0]``); ``clone()`` counts into the same."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self.counter = inner, counter

    @property
    def host(self) -> str:
        return self._inner.host

    @property
    def port(self) -> int:
        return self._inner.port

    def clone(self) -> CountingStore:
        return CountingStore(self._inner.clone(), self.counter)

    set = _counted("set")
    get = _counted("get")
    add = _counted("add")
    check = _counted("check")
    multi_get = _counted("multi_get")
    compare_set = _counted("compare_set")
    delete_key = _counted("delete_key")
    wait = _counted("wait")


def sim_state_class() -> type:
    """:class:`SimState` (built after torch is imported, in the worker)."""
    from ncclguard.incidents.model import BackendOp, Heartbeat, OpRecord, PeerView, Statement
    from ncclguard.watching.sensors.rank_state import RankState

    class SimState(RankState):
        """A rank's state without a process group: its backend number follows the schedule."""

        def __init__(self, rank: int, world_size: int, schedule: Schedule) -> None:
            super().__init__(rank, world_size)
            self.schedule, self.pid = schedule, 100_000 + rank

        def _behind(self) -> bool:
            return self.rank == self.schedule.culprit and time.time() >= self.schedule.hang_start

        def backend_seq(self) -> dict[str, int] | None:
            return {GROUP: self.schedule.seq(self.rank, time.time())}

        def inflight(self) -> list[OpRecord]:
            return []

        def records(self, *args: Any, **kwargs: Any) -> list[OpRecord]:
            return []

        def blocked_in(self) -> OpRecord | None:
            return None

        def completed(self, key: tuple[str, int]) -> bool:
            return False

        def threads(self) -> dict[str, list[str]]:
            return {"MainThread (1)": [self._site()]}

        def groups(self) -> dict[str, list[int]]:
            return {GROUP: list(range(self.world_size))}

        def _site(self) -> str:
            return "/sim/eval.py:20" if self._behind() else "/sim/train.py:10"

        def heartbeat(self, beat: int) -> Heartbeat:
            return Heartbeat(
                rank=self.rank,
                host="sim",
                pid=self.pid,
                beat=beat,
                time=time.time(),
                phase="eval" if self._behind() else "train",
                site=self._site(),
                last_seq={},
                last_completed={},
                inflight=[],
                backend_seq=self.backend_seq(),
            )

        def statement(self, beat: int, peers: dict[str, PeerView]) -> Statement:
            hb = self.heartbeat(beat)
            seq = (hb.backend_seq or {})[GROUP]
            op = BackendOp(
                seq=seq,
                name="sim:all_reduce",
                sizes=[[4]],
                dtypes=["Float"],
                created=self.schedule.t0 + (seq - 1) * self.schedule.step,
                state="scheduled",
                completed=seq <= self.schedule.steps,
            )
            return Statement(
                **dict(hb),
                world_size=self.world_size,
                stack=[f"{self._site()} in step"],
                groups=self.groups(),
                peers=dict(peers),
                backend_ops={GROUP: op},
            )

    return SimState


_start_lock = threading.Lock()


def start_sim_watchdog(store: Any, rank: int, world: int, state: Any, config: Any) -> Any:
    """A real Watchdog for ``rank``, started by ``Watchdog.start`` with ``state`` as its rank's state.

    ``start`` takes the rank from ``RANK``/``WORLD_SIZE`` without a process group, builds its state
    with the module's ``RankState`` and allows one watchdog per process; for the simulation those
    are set (and put back) around each start, under a lock.
    """
    import ncclguard.watching.watchdog as wmod
    import ncclguard.watching.world_watch as watch_mod

    with _start_lock:
        saved = watch_mod.RankState, os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        watch_mod.RankState = lambda r, w: state  # type: ignore[assignment,misc]
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        try:
            wd = wmod.Watchdog(config, store=store).start()
        finally:
            wmod._running.watchdog = None  # one per process in a job; the simulation runs many
            watch_mod.RankState = saved[0]  # type: ignore[misc]
            for name, value in (("RANK", saved[1]), ("WORLD_SIZE", saved[2])):
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if wd.watch is None or wd.watch.state is not state:
        raise RuntimeError("WorldWatch no longer builds its state with the module's RankState")
    return wd


def stop_all(wds: list[Any]) -> None:
    """Stops the watchdogs: all told first, then each waited for."""
    for wd in wds:
        wd._stop.set()
    for wd in wds:
        wd.stop(timeout=5)


class Tally(logging.Handler):
    """Counts the ncclguard log lines by their start, and keeps the unexpected ones."""

    EXPECTED = ("watchdog: incident", "watchdog: hang:", "watchdog: ignored", "watchdog: no store")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()
        self.odd: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().split("] ", 1)[-1]
        self.counts[f"{record.levelname} {re.sub(r'[0-9]+', '#', text)[:40]}"] += 1
        if record.levelno >= logging.WARNING and not text.startswith(self.EXPECTED) and len(self.odd) < 20:
            exc = record.exc_info[1] if record.exc_info else None
            self.odd.append(text[:300] + (f" ({type(exc).__name__}: {exc})" if exc is not None else ""))


def worker(args: argparse.Namespace) -> None:
    """One process's share of the simulated ranks (``--lo`` to ``--hi``)."""
    import torch.distributed as dist

    from ncclguard.watching.base.settings import WatchdogConfig

    tally = Tally()
    logging.getLogger("ncclguard").addHandler(tally)
    logging.getLogger("ncclguard").setLevel(logging.INFO)
    baseline = rss_mib()
    host, port = args.store.rsplit(":", 1)

    def connect(_: int) -> Any:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))

    control = connect(0)
    ranks = list(range(args.lo, args.hi))
    counters = {r: [0] for r in ranks}
    with ThreadPoolExecutor(8) as pool:
        clients = dict(zip(ranks, pool.map(connect, ranks), strict=True))
    control.add("sim/ready", len(ranks))
    t0 = float(control.get("sim/t0"))
    schedule = Schedule(t0, args.step, args.steps, args.culprit)
    config = WatchdogConfig(
        heartbeat_s=args.heartbeat,
        hang_timeout_s=args.hang,
        incident_dir=args.incident_dir,
        instrument=False,
        session="scale",
        store_timeout_s=args.store_timeout,
    )
    SimState = sim_state_class()
    wds = [
        start_sim_watchdog(
            CountingStore(clients[r], counters[r]), r, args.world, SimState(r, args.world, schedule), config
        )
        for r in ranks
    ]
    started = rss_mib()
    # The steady window: after every rank has beaten a few times, before the desync.
    window = (t0 + args.warm, t0 + args.warm + args.window)
    time.sleep(max(0.0, window[0] - time.time()))
    first = {r: c[0] for r, c in counters.items()}
    first_beats = {r: wd.watch.beats for r, wd in zip(ranks, wds, strict=True)}
    time.sleep(max(0.0, window[1] - time.time()))
    last = {r: c[0] for r, c in counters.items()}
    beats = {r: wd.watch.beats for r, wd in zip(ranks, wds, strict=True)}
    steady_rss, steady_threads = rss_mib(), threading.active_count()
    end = time.time() + args.max_wait
    while time.time() < end and not control.check(["sim/stop"]):
        time.sleep(0.2)
    stop_all(wds)
    incidents = Counter(i["kind"] for wd in wds for i in wd.incidents)
    out = {
        "lo": args.lo,
        "hi": args.hi,
        "requests_in_window": {str(r): last[r] - first[r] for r in ranks},
        "beats_at_window_end": {str(r): b for r, b in beats.items()},
        "beats_in_window": {str(r): beats[r] - first_beats[r] for r in ranks},
        "rss_baseline_mib": baseline,
        "rss_started_mib": started,
        "rss_steady_mib": steady_rss,
        "threads_steady": steady_threads,
        "incidents_by_kind": dict(incidents),
        "handled_by": sum(1 for wd in wds if wd.incidents),
        "log_counts": dict(tally.counts),
        "odd_log_lines": tally.odd,
    }
    print(RESULT + json.dumps(out), flush=True)


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run at ``n`` simulated ranks: the steady window, then the desync and its report."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    server_rss0 = rss_mib()
    incident_dir = Path(tempfile.mkdtemp(prefix=f"ncclguard-scale-{n}-"))
    culprit = n // 3
    procs = min(args.procs, n)
    bounds = [(i * n // procs, (i + 1) * n // procs) for i in range(procs)]
    steps = int((args.warm + args.window) / args.step) + 2
    common = [
        *("--store", f"127.0.0.1:{server.port}", "--world", str(n), "--culprit", str(culprit)),
        *("--heartbeat", str(args.heartbeat), "--hang", str(args.hang), "--step", str(args.step)),
        *("--steps", str(steps), "--warm", str(args.warm), "--window", str(args.window)),
        *("--incident-dir", str(incident_dir), "--store-timeout", str(args.store_timeout)),
        *("--max-wait", str(args.max_wait)),
    ]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--lo", str(lo), "--hi", str(hi), *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for lo, hi in bounds
    ]
    try:
        deadline = time.time() + args.connect_timeout
        while server.add("sim/ready", 0) < n:
            if time.time() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"only {server.add('sim/ready', 0)} of {n} simulated ranks connected in time")
            time.sleep(0.1)
        connected_s = time.time() - (deadline - args.connect_timeout)
        t0 = time.time() + 1.0
        server.set("sim/t0", repr(t0))
        schedule = Schedule(t0, args.step, steps, culprit)
        bound = args.hang + 2 * args.heartbeat
        found: Path | None = None
        give_up = schedule.hang_start + args.hang + args.max_report_wait
        while time.time() < give_up and found is None:
            time.sleep(0.05)
            found = next(iter(incident_dir.glob("*/incident.json")), None)
        server_rss = rss_mib()
        report: dict[str, Any] = {"found": False}
        if found is not None:
            time.sleep(0.2)  # the file is written by rename: complete once there
            inc = json.loads(found.read_text())
            written = inc["written_at"]
            report = {
                "found": True,
                "kind": inc["incident"]["kind"],
                "raised_after_s": round(inc["incident"]["created"] - schedule.hang_start, 3),
                "on_disk_after_s": round(written - schedule.hang_start, 3),
                "bound_s": bound,
                "within_bound": written - schedule.hang_start <= bound,
                "culprits": [c["rank"] for c in inc["culprits"]],
                "culprit_expected": culprit,
                "victims": len(inc["victims"]),
                "statements_from": len(inc["statements_from"]),
                "summary": inc["summary"][:300],
            }
            time.sleep(2 * args.heartbeat)  # let every rank handle it before stopping
        server.set("sim/stop", "1")
        results = []
        for w in workers:
            stdout, _ = w.communicate(timeout=args.max_wait + 60)
            line = next((x for x in stdout.splitlines() if x.startswith(RESULT)), None)
            if line is None:
                raise RuntimeError(f"a worker ended without a result (status {w.returncode})")
            results.append(json.loads(line[len(RESULT) :]))
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    per_rank = [v / args.window for res in results for v in res["requests_in_window"].values()]
    beats = [b for res in results for b in res["beats_at_window_end"].values()]
    # Requests per beat each rank actually made: what the protocol costs per beat, whatever the
    # load (a starved machine beats less often, so its requests per second fall with its beats).
    window_requests = sum(v for res in results for v in res["requests_in_window"].values())
    window_beats_done = sum(v for res in results for v in res["beats_in_window"].values())
    window_beats = args.window / args.heartbeat
    return {
        "ranks": n,
        "procs": procs,
        "start_and_connect_s": round(connected_s, 1),
        "requests_per_s_per_rank": {
            "mean": round(statistics.fmean(per_rank), 2),
            "min": round(min(per_rank), 2),
            "max": round(max(per_rank), 2),
        },
        "requests_per_heartbeat_per_rank": round(statistics.fmean(per_rank) * args.heartbeat, 2),
        "requests_per_beat_done": round(window_requests / window_beats_done, 2) if window_beats_done else None,
        "beats_in_window_total": window_beats_done,
        "requests_per_s_total": round(sum(per_rank), 1),
        "beats_at_window_end": {"min": min(beats), "max": max(beats)},
        "expected_beats_at_window_end": round((args.warm + args.window + 1.0) / args.heartbeat, 1),
        "heartbeats_in_window": window_beats,
        "report": report,
        "memory_mib": {
            "workers_total": round(sum(r["rss_steady_mib"] for r in results), 1),
            "workers_baseline_total": round(sum(r["rss_baseline_mib"] for r in results), 1),
            "per_rank_above_baseline": round(sum(r["rss_steady_mib"] - r["rss_baseline_mib"] for r in results) / n, 3),
            "server_process_growth": round(server_rss - server_rss0, 1),
        },
        "threads_per_worker": [r["threads_steady"] for r in results],
        "incidents_by_kind": dict(sum((Counter(r["incidents_by_kind"]) for r in results), Counter())),
        "ranks_that_handled_an_incident": sum(r["handled_by"] for r in results),
        "log_counts": dict(sum((Counter(r["log_counts"]) for r in results), Counter())),
        "odd_log_lines": [x for r in results for x in r["odd_log_lines"]][:10],
    }


def run_gloo(n: int) -> dict[str, Any]:
    """The desync scenario of tests/workers/diagnosis_worker.py on ``n`` real gloo ranks."""
    import psutil

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from harness import run_ranks

    peak: dict[str, float] = {"rss_mib": 0.0, "ranks": 0, "max_rank_mib": 0.0, "launcher_mib": 0.0}
    stop = threading.Event()

    def sample() -> None:  # every rank process's resident memory, summed, every 0.5 s
        while not stop.is_set():
            rss, launcher = [], 0.0
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                cmd = [str(a) for a in p.info["cmdline"] or []]
                if p.info["memory_info"] is None or not any(a.endswith("diagnosis_worker.py") for a in cmd):
                    continue
                if "torch.distributed.run" in cmd or any(a.endswith("torchrun") for a in cmd):
                    launcher = p.info["memory_info"].rss / 2**20  # the launcher, not a rank
                else:
                    rss.append(p.info["memory_info"].rss / 2**20)
            if sum(rss) > peak["rss_mib"]:
                peak.update(rss_mib=sum(rss), ranks=len(rss), max_rank_mib=max(rss), launcher_mib=launcher)
            stop.wait(0.5)

    load_before = os.getloadavg()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.monotonic()
    try:
        job = run_ranks("diagnosis_worker", n, "desync", timeout_s=540)
    finally:
        stop.set()
    wall = time.monotonic() - t
    first = json.loads((sorted((job.out_dir / "incidents").iterdir())[0] / "incident.json").read_text())
    start = min(job[r]["desync_start"] for r in range(n) if "desync_start" in job[r])
    hb, hang = 0.3, 1.5  # the worker's settings
    return {
        "ranks": n,
        "command": f"run_ranks('diagnosis_worker', {n}, 'desync') (tests/harness.py, torchrun, gloo)",
        "wall_s": round(wall, 1),
        "loadavg_before": load_before,
        "peak_rss_mib_all_ranks": round(peak["rss_mib"], 1),
        "rank_processes_sampled": peak["ranks"],
        "peak_rss_mib_per_rank": round(peak["rss_mib"] / max(1, peak["ranks"]), 1),
        "largest_rank_rss_mib": round(peak["max_rank_mib"], 1),
        "launcher_rss_mib": round(peak["launcher_mib"], 1),
        "memory_total_mib": round(psutil.virtual_memory().total / 2**20),
        "report": {
            "kind": first["incident"]["kind"],
            "findings": [f["kind"] for f in first["findings"]],
            "on_disk_after_s": round(first["written_at"] - start, 3),
            "heartbeat_s": hb,
            "hang_timeout_s": hang,
            "bound_s": hang + 2 * hb,
            "culprits": [c["rank"] for c in first["culprits"]],
            "victims": len(first["victims"]),
            "statements_from": len(first["statements_from"]),
            "summary": first["summary"][:300],
        },
    }


def latency_summary(runs: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """Per size: the desync-to-report latencies of its runs, their min, median and max, the bound."""
    out: dict[str, Any] = {}
    for n in sorted({r["ranks"] for r in runs}):
        reports = [r["report"] for r in runs if r["ranks"] == n]
        found = [x for x in reports if x.get("found")]
        row: dict[str, Any] = {"runs": len(reports), "found": len(found), "bound_s": bound}
        for key in ("raised_after_s", "on_disk_after_s"):
            values = [x[key] for x in found]
            row[key] = values
            if values:
                row[f"{key}_min_median_max"] = [min(values), round(statistics.median(values), 3), max(values)]
        row["within_bound"] = sum(1 for x in found if x["within_bound"])
        row["named_the_culprit_alone"] = sum(1 for x in found if x["culprits"] == [x["culprit_expected"]])
        out[str(n)] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="*", default=[64, 256, 1024])
    p.add_argument("--gloo-ranks", type=int, default=0, help="also run the desync worker on this many gloo ranks")
    p.add_argument("--procs", type=int, default=4, help="worker processes (threads of ranks in each)")
    p.add_argument("--heartbeat", type=float, default=5.0, help="heartbeat_s (the product default)")
    p.add_argument("--hang", type=float, default=15.0, help="hang_timeout_s")
    p.add_argument("--store-timeout", type=float, default=2.0)
    p.add_argument("--step", type=float, default=1.0, help="seconds between backend ops before the desync")
    p.add_argument("--warm", type=float, default=10.0, help="seconds from t0 to the steady window")
    p.add_argument("--window", type=float, default=30.0, help="seconds of the steady window")
    p.add_argument("--connect-timeout", type=float, default=180.0)
    p.add_argument("--max-report-wait", type=float, default=60.0)
    p.add_argument("--max-wait", type=float, default=240.0, help="a worker's longest wait for the end")
    p.add_argument("--together", action="store_true", help="run all sizes at once (as the CI test does)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each size, for the spread of the latencies")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--lo", "--hi", "--world", "--culprit", "--steps"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--incident-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    def timed(n: int) -> dict[str, Any]:
        t = time.monotonic()
        res = run_size(n, args)
        res["wall_s"] = round(time.monotonic() - t, 1)
        print(json.dumps(res, indent=1), flush=True)
        return res

    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        if args.together and args.ranks:
            with ThreadPoolExecutor(len(args.ranks)) as pool:
                runs.extend(pool.map(timed, args.ranks))
        else:
            runs.extend(timed(n) for n in args.ranks)
    out: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg_at_end": os.getloadavg(),
        },
        "settings": {
            "heartbeat_s": args.heartbeat,
            "hang_timeout_s": args.hang,
            "watch_peers": 16,
            "store_timeout_s": args.store_timeout,
            "window_s": args.window,
            "procs": args.procs,
            "together": args.together,
            "repeat": args.repeat,
        },
        "latency": latency_summary(runs, args.hang + 2 * args.heartbeat),
        "runs": runs,
    }
    if args.gloo_ranks:
        out["gloo_desync"] = run_gloo(args.gloo_ranks)
        out["machine"]["loadavg_at_end"] = os.getloadavg()
        print(json.dumps(out["gloo_desync"], indent=1), flush=True)
    if len(args.ranks) > 1:
        rates = {n: [r["requests_per_s_per_rank"]["mean"] for r in runs if r["ranks"] == n] for n in args.ranks}
        base = statistics.fmean(rates[args.ranks[0]])
        out["per_rank_rate_vs_smallest"] = {str(n): round(statistics.fmean(v) / base, 3) for n, v in rates.items()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
