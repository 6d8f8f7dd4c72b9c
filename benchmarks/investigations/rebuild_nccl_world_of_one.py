"""rebuild_world on a world-of-one NCCL group (needs one GPU): abandon, rebuild, all_reduce on CUDA.

NCCL refuses two ranks on one GPU, so this is the multi-rank-free check of the NCCL path.
``python benchmarks/investigations/rebuild_nccl_world_of_one.py > result.json``
"""

import json
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import ncclguard

out = {}
dist.init_process_group("nccl", device_id=torch.device("cuda:0"), timeout=__import__("datetime").timedelta(seconds=30))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
out["before"] = t.tolist()
t0 = time.monotonic()
res = ncclguard.rebuild_world(timeout=20)
out["rebuild_ok"] = bool(res)
out["elapsed_s"] = time.monotonic() - t0
out["result"] = {k: getattr(res, k) for k in ("generation", "rank", "world_size", "rank_map", "missing_ranks")}
out["backend_after"] = str(dist.get_backend())
t = torch.full((4,), 3.0, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
out["after"] = t.tolist()
r = ncclguard.safe_all_reduce(torch.ones(8, device="cuda"), timeout=10)
out["safe_ok"] = bool(r)
print(json.dumps(out, default=str))
os._exit(0)
