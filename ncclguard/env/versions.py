"""The versions of the libraries a distributed job depends on, as plain strings for comparing ranks."""

from __future__ import annotations

import importlib.metadata
import platform

import torch
import torch.distributed as dist

__all__ = ["library_versions"]


def _installed(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """Python, torch, CUDA, NCCL (where CUDA is there), gloo, DeepSpeed and ncclguard.

    DeepSpeed is looked up in the installed metadata, not imported (importing it is slow and
    reads ``DEEPSPEED_TIMEOUT`` once and for all). gloo has no version of its own: it is built
    into torch, so it is reported as available or not.

    Returns:
        Name -> version, None where the library is missing.
    """
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(p) for p in raw) if isinstance(raw, tuple) else str(raw)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gloo": f"built into torch {torch.__version__}" if dist.is_gloo_available() else None,
        "deepspeed": _installed("deepspeed"),
        "ncclguard": _installed("ncclguard"),
    }
