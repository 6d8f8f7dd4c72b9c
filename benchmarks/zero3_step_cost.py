"""What instrument() plus a watchdog cost a DeepSpeed ZeRO-3 step (issue 29): step time with and without.

    .venv/bin/python benchmarks/zero3_step_cost.py [--rounds 6] [--steps 12] [--layers 48] [--json PATH]
    PYTHONPATH=/path/to/another/tree .venv/bin/python benchmarks/zero3_step_cost.py   # that tree's ncclguard

Two gloo ranks on this host (DeepSpeed's CPU accelerator, ``deepspeed.init_distributed(dist_backend=
"gloo")``) train a small model with many parameter groups under ZeRO stage 3: ``--layers`` blocks of
``Linear(dim, dim)`` + GELU, no parameter persistent (``stage3_param_persistence_threshold: 0``), no
prefetch, a reduce bucket of one element, so every block's parameters are gathered in the forward
and every block's gradients reduce-scattered in the backward, from Python, as on a large model.

Every round runs one block of steps per mode, the order rotating (a Williams Latin square row), so
noise from other jobs lands on each mode alike:

- ``off``, ``off2``: nothing of ncclguard; ``off2 / off`` is the noise floor of this run;
- ``on``: ``instrument()``, ``start_watchdog()`` with its default heartbeat, each step in
  ``phase("train", step=i)``.

``instrument()`` is called before ``deepspeed.init_distributed``, as a DeepSpeed user does:
DeepSpeed binds ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor`` once, when
its communication backend starts. Each block re-binds them to what ``torch.distributed`` holds then
(the wrapper in ``on`` blocks, torch's own in the others), which is what a process that called
``instrument()`` before ``init_distributed``, or did not, would hold.

Per step: the slowest rank's wall time; per block: process CPU time, the collectives ncclguard
recorded (``recorder.last_seq()``) and the collectives the backend ran (its sequence number per
group). The verdict: ``on / off`` of the median step time per round (median over rounds, with the
range), against ``off2 / off``; the same for CPU time per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("off", "off2", "on")
TARGET = 1.01


def order(r: int) -> list[str]:
    """Round ``r``'s order of the three modes: a Williams Latin square (rows of 3, then reversed),
    so each mode takes each place and follows each other mode equally often over 6 rounds."""
    rows = [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    row = rows[r % 3] if (r // 3) % 2 == 0 else rows[r % 3][::-1]
    return [MODES[i] for i in row]


# ----------------------------------------------------------------------------- one rank


def _worker(args: argparse.Namespace) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    import ncclguard
    from ncclguard import _torch_compat as compat
    from ncclguard.recording.instrument import instrument, uninstrument

    torch.set_num_threads(1)
    under_callgrind = args.callgrind_child

    def callgrind(command: str) -> None:
        """Tells callgrind (this process runs under it) to zero (-z) or dump (-d) its counts, or to
        start instrumenting (-i on), and waits until it did."""
        if under_callgrind:
            ctl = subprocess.Popen(["callgrind_control", *command.split(), str(os.getpid())], stdout=subprocess.DEVNULL)
            while ctl.poll() is None:
                time.sleep(0.001)

    instrument()  # before DeepSpeed binds its gather and reduce-scatter (see the module doc)
    deepspeed.init_distributed(dist_backend="gloo")
    uninstrument()
    rank, world = dist.get_rank(), dist.get_world_size()
    cdb = deepspeed.comm.comm.cdb

    def rebind() -> None:  # what DeepSpeed would hold had it started now
        cdb.all_gather_function = dist.all_gather_into_tensor
        cdb.reduce_scatter_function = dist.reduce_scatter_tensor

    rebind()
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.dim, args.dim), torch.nn.GELU()) for _ in range(args.layers)]
    model = torch.nn.Sequential(*blocks)
    config = {
        "train_batch_size": args.batch * world,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": 1,
            "overlap_comm": False,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.batch, args.dim, generator=gen) for _ in range(4)]

    def step(i: int) -> None:
        loss = engine(xs[i % len(xs)]).pow(2).mean()
        engine.backward(loss)
        engine.step()

    groups = list(compat.group_names())

    def backend_ops() -> int:
        return sum(compat.sequence_number(g) or 0 for g in groups)

    def recorded() -> int:
        return sum(ncclguard.recorder.last_seq().values())

    incident_dir = tempfile.mkdtemp(prefix="ncclguard-zero3-")
    i = 0
    for _ in range(args.warmup):
        step(i)
        i += 1
    callgrind("-i on")
    out = []
    for r in range(args.rounds):
        for mode in order(r):
            on = mode == "on"
            dist.barrier()
            if on:
                instrument()
                ncclguard.start_watchdog(hang_timeout_s=120.0, incident_dir=incident_dir, action="report")
            rebind()
            for _ in range(args.settle):
                with ncclguard.phase("train", step=i) if on else contextlib.nullcontext():
                    step(i)
                i += 1
            callgrind("-z")  # from here to the dump: this block's timed steps, every thread of the process
            b0, c0, p0 = backend_ops(), recorded(), time.process_time()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                with ncclguard.phase("train", step=i) if on else contextlib.nullcontext():
                    step(i)
                times.append(time.perf_counter() - t0)
                i += 1
            cpu = time.process_time() - p0
            callgrind("-d")
            rec, ran = recorded() - c0, backend_ops() - b0
            if on:
                wd = ncclguard.current_watchdog()
                if wd is None:
                    raise RuntimeError("the watchdog stopped during the block")
                wd.stop()
                uninstrument()
            rebind()
            out.append({"round": r, "mode": mode, "step_s": times, "cpu_s": cpu, "recorded": rec, "backend": ran})
    idle = []
    for r in range(args.idle_rounds):  # training paused: the watchdog's whole cost is the process's CPU
        for on in (False, True) if r % 2 == 0 else (True, False):
            dist.barrier()
            if on:
                instrument()
                ncclguard.start_watchdog(hang_timeout_s=120.0, incident_dir=incident_dir, action="report")
                time.sleep(1.0)  # connected and past its first beat before the clock starts
            p0, t0 = time.process_time(), time.perf_counter()
            time.sleep(args.idle_s)
            idle.append({"on": on, "cpu_s": time.process_time() - p0, "wall_s": time.perf_counter() - t0})
            if on:
                wd = ncclguard.current_watchdog()
                if wd is not None:
                    wd.stop()
                uninstrument()
    dist.barrier()
    doc = {"rank": rank, "blocks": out, "idle": idle, "ncclguard": str(Path(ncclguard.__file__).parent.parent.name)}
    print("RESULT " + json.dumps(doc), flush=True)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- the launcher and verdict


def analyse(ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per round: the median of the slowest rank's step times and the CPU per step (both ranks) of
    each mode; the ratios ``on/off`` and ``off2/off`` per round; their medians and ranges."""
    by = [{(b["round"], b["mode"]): b for b in r["blocks"]} for r in ranks]
    rounds = sorted({k[0] for k in by[0]})
    per_round = []
    for rd in rounds:
        row: dict[str, Any] = {"round": rd}
        for mode in MODES:
            blocks = [b[(rd, mode)] for b in by]
            slowest = [max(t) for t in zip(*(b["step_s"] for b in blocks), strict=True)]
            row[mode] = {
                "median_step_s": statistics.median(slowest),
                "cpu_per_step_s": sum(b["cpu_s"] for b in blocks) / steps,
                "recorded_per_step": blocks[0]["recorded"] / steps,
                "backend_per_step": blocks[0]["backend"] / steps,
            }
        for mode in ("on", "off2"):
            row[f"{mode}/off"] = row[mode]["median_step_s"] / row["off"]["median_step_s"]
            row[f"{mode}/off cpu"] = row[mode]["cpu_per_step_s"] / row["off"]["cpu_per_step_s"]
        per_round.append(row)

    def summary(key: str) -> dict[str, float]:
        vals = [r[key] for r in per_round]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    # The watchdog runs on the clock: its CPU per second with training paused, over one core per
    # rank, is its share of a CPU-bound step (both ranks' extra CPU over their idle baseline).
    idle_on = [sum(b["cpu_s"] / b["wall_s"] for b in r["idle"] if b["on"]) for r in ranks]
    idle_off = [sum(b["cpu_s"] / b["wall_s"] for b in r["idle"] if not b["on"]) for r in ranks]
    n_idle = max(1, len([b for b in ranks[0]["idle"] if b["on"]]))
    watchdog_share = sum(on - off for on, off in zip(idle_on, idle_off, strict=True)) / n_idle / len(ranks)
    return {
        "watchdog_cpu_share": watchdog_share if ranks[0]["idle"] else None,
        "rounds": per_round,
        "on/off": summary("on/off"),
        "off2/off": summary("off2/off"),
        "on/off cpu": summary("on/off cpu"),
        "off2/off cpu": summary("off2/off cpu"),
        "recorded_per_step": statistics.median(r["on"]["recorded_per_step"] for r in per_round),
        "backend_per_step": statistics.median(r["on"]["backend_per_step"] for r in per_round),
        "step_s_off": statistics.median(r["off"]["median_step_s"] for r in per_round),
    }


