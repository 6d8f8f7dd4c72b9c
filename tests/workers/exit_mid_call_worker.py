"""Rank side of tests/base/test_bounded.py's exit test: a process that ends while one of ncclguard's
helper threads is inside a store call. Usage: exit_mid_call_worker.py {on,off}.

A real TCPStore (server and client in this process); the helper waits on a key nobody sets (the
client's timeout, 3 s), the caller gives up after 0.2 s and the script ends. Its teardown then takes
6 s (an object whose ``__del__`` sleeps, as a big job's teardown does), so the store call returns
inside the interpreter's finalization. ``off`` turns the exit wait off (``drain_at_exit`` waits 0 s);
``on`` is the library. Its last atexit handler (registered first, so it runs last, once the library's
wait is over) prints how many store calls are still under way when finalization begins: 1 with
``off`` (the process then dies of SIGABRT, ``terminate called without an active exception``, when
the call comes back during finalization: every time on a quiet machine, not always on a loaded one),
0 with ``on``.
"""

from __future__ import annotations

import atexit
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


def under_way_at_finalization() -> None:
    print(f"under way at finalization: {len(bounded._under_way.under_way)}", flush=True)


def main() -> None:
    atexit.register(under_way_at_finalization)  # before the library's wait registers: runs after it
    if sys.argv[1] == "off":
        bounded._under_way.wait_s = 0.0
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    try:
        bounded.Helper().call(lambda: client.wait(["never"]), Deadline.within(0.2), "wait")
    except StoreUnreachable:
        print("given up, the call still under way", flush=True)
    builtins._ncclguard_slow_teardown = SlowTeardown()  # builtins go last: __del__ runs while finalizing


if __name__ == "__main__":
    main()
