"""The library's one logger, ``logging.getLogger("ncclguard")``, with every message tagged by rank."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import torch.distributed as dist

__all__ = ["LEVEL_VAR", "current_rank", "log", "show_on_stderr"]

LEVEL_VAR = "NCCLGUARD_LOG_LEVEL"  # the level of ncclguard's lines on stderr under ncclguard run


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


class _UntilConfigured(logging.StreamHandler):
    """Prints on stderr while the script has configured no logging of its own (the root logger has
    no handler); once it has, its handlers print ncclguard's lines and this one stays silent, so
    that no line is printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_on_stderr() -> None:
    """Makes ncclguard's own lines reach the user under ``ncclguard run`` / ``NCCLGUARD_AUTO``:
    at ``NCCLGUARD_LOG_LEVEL`` (default INFO) and above, on stderr, where the script configured no
    logging (Python alone shows WARNING and above, without a time). Idempotent; a logger the
    script gave a handler or a level is left as it is.
    """
    logger = logging.getLogger("ncclguard")
    if any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        return
    raw = os.environ.get(LEVEL_VAR, "INFO").strip().upper()
    level = logging.getLevelName(raw)
    handler = _UntilConfigured(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ncclguard %(levelname)s %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(level if isinstance(level, int) else logging.INFO)
    if not isinstance(level, int):
        log.warning("%s=%r is no logging level (DEBUG, INFO, WARNING, ERROR); INFO is used", LEVEL_VAR, raw)
