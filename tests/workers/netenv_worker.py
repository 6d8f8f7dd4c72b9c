"""Rank side of tests/env/test_netenv.py and tests/env/test_netns.py. Usage: netenv_worker.py SCENARIO.

inherit: ncclguard.init_process_group on loopback (torchrun, 2 ranks); the plan applied without
    trampling the user's variables, subgroups inheriting the world timeout, the hierarchy read
    from the live groups, and the import-time variables checked after import.
netns: one rank per network namespace (launched by the test with `ip netns exec`); the plan
    picks the veth on each side and gloo all-reduces across it.
detect ADDR...: not a rank; prints the plans for the addresses as JSON (run inside a namespace).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import rankkit
import torch
import torch.distributed as dist
from rankkit import put


def _timeouts() -> dict[str, float | None]:
    from ncclguard.env.hierarchy import group_timeout_s

    return {
        "default": dist.distributed_c10d._get_default_timeout(dist.Backend("gloo")).total_seconds(),
        "new_group": group_timeout_s(dist.new_group([0, 1])),
        # An explicit timeout, told apart from the inherited 20 s and torch's 1,800 s.
        "new_group_explicit": group_timeout_s(dist.new_group([0, 1], timeout=timedelta(seconds=90))),
    }


def _leave_together() -> None:
    """Ends the rank once every rank got here, so that no rank leaves while a peer still connects.

    torch 2.13's ``new_group`` has no barrier after it (only with TORCH_DIST_INIT_BARRIER=1), and
    gloo's connect ends on one side of a pair before the other: a rank that made its last group and
    left at once closed the pair under its peer, whose ``new_group`` then failed with "Connection
    closed by peer" (8 launches in 25 under 3 busy loops, 0 in 25 with this barrier).
    """
    dist.barrier()
    rankkit.done()


def inherit() -> None:
    import ncclguard
    from ncclguard.env.envvars import env_warnings
    from ncclguard.env.hierarchy import TimeoutHierarchy
    from ncclguard.env.pginit import restore_default_timeout

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    init = ncclguard.init_process_group("gloo", timeout=20)
    put("init", init.model_dump(mode="json"))
    put(
        "env_after",
        {
            k: os.environ.get(k)
            for k in (
                "GLOO_SOCKET_IFNAME",
                "NCCL_SOCKET_IFNAME",
                "NCCL_IB_DISABLE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCH_FR_BUFFER_SIZE",
            )
        },
    )
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    put("sum", t.item())
    put("inherited", _timeouts())
    hierarchy = TimeoutHierarchy.in_force(validate=False)
    put("hierarchy_pg", hierarchy.group_timeout_s)
    put("hierarchy_pg_source", hierarchy.sources["group_timeout_s"])
    put("hierarchy_subgroups", sorted(hierarchy.subgroup_timeouts_s.values()))
    put("hierarchy_notes", hierarchy.notes())
    put("hierarchy_deepspeed", hierarchy.deepspeed_timeout_s)
    restore_default_timeout()
    put("restored", _timeouts())

    # Import-time variables: the launch set TORCH_DISTRIBUTED_DEBUG=INFO and DEEPSPEED_TIMEOUT=20
    # before Python started; changing them now does nothing, and the warnings say so.
    import deepspeed.constants

    put("debug_level", dist.get_debug_level().name)
    put("deepspeed_minutes", deepspeed.constants.default_pg_timeout.total_seconds() / 60)
    put("warnings_before", [w for w in env_warnings() if "TORCH_DISTRIBUTED_DEBUG" in w or "DEEPSPEED_TIMEOUT" in w])
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    os.environ["DEEPSPEED_TIMEOUT"] = "30"
    put("warnings_after", [w for w in env_warnings() if "TORCH_DISTRIBUTED_DEBUG" in w or "DEEPSPEED_TIMEOUT" in w])
    put("debug_level_after", dist.get_debug_level().name)
    _leave_together()


def netns() -> None:
    import ncclguard

    init = ncclguard.init_process_group("gloo", timeout=20)
    put("init", init.model_dump(mode="json"))
    put("gloo_ifname", os.environ.get("GLOO_SOCKET_IFNAME"))
    t = torch.tensor([float(dist.get_rank() + 1)] * 4)
    dist.all_reduce(t)
    put("sum", t.tolist())
    put("subgroup_timeout", _timeouts()["new_group"])
    _leave_together()


def detect_many() -> None:
    """Not a rank: prints the plans for the addresses given (``-`` = no address: the default route)."""
    import json

    from ncclguard.env.netenv import detect

    plans = {a: detect(None if a == "-" else a, environ={}).model_dump(mode="json") for a in sys.argv[2:]}
    print(json.dumps(plans))


if __name__ == "__main__":
    {"inherit": inherit, "netns": netns, "detect": detect_many}[sys.argv[1]]()
