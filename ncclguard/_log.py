"""The library's one logger, ``logging.getLogger("ncclguard")``, with every message tagged by rank."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

import torch.distributed as dist

__all__ = ["log", "current_rank"]


def current_rank() -> int | None:
    """Returns the global rank: the process group's, else ``RANK`` from the launcher, else None."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ.get("RANK")
    return int(env) if env is not None and env.isdigit() else None


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        rank = current_rank()
        kwargs.setdefault("extra", {})["rank"] = rank
        return f"[rank {'?' if rank is None else rank}] {msg}", kwargs


log = _RankAdapter(logging.getLogger("ncclguard"), {})
