"""Ending this process at once, from any thread: what a rank does when it must leave now (fenced
out, judged stuck, told to stop by its peers), where an exception could be caught by the user's
code or wait for a collective that never ends.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int) -> NoReturn:
    """``os._exit(code)`` once the logs and the standard streams are flushed.

    Args:
        code: the process's exit status.
    """
    for handler in logging.getLogger().handlers + logging.getLogger("ncclguard").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not keep the process alive
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
