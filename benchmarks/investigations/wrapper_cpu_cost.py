"""Thread CPU ns per call of instrument()'s wrapper around a no-op, minus the bare no-op.

A short form of recording_cost.py's ablation that runs against any tree first on PYTHONPATH
(the old layout's ncclguard.diagnosis.instrument too), for interleaved old/new runs::

    for i in 1 2 3; do
      PYTHONPATH=OLD_TREE python benchmarks/investigations/wrapper_cpu_cost.py
      PYTHONPATH=NEW_TREE python benchmarks/investigations/wrapper_cpu_cost.py
    done

(OLD_TREE and NEW_TREE: two checkouts of this repository, at the commits to compare.)
"""

import json
import statistics
import time

import torch
import torch.distributed as dist

try:
    from ncclguard.recording.instrument import _spec, _wrap
except ImportError:
    from ncclguard.diagnosis.instrument import _spec, _wrap
import ncclguard
from ncclguard import phase
from ncclguard.recording.flight import recorder


def _noop(*a, **k):
    return None


t = torch.ones(1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ar = _wrap(_spec("all_reduce", dist.all_reduce), _noop, like=dist.all_reduce)
send = _wrap(_spec("send", dist.send), _noop, like=dist.send)
calls = 50000


def loop(fn, *a, **k):
    b = time.thread_time()
    for _ in range(calls):
        fn(*a, **k)
    return (time.thread_time() - b) / calls * 1e9


out = {}
with phase("train", step=1):
    for name, (w, args, kw) in {"all_reduce": (ar, (t,), {}), "send": (send, (t,), {"dst": 0})}.items():
        vals = []
        for _ in range(7):
            recorder.clear()
            vals.append(loop(w, *args, **kw) - loop(_noop, *args, **kw))
        out[name] = round(statistics.median(vals))
        recorder.clear()
print(json.dumps({"tree": ncclguard.__file__, **out}))
dist.destroy_process_group()
