"""How late a waiting CPU thread learns that an NCCL all_reduce finished on the GPU (one GPU).

World-of-one NCCL group. Each iteration: GPU idle; host timestamp h0 then event e0; a sleep kernel
of known duration; all_reduce; work.wait() (stream order only); event e_done on the current stream
(completes when the all_reduce does); then the wait under test. GPU done = h0 + elapsed(e0, e_done);
lateness = host time the wait returned - GPU done. Waits interleaved.
"""

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ncclguard.collectives.completion import wait_gpu_work


def poll_growing(work, deadline):
    pause = 5e-5
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()


def blocking_event(work, deadline):
    e = torch.cuda.Event(blocking=True)
    e.record()
    e.synchronize()


def spin_query(work, deadline):
    e = torch.cuda.Event()
    e.record()
    while not e.query():
        pass


WAITS = {
    "floor: blocking event.synchronize() in this thread": lambda w, d, pg: blocking_event(w, d),
    "floor: spinning on event.query() (burns a core)": lambda w, d, pg: spin_query(w, d),
    "ncclguard event wait": lambda w, d, pg: wait_gpu_work(w, d, pg),
    "old: is_completed + sleeps growing to 2 ms": lambda w, d, pg: poll_growing(w, d),
    "torch work.wait(timeout)": lambda w, d, pg: w.wait(timeout=timedelta(seconds=d - time.monotonic())),
}


def main(iters, sleep_us, path):
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    pg = dist.group.WORLD
    t = torch.ones(1 << 20, device="cuda")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(5_000_000)
    b.record()
    b.synchronize()
    cyc_per_us = 5_000_000 / (a.elapsed_time(b) * 1000)
    late = {n: [] for n in WAITS}
    names = list(WAITS)
    for i in range(iters * len(names)):
        name = names[i % len(names)]
        torch.cuda.synchronize()
        e0, e_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        e0.record()
        torch.cuda._sleep(int(sleep_us * cyc_per_us))
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        e_done.record()
        WAITS[name](work, time.monotonic() + 30, pg)
        returned = time.perf_counter()
        e_done.synchronize()
        late[name].append((returned - (h0 + e0.elapsed_time(e_done) / 1000)) * 1e6)
    res = {}
    for n, xs in late.items():
        xs.sort()
        res[n] = {
            "n": len(xs),
            "median_us": round(statistics.median(xs), 1),
            "p90_us": round(xs[int(0.9 * (len(xs) - 1))], 1),
            "p99_us": round(xs[int(0.99 * (len(xs) - 1))], 1),
            "min_us": round(xs[0], 1),
            "max_us": round(xs[-1], 1),
        }
        print(
            f"{n:<45} median {res[n]['median_us']:>8} µs  p90 {res[n]['p90_us']:>8}  p99 {res[n]['p99_us']:>8}  min {res[n]['min_us']:>7}"
        )
    doc = {
        "command": f"python benchmarks/investigations/nccl_wait_lateness.py {iters} {sleep_us}",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "kernel_before_us": sleep_us,
        "lateness_after_gpu_done": res,
    }
    open(path, "w").write(json.dumps(doc, indent=1))
    dist.destroy_process_group()


main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
