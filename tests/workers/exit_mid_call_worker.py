"""Rank side of tests/base/test_bounded.py's exit tests: a process that ends while one of ncclguard's
helper threads is inside a store call. Usage: exit_mid_call_worker.py {on,off,poller}.

A real TCPStore (server and client in this process); the helper waits on a key nobody sets (the
client's timeout, 3 s), the caller gives up after 0.2 s and the script ends. Its teardown then takes
6 s (an object whose ``__del__`` sleeps, as a big job's teardown does), so the store call returns
inside the interpreter's finalization. ``off`` turns the exit wait off (``drain_at_exit`` waits 0 s);
``on`` is the library. Its last atexit handler (registered first, so it runs last, once the library's
wait is over) prints how many store calls are still under way when finalization begins: 1 with
``off`` (the process then dies of SIGABRT, ``terminate called without an active exception``, when
the call comes back during finalization: every time on a quiet machine, not always on a loaded one),
0 with ``on``.

``poller``: no call is under way when the script ends, but a poller (a thread that starts store calls of
its own, as the left-behind fence and the verdict do, registered with ``ncclguard.exits.poller``) starts
one every 50 ms, each given up after 0.2 s and left in its 3 s wait. Exit stops the poller before it
waits for the calls under way: the poller says how it ended, and none is under way at finalization.
"""

from __future__ import annotations

import atexit
import builtins
import sys
import threading
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


def poll(client: dist.TCPStore, started: threading.Event) -> None:
    from ncclguard.exits import EXITING

    calls = 0
    while not EXITING.wait(0.05):
        try:
            bounded.Helper().call(lambda: client.wait(["never"]), Deadline.within(0.2), "wait")
        except StoreUnreachable:
            calls += 1
            started.set()
    print(f"poller stopped at exit after {calls} calls", flush=True)


def main() -> None:
    atexit.register(under_way_at_finalization)  # before the library's wait registers: runs after it
    if sys.argv[1] == "off":
        bounded._under_way.wait_s = 0.0
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))
    builtins._ncclguard_server = server  # the store lives to the end: the calls under way wait, not fail
    if sys.argv[1] == "poller":
        from ncclguard.exits import poller

        started = threading.Event()
        poller(threading.Thread(target=poll, args=(client, started), daemon=True))
        started.wait(30)  # hang guard; one call given up, the next ones started every 50 ms
        print("the poller polls", flush=True)
        return
    try:
        bounded.Helper().call(lambda: client.wait(["never"]), Deadline.within(0.2), "wait")
    except StoreUnreachable:
        print("given up, the call still under way", flush=True)
    builtins._ncclguard_slow_teardown = SlowTeardown()  # builtins go last: __del__ runs while finalizing


if __name__ == "__main__":
    main()
