"""Rank side of tests/base/test_bounded.py's exit test: a process that ends while one of ncclguard's
helper threads is inside a store call. Usage: exit_mid_call_worker.py {on,off}.

A real TCPStore (server and client in this process); the helper waits on a key nobody sets (the
client's timeout, 3 s), the caller gives up after 0.2 s and the script ends. Its teardown then takes
6 s (an object whose ``__del__`` sleeps, as a big job's teardown does), so the store call returns
inside the interpreter's finalization. ``off`` turns the exit wait off (``drain_at_exit`` waits 0 s):
the process dies of SIGABRT, ``terminate called without an active exception``; ``on`` is the library.
"""

from __future__ import annotations

import builtins
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import ncclguard.store.bounded as bounded
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable


class SlowTeardown:
    """Finalization that takes 6 s: the store call under way returns inside it."""

    def __init__(self) -> None:
        self.sleep = time.sleep  # modules are gone by the time __del__ runs

    def __del__(self) -> None:
        self.sleep(6)


def main() -> None:
    if sys.argv[1] == "off":
        bounded.drain_at_exit.__defaults__ = (0.0,)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    try:
        bounded.Helper().call(lambda: client.wait(["never"]), Deadline.within(0.2), "wait")
    except StoreUnreachable:
        print("given up, the call still under way", flush=True)
    builtins._ncclguard_slow_teardown = SlowTeardown()  # builtins go last: __del__ runs while finalizing


if __name__ == "__main__":
    main()