def instructions(cg_dir: str, blocks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Rank 0's instructions per step of each mode (the median over its blocks) from callgrind's
    dumps, one per block in the blocks' order and per thread (``cg.out.<n>-<thread>``): the main
    thread's (the training loop and the recording), and every thread's. The watchdog's thread runs
    on the clock, and under valgrind a step lasts about 50 times longer: its share here is not its
    share of a native step (benchmarks/watchdog_cost.py measures that)."""
    by_dump: dict[int, dict[int, int]] = {}
    for path in Path(cg_dir).glob("cg.out.*-*"):
        n, thread = path.name.removeprefix("cg.out.").split("-")
        line = next(x for x in path.read_text().splitlines() if x.startswith(("summary:", "totals:")))
        by_dump.setdefault(int(n), {})[int(thread)] = int(line.split()[1])
    if sorted(by_dump) != list(range(1, len(blocks) + 1)):
        raise SystemExit(f"callgrind: dumps {sorted(by_dump)} for {len(blocks)} blocks in {cg_dir}")
    main: dict[str, list[float]] = {m: [] for m in MODES}
    every: dict[str, list[float]] = {m: [] for m in MODES}
    for k, block in enumerate(blocks, 1):
        main[block["mode"]].append(by_dump[k].get(1, 0) / steps)
        every[block["mode"]].append(sum(by_dump[k].values()) / steps)
    out: dict[str, Any] = {}
    for name, per in (("main_thread", main), ("all_threads", every)):
        med = {m: statistics.median(v) for m, v in per.items()}
        out[name] = {**med, "on/off": med["on"] / med["off"], "off2/off": med["off2"] / med["off"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds of one block per mode (default 6)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per block (default 12)")
    ap.add_argument("--settle", type=int, default=2, help="untimed steps at the start of each block")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before the first round")
    ap.add_argument("--layers", type=int, default=48, help="Linear+GELU blocks, each its own parameter group")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of each idle block (training paused)")
    ap.add_argument("--idle-rounds", type=int, default=2, help="rounds of an idle block without and with ncclguard")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument(
        "--callgrind",
        action="store_true",
        help="count rank 0's instructions per step in each block under valgrind (exact under any load; slow)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--callgrind-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.callgrind_out and os.environ.get("RANK") == "0" and not args.callgrind_child:
            # rank 0 runs again under callgrind (the same environment: its rank, the store's address)
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
            cmd.append(f"--callgrind-out-file={args.callgrind_out}")
            os.execvp("valgrind", [*cmd, sys.executable, *sys.argv, "--callgrind-child"])
        return _worker(args)
    if min(args.rounds, args.steps, args.layers, args.dim, args.batch) < 1 or args.settle < 0 or args.warmup < 0:
        ap.error("--rounds, --steps, --layers, --dim and --batch must be >= 1; --settle, --warmup >= 0")
    from ncclguard.testing.launch import spawn

    argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    for name in ("rounds", "steps", "settle", "warmup", "layers", "dim", "batch", "idle_s", "idle_rounds"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cg_dir = tempfile.mkdtemp(prefix="ncclguard-zero3-cg-") if args.callgrind else None
    if cg_dir is not None:
        argv += ["--callgrind-out", os.path.join(cg_dir, "cg.out")]
    load0 = os.getloadavg()
    res = spawn(argv, 2, timeout_s=args.timeout_s, env={"OMP_NUM_THREADS": "1"})
    load1 = os.getloadavg()
    if not res.ok:
        raise SystemExit(f"the ranks failed (timed out: {res.timed_out})\n{res.output()[-6000:]}")
    found = res.json_lines()
    if sorted(found) != [0, 1]:
        raise SystemExit(f"expected a RESULT line from ranks 0 and 1, got {sorted(found)}\n{res.output()[-4000:]}")
    got = analyse([found[0], found[1]], args.steps)
    if cg_dir is not None:
        got["instructions"] = instructions(cg_dir, found[0]["blocks"], args.steps)
    on, floor, cpu = got["on/off"], got["off2/off"], got["on/off cpu"]
    print(
        f"ZeRO-3, 2 gloo ranks, {args.layers} parameter groups of {args.dim}x{args.dim}; ncclguard: {found[0]['ncclguard']}"
    )
    print(
        f"collectives per step: {got['backend_per_step']:.0f} run by the backend, "
        f"{got['recorded_per_step']:.0f} recorded by ncclguard (on)"
    )
    print(f"step time (off, median of the rounds' medians): {got['step_s_off'] * 1e3:.1f} ms")
    print(f"{'round':>5s} {'on/off':>8s} {'off2/off':>9s} {'on/off cpu':>11s} {'off2/off cpu':>13s}")
    for r in got["rounds"]:
        print(
            f"{r['round']:5d} {r['on/off']:8.4f} {r['off2/off']:9.4f} {r['on/off cpu']:11.4f} {r['off2/off cpu']:13.4f}"
        )
    print(
        f"on/off: median {on['median']:.4f} (rounds {on['min']:.4f}..{on['max']:.4f}); noise floor off2/off: "
        f"median {floor['median']:.4f} ({floor['min']:.4f}..{floor['max']:.4f}); CPU on/off {cpu['median']:.4f} "
        f"({cpu['min']:.4f}..{cpu['max']:.4f})"
    )
    if got["watchdog_cpu_share"] is not None:
        print(
            f"the watchdog, training paused: {got['watchdog_cpu_share'] * 100:.3f}% of a core per rank "
            f"(extra process CPU per second, {args.idle_rounds} x {args.idle_s:g} s each way)"
        )
    if cg_dir is not None:
        for name, ins in got["instructions"].items():
            print(
                f"rank 0's instructions per step, {name.replace('_', ' ')} (callgrind): off {ins['off']:,.0f}, "
                f"off2 {ins['off2']:,.0f}, on {ins['on']:,.0f}; on/off {ins['on/off']:.4f}, off2/off {ins['off2/off']:.4f}"
            )
        print("(under valgrind: the wall-clock figures above are valgrind's; read the instructions)")
    print(f"1-min load {load0[0]:.2f} -> {load1[0]:.2f}, {res.wall_s:.0f} s, {os.cpu_count()} cores")
    if args.json:
        doc = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "ncclguard": found[0]["ncclguard"],
            "target": TARGET,
            "analysis": got,
            "raw": [found[0], found[1]],
            "machine": {
                "load_1min": [round(load0[0], 2), round(load1[0], 2)],
                "wall_s": round(res.wall_s, 1),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
