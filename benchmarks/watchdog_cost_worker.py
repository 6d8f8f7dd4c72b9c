"""Rank side of benchmarks/watchdog_cost.py: a real training loop, watchdog on and off in turns.

One process per rank (started by ``benchmarks/watchdog_cost.py`` through
:func:`ncclguard.testing.launch.spawn`, or by torchrun). It trains a tiny GPT-2 (built from a
config, no download) with plain DDP or DeepSpeed ZeRO-2 on gloo, in blocks of steps. Every
round runs one block per mode, in the order of a row of a Williams Latin square, so that noise
from other jobs on the machine, and whatever a block leaves behind for the next, lands on every
mode alike:

- ``off`` and ``off2``: nothing of ncclguard (two of them: their ratio is the noise floor);
- ``wd<H>``: ``instrument()``, ``start_watchdog(heartbeat_s=H, ...)`` and every step inside
  ``phase("train", step=i)``; stopped and uninstrumented at the block's end.

Per block it records each step's wall time, the main thread's and the process's CPU time, the
watchdog thread's CPU time (read from its POSIX thread clock), the collectives recorded, and the
incidents raised. Then idle blocks (training paused, the main thread asleep; ``off`` and each
watchdog mode once per idle round, a whole number of heartbeats long): the process's CPU time there
is the watchdog's whole cost, helper threads and (rank 0, under the spawn launcher) the store
server included. It prints one line
``RESULT {json}``.

Usage (normally through the launcher): ``watchdog_cost_worker.py --stack ddp|deepspeed ...``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ncclguard
from ncclguard.recording.flight import recorder
from ncclguard.recording.instrument import instrument, is_instrumented, uninstrument

WATCHDOG_THREAD = "ncclguard-watchdog"  # the name Watchdog gives its thread


class GcClock:
    """Counts the cyclic garbage collector's runs per generation and the time they take (any
    thread), through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.runs, self.seconds = [0, 0, 0], 0.0

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.runs), self.seconds


