"""What a rank of a multi-rank test uses: set-up, a fault vocabulary, and saving results.

Faults read like what they do to the job:
    stall(2, 10)            # rank 2 sleeps 10 s here
    kill(1)                 # rank 1 dies with SIGKILL here
    leave(2)                # rank 2 exits cleanly here (a rank gone before the collective)
    if not skip_collective(3): dist.all_reduce(t)   # rank 3 skips this collective
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

_results: dict[str, Any] = {}


def init(timeout_s: float = 60.0) -> int:
    """Joins the gloo process group of the launch; returns this rank."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def stall(who: int, seconds: float) -> None:
    """Rank ``who`` sleeps ``seconds`` here; the others go on."""
    if rank() == who:
        time.sleep(seconds)


def kill(who: int) -> None:
    """Rank ``who`` dies here with SIGKILL: no cleanup, no goodbye to its peers."""
    if rank() == who:
        save()
        os.kill(os.getpid(), signal.SIGKILL)


def leave(who: int) -> None:
    """Rank ``who`` exits cleanly (status 0) here, as a rank that never reaches the collective."""
    if rank() == who:
        save()
        os._exit(0)


def skip_collective(who: int) -> bool:
    """True on rank ``who``: the caller skips the collective there (a desync)."""
    return rank() == who


def put(key: str, value: Any) -> None:
    """Records ``value`` (JSON-able) under ``key`` for the test to assert on."""
    _results[key] = value


def save() -> None:
    """Writes this rank's results to ``$NCCLGUARD_TEST_OUT/rank<r>.json``."""
    out = Path(os.environ["NCCLGUARD_TEST_OUT"])
    tmp = out / f".rank{rank()}.json"
    tmp.write_text(json.dumps(_results, default=str))
    tmp.replace(out / f"rank{rank()}.json")


def done() -> None:
    """Saves the results and ends the rank at once.

    ``os._exit`` because a group that timed out still holds the abandoned op in gloo's queue,
    and normal interpreter shutdown would wait on it (or abort) in the group's destructor.
    """
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
