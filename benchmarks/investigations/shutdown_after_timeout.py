"""How long does a rank take to exit after one of its collectives timed out?

Rank 1 stalls for STALL seconds; rank 0's safe_all_reduce gives up after 1 s, then rank 0 exits
normally (or after destroy_process_group / ProcessGroup.abort). The gloo group's own timeout is
30 s. Usage: python benchmarks/investigations/shutdown_after_timeout.py [plain|destroy|abort] [STALL]
Result on the 2-core CI machine (torch 2.13.0): with STALL=12, rank 0 exits when rank 1 does
(13.8-16.7 s) in all three modes; with STALL=70, after 31.8 s: the group's own timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta


def rank_main(mode: str, stall: float) -> None:
    import torch
    import torch.distributed as dist

    from ncclguard import safe_all_reduce

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:
        time.sleep(stall)
        os._exit(0)
    res = safe_all_reduce(torch.ones(4), timeout=1)
    assert not res.ok
    if mode == "destroy":
        dist.destroy_process_group()
    elif mode == "abort":
        dist.distributed_c10d._get_default_group().abort()


def main() -> None:
    from ncclguard.testing.launch import free_port

    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    stall = sys.argv[2] if len(sys.argv) > 2 else "12"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, __file__, "--rank", mode, stall]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}) for r in range(2)]
    start = time.monotonic()
    try:
        procs[0].wait(timeout=float(stall) + 40)
        print(
            f"mode={mode} stall={stall}s: rank 0 exited (rc={procs[0].returncode}) {time.monotonic() - start:.1f} s after launch"
        )
    except subprocess.TimeoutExpired:
        print(f"mode={mode} stall={stall}s: rank 0 still running {time.monotonic() - start:.1f} s after launch")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], float(sys.argv[3]))
    else:
        main()