GC = GcClock()


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", choices=("ddp", "deepspeed"), required=True)
    ap.add_argument("--heartbeats", default="1.0,0.2", help="comma-separated heartbeat_s values")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--settle", type=int, default=2, help="untimed steps at the start of every block")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="untimed training before the first round")
    ap.add_argument("--idle-s", type=float, default=4.0, help="seconds per idle block (0: none)")
    ap.add_argument("--idle-rounds", type=int, default=3, help="rounds of idle blocks (one per mode each)")
    ap.add_argument("--hang-timeout-s", type=float, default=60.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--incident-dir", default=None, help="default: a fresh temporary directory")
    return ap.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A tiny GPT-2 from a config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=1024,
        n_positions=args.seq,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def make_step(args: argparse.Namespace, rank: int) -> tuple[Callable[[int], float], int]:
    """Initialises the process group and the stack; returns (one training step, parameter count)."""
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, 1024, (args.batch, args.seq), generator=gen) for _ in range(8)]
    if args.stack == "ddp":
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

        def ddp_step(i: int) -> float:
            ids = batches[i % len(batches)]
            loss = ddp(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return float(loss.detach())

        return ddp_step, n_params
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    config = {
        "train_batch_size": args.batch * world,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def ds_step(i: int) -> float:
        ids = batches[i % len(batches)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return ds_step, n_params


def watchdog_thread() -> threading.Thread | None:
    for t in threading.enumerate():
        if t.name == WATCHDOG_THREAD:
            return t
    return None


def thread_cpu_s(t: threading.Thread | None) -> float | None:
    """CPU seconds the thread has used so far (its POSIX per-thread clock); None if it is gone."""
    if t is None or t.ident is None or not t.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    except (OSError, ProcessLookupError):
        return None


def recorded_calls() -> int:
    """Collectives the flight recorder has numbered so far (all groups)."""
    return sum(recorder.last_seq().values())


def run_block(
    mode: str, step: Callable[[int], float], first: int, args: argparse.Namespace, incident_dir: str
) -> dict[str, Any]:
    """One block of ``args.settle + args.steps`` steps in ``mode``; returns its measurements."""
    hb = float(mode[2:]) if mode.startswith("wd") else None
    gc.collect()  # what the last block left for the collector is not charged to this one
    dist.barrier()  # every rank begins the block together (untimed)
    if hb is not None:
        instrument()
        ncclguard.start_watchdog(
            heartbeat_s=hb, hang_timeout_s=args.hang_timeout_s, incident_dir=incident_dir, action="report"
        )
    wd_thread = watchdog_thread() if hb is not None else None
    i = first
    for _ in range(args.settle):  # the watchdog's thread connects to the store meanwhile
        with ncclguard.phase("train", step=i) if hb is not None else contextlib.nullcontext():
            step(i)
        i += 1
    calls0 = recorded_calls()
    GC.reset()
    wd0 = thread_cpu_s(wd_thread)
    cpu0, proc0 = time.thread_time(), time.process_time()
    times = []
    t_block = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with ncclguard.phase("train", step=i) if hb is not None else contextlib.nullcontext():
            step(i)
        times.append(time.perf_counter() - t0)
        i += 1
    wall = time.perf_counter() - t_block
    gc_runs, gc_s = GC.snapshot()
    cpu, proc = time.thread_time() - cpu0, time.process_time() - proc0
    wd1 = thread_cpu_s(wd_thread)
    instrumented = is_instrumented()
    calls = recorded_calls() - calls0
    incidents = 0
    if hb is not None:
        wd = ncclguard.current_watchdog()
        assert wd is not None, "the watchdog stopped during the block"
        incidents = len(wd.incidents)
        wd.stop()
        uninstrument()
    return {
        "mode": mode,
        "wall_s": wall,
        "step_s": times,
        "main_cpu_s": cpu,
        "proc_cpu_s": proc,
        "wd_cpu_s": (wd1 - wd0) if wd0 is not None and wd1 is not None else None,
        "instrumented": instrumented,
        "recorded_calls": calls,
        "incidents": incidents,
        "gc_collections": gc_runs,
        "gc_s": gc_s,
        "next_step": i,
    }


def idle_block(mode: str, seconds: float, args: argparse.Namespace, incident_dir: str) -> dict[str, Any]:
    """``seconds`` with the main thread asleep, in ``mode``: the process's CPU time is then the
    watchdog's whole cost (its thread, the store calls' helper threads, and on rank 0 the store
    server of the spawn launcher), undisturbed by training."""
    hb = float(mode[2:]) if mode.startswith("wd") else None
    dist.barrier()
    if hb is not None:
        instrument()
        ncclguard.start_watchdog(
            heartbeat_s=hb, hang_timeout_s=args.hang_timeout_s, incident_dir=incident_dir, action="report"
        )
        time.sleep(min(0.5, seconds / 4))  # connected and past its first beat before the clocks start
    wd_thread = watchdog_thread() if hb is not None else None
    wd0, proc0, t0 = thread_cpu_s(wd_thread), time.process_time(), time.perf_counter()
    time.sleep(seconds)
    wall, proc, wd1 = time.perf_counter() - t0, time.process_time() - proc0, thread_cpu_s(wd_thread)
    if hb is not None:
        wd = ncclguard.current_watchdog()
        assert wd is not None, "the watchdog stopped during the idle block"
        wd.stop()
        uninstrument()
    return {
        "mode": mode,
        "wall_s": wall,
        "proc_cpu_s": proc,
        "wd_cpu_s": (wd1 - wd0) if wd0 is not None and wd1 is not None else None,
    }


def order(modes: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the modes: row ``r`` of a Williams Latin square, so that over
    ``len(modes)`` rounds each mode takes each position once and follows each other mode once
    (a plain rotation would always put ``off`` right after the same watchdog block, and whatever
    a block leaves behind would land on the same mode every time)."""
    n = len(modes)
    seq, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
    while len(seq) < n:
        seq.append(lo)
        lo += 1
        if len(seq) < n:
            seq.append(hi)
            hi -= 1
    row = [modes[(x + r) % n] for x in seq]
    return row if n % 2 == 0 or (r // n) % 2 == 0 else row[::-1]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    step, n_params = make_step(args, rank)
    heartbeats = [float(h) for h in args.heartbeats.split(",") if h]
    modes = ["off", "off2", *(f"wd{h:g}" for h in heartbeats)]
    incident_dir = args.incident_dir or tempfile.mkdtemp(prefix="ncclguard-wdcost-")
    i = 0
    until = time.monotonic() + args.warmup_s
    t_warm = time.perf_counter()
    while True:  # warm-up: both ranks must run the same number of steps, so rank 0 decides when to stop
        step(i)
        i += 1
        flag = torch.tensor([1 if time.monotonic() < until else 0])
        dist.broadcast(flag, 0)
        if not int(flag):
            break
    warm = {"steps": i, "s_per_step": (time.perf_counter() - t_warm) / i}
    blocks = []
    for r in range(args.rounds):
        for mode in order(modes, r):
            b = run_block(mode, step, i, args, incident_dir)
            b["round"] = r
            i = b.pop("next_step")
            blocks.append(b)
    idle = []
    if args.idle_s > 0:  # --idle-rounds rounds, every other one in reverse order
        idle_modes = ["off", *modes[2:]]
        for r in range(args.idle_rounds):
            for mode in idle_modes if r % 2 == 0 else idle_modes[::-1]:
                hb = float(mode[2:]) if mode.startswith("wd") else None
                # a whole number of heartbeats: a window shorter than one beat may hold none
                secs = args.idle_s if hb is None else hb * max(1, round(args.idle_s / hb))
                b = idle_block(mode, secs, args, incident_dir)
                b["round"] = r
                idle.append(b)
    dist.barrier()
    out = {
        "rank": rank,
        "stack": args.stack,
        "params": n_params,
        "modes": modes,
        "warmup": warm,
        "blocks": blocks,
        "idle": idle,
        "incident_dir": incident_dir,
        "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
