"""CPU cost of safe_all_reduce's own Python per 1-element call, the backend stubbed out.

torch's all_reduce is replaced by a stub that returns a completed Work (the same stub in any tree),
so what is timed is ncclguard's work alone: thread CPU ns per call in a warm loop on rank 0 of a
2-rank gloo group, and the time from entry to the backend issue. Works with any tree first on
PYTHONPATH, so an old and a new tree can be run interleaved (the ratio of the two is what to read
on a shared machine)::

    for i in 1 2 3; do
      PYTHONPATH=OLD_TREE python benchmarks/investigations/pipeline_cpu_cost.py
      PYTHONPATH=NEW_TREE python benchmarks/investigations/pipeline_cpu_cost.py
    done

(OLD_TREE and NEW_TREE: two checkouts of this repository, at the commits to compare.)
"""

import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _Work:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


_W = _Work()
_at = [0]
_clock = time.perf_counter_ns


def stub(tensor, op=None, group=None, async_op=False):
    _at[0] = _clock()
    return _W


def rank(r, port, q, done):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    import ncclguard
    from ncclguard.collectives import all_reduce as ar

    t = torch.ones(1)
    ar.safe_all_reduce(t)
    if r == 1:
        done.wait()
        dist.destroy_process_group()
        return
    ar._TORCH_ALL_REDUCE = stub
    dist.all_reduce = stub
    f = ar.safe_all_reduce
    calls = 20000
    vals = []
    for _ in range(9):
        b = time.thread_time()
        for _ in range(calls):
            f(t)
        vals.append((time.thread_time() - b) / calls * 1e9)
    pre = []
    for _ in range(20000):
        a = _clock()
        f(t)
        pre.append(_at[0] - a)
    b = time.thread_time()
    for _ in range(calls):
        stub(t, op=None, group=None, async_op=True)
    base = (time.thread_time() - b) / calls * 1e9
    q.put(
        {
            "tree": ncclguard.__file__,
            "safe_ns_median": round(statistics.median(vals) - base),
            "safe_ns_min": round(min(vals) - base),
            "entry_to_issue_ns_median": round(statistics.median(pre)),
            "entry_to_issue_ns_p10": round(sorted(pre)[len(pre) // 10]),
        }
    )
    done.set()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    done = ctx.Event()
    ps = [ctx.Process(target=rank, args=(r, port, q, done)) for r in range(2)]
    [p.start() for p in ps]
    print(json.dumps(q.get(timeout=600)))
    [p.join() for p in ps]
