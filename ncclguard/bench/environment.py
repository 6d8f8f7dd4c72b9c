"""What the numbers were measured on: versions, devices, hosts, world size, and the guard's settings.

Every rank describes itself; the descriptions travel as JSON over the group's store
(:func:`ncclguard.collectives.rendezvous.exchange`), never pickled.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ncclguard._naming import HOSTNAME
from ncclguard.collectives.groups import group_info
from ncclguard.collectives.numbering import next_round
from ncclguard.collectives.rendezvous import exchange
from ncclguard.config import get_config
from ncclguard.deadlines import Deadline

__all__ = ["describe_rank", "describe_job"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def describe_rank(device: torch.device) -> dict[str, Any]:
    """This rank's host and device."""
    me: dict[str, Any] = {
        "host": HOSTNAME,
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": psutil.virtual_memory().total,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        me.update(device_name=props.name, device_memory_bytes=props.total_memory)
    else:
        me.update(device_name=me["cpu"])
    return me


def describe_job(device: torch.device, backend: str) -> dict[str, Any]:
    """The environment of the whole job, the same dict on every rank.

    Raises:
        RuntimeError: a rank did not describe itself within 60 s.
    """
    info = group_info()
    ranks: dict[int, Any] = {0: describe_rank(device)}
    if info is not None and info.size > 1:
        rnd = exchange(info, next_round(info, "bench-env"), describe_rank(device), Deadline.within(60))
        if not rnd.ok:
            raise RuntimeError(f"ranks {rnd.missing} did not describe themselves within 60 s")
        ranks = dict(sorted(rnd.payloads.items()))
    git = getattr(torch.version, "git_version", None) or "unknown"
    return {
        "torch": torch.__version__,
        "torch_git": git,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        # gloo is vendored into torch (third_party/gloo) and has no runtime version call.
        "gloo": f"bundled with torch {torch.__version__} (git {git[:12]})" if dist.is_gloo_available() else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": backend,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "hosts": sorted({r["host"] for r in ranks.values()}),
        "ranks": [{"rank": int(r), **d} for r, d in ranks.items()],
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_", "NCCLGUARD_"))
            or k in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")
        },
        "ncclguard_config": {
            k: v
            for k, v in get_config().model_dump().items()
            if k.startswith(("chunk_", "mid_", "large_", "max_inflight"))
        },
    }
