"""Store calls with a deadline, even when the store's host is unreachable: the one mechanism.

A ``TCPStore`` client bounds ``wait`` and ``get`` by its timeout, but ``add``, ``set`` and the
reply of ``compare_set`` read the socket with a plain blocking ``recv``: with the store's host cut
off (a link down, a host frozen) the calling thread waits until TCP gives up, many minutes later
(measured with py-spy on torch 2.13: ``TCPStore::incrementValueBy`` -> ``recvBytes`` -> ``recv``;
``check`` on a server frozen by SIGSTOP blocked until the server resumed). So a call that must
return by a deadline runs on a helper thread and is waited for with the time left. The store
releases the GIL while it waits, so the helper costs the caller nothing but the hand-off.

One implementation, :class:`Helper`: a long-lived thread that runs one call at a time. A hand-off
to a waiting thread costs ~30 us of CPU against ~140 us for a new thread per call
(benchmarks/README.md, "The watchdog's cost in a training loop"). Its users:

- the settle-once rounds (:mod:`ncclguard.store.rounds`, a deadline per round) through
  :func:`bounded_store_call`, which keeps one helper per store client and calling thread;
- the watchdog (:class:`ncclguard.store.bounded_calls.BoundedCalls`), which owns one helper per client.

A call that misses its deadline is abandoned (its thread stays blocked until the socket gives
up); while it is still pending, later calls on the same store fail at once instead of piling up
one blocked thread each.

At exit the interpreter must not finalize while a helper is inside a torch call: a daemon thread
that takes the GIL back during finalization is ended by ``pthread_exit`` from the destructor of
pybind11's ``gil_scoped_release``, and the process dies with ``terminate called without an active
exception`` (status -6, pytorch/pytorch#38228). Seen once in CI: a job of two ranks that ended 0.3 s
after it started, its watchdog's first connect to the store still under way. So the calls under
way are waited for at exit (:func:`drain_at_exit`, each until :data:`EXIT_WAIT_S` after its start).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.exits import ExitWait

__all__ = [
    "EXIT_WAIT_S",
    "IDLE_EXIT_S",
    "Helper",
    "bounded_store_call",
    "drain_at_exit",
    "helper_for",
    "in_torch_call",
    "no_answer",
    "run_into",
    "still_stuck",
]

T = TypeVar("T")

IDLE_EXIT_S = 5.0  # a helper thread with no call for this long ends (a new one starts on the next call)
# How long after its start a call under way is waited for at exit. A c10d client's connect now and
# then takes 5 s (torch 2.13, loopback; store/bounded_calls.py); a call blocked on a host that is gone
# never returns, and one already older than this at exit is not waited for at all.
EXIT_WAIT_S = 10.0


_under_way = ExitWait("store call(s)", EXIT_WAIT_S, "the store's host may be gone")


def in_torch_call(fn: Callable[[], T], done: threading.Event) -> T:
    """``fn()`` on a helper thread, counted as under way until it returns: what exit waits for.

    Args:
        fn: the call into torch (a store request, a client's connect).
        done: the event that the caller sets once ``fn`` has returned (the key of the call).

    Returns:
        What ``fn()`` returned.
    """
    _under_way.enter(done)
    try:
        return fn()
    finally:
        _under_way.leave(done)


def drain_at_exit(wait_s: float | None = None) -> int:
    """Waits until no helper thread is inside a torch call, each call at most until ``wait_s`` after
    its start (default :data:`EXIT_WAIT_S`): run at exit, after the threads that make calls have
    stopped (the watchdog's exit hook calls it again then).

    Args:
        wait_s: how long after its start a call is waited for.

    Returns:
        How many calls are still under way (0: finalization is safe for them).
    """
    return _under_way.drain(wait_s)


_Job = tuple[Callable[[], Any], dict[str, Any], threading.Event]


def still_stuck(what: str) -> StoreUnreachable:
    """The error for a call refused because an earlier one on the same store has not returned.

    Args:
        what: how to name the refused call.

    Returns:
        The error, to raise.
    """
    return StoreUnreachable(f"{what}: an earlier call to the store has not returned; the store's host is unreachable")


def no_answer(what: str, waited_s: float) -> StoreUnreachable:
    """The error for a call that did not return within its deadline.

    Args:
        what: how to name the call.
        waited_s: how long it was waited for.

    Returns:
        The error, to raise.
    """
    return StoreUnreachable(
        f"{what}: the store did not answer within {waited_s:.2f} s; its host is unreachable "
        "or frozen (TCPStore's add/set/compare_set are not bounded by the store's own timeout)"
    )


def run_into(fn: Callable[[], Any], box: dict[str, Any], done: threading.Event) -> None:
    """Runs ``fn()`` and leaves its value (``box["value"]``) or error (``box["error"]``) in ``box``,
    then sets ``done``: the body of one job of a helper thread (counted as under way while it runs).

    Args:
        fn: the call.
        box: where the outcome goes.
        done: set once ``fn`` has returned or raised.
    """
    try:
        box["value"] = in_torch_call(fn, done)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
        box["error"] = exc
    finally:
        done.set()


class Helper:
    """A long-lived helper thread that runs one store call at a time, each within a deadline.

    A call that misses its deadline is abandoned: the thread stays blocked in it, and until it
    returns every later call fails at once (no pile of blocked threads). The thread ends after
    :data:`IDLE_EXIT_S` without a call, or on :meth:`close`; the next call starts a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending: threading.Event | None = None  # set when the last call submitted has returned

    def _loop(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            try:
                job = jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # the caller submits under this lock: no call is lost to the exit
                    if self._jobs is not jobs:  # abandoned (closed, or left to a blocked call)
                        return
                    if jobs.empty():
                        self._thread = None
                        return
                continue
            if job is None:
                return
            run_into(*job)

    def busy(self) -> bool:
        """True while a call that missed its deadline has not returned.

        Returns:
            Whether a call is still pending.
        """
        return self._pending is not None and not self._pending.is_set()

    def idle(self) -> bool:
        """True when no thread runs and no call is pending (the helper may be dropped).

        Returns:
            Whether the helper holds nothing.
        """
        return self._thread is None and not self.busy()

    def call(self, fn: Callable[[], T], deadline: Deadline, what: str = "store call") -> T:
        """``fn()`` on the helper thread; its value by ``deadline`` (1 ms is given at least).

        Args:
            fn: the call, e.g. ``lambda: store.add(key, 1)``.
            deadline: when to stop waiting for it.
            what: how to name the call in the error.

        Returns:
            What ``fn()`` returned.

        Raises:
            StoreUnreachable: ``fn()`` did not return in time, or an earlier call is still blocked.
                The error ``fn()`` raised, if it raised one in time.
        """
        if self.busy():
            raise still_stuck(what)
        box: dict[str, Any] = {}
        done = threading.Event()
        start = time.monotonic()
        with self._lock:
            self._pending = done
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, args=(self._jobs,), name="ncclguard-store-call", daemon=True
                )
                self._thread.start()
            self._jobs.put((fn, box, done))
        if not done.wait(max(deadline.left(), 0.001)):
            with self._lock:  # the blocked thread is left to its call; the next call gets a new one
                self._thread, self._jobs = None, queue.SimpleQueue()
            raise no_answer(what, time.monotonic() - start)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """Ends the helper thread once its current call (if any) returns."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread, self._jobs = None, queue.SimpleQueue()


_lock = threading.Lock()
# id(store) -> the helper whose call on that store missed its deadline and has not returned. By id:
# torch's stores take no weak references; the stuck call's closure holds the store, so its id is
# not reused while the entry matters, and the entry goes once the call returns.
_stuck: dict[int, Helper] = {}
_local = threading.local()  # .helpers: id(store) -> this thread's helper for that store client
_KEEP_IDLE = 16  # helpers of a thread kept though idle; past this, idle ones are dropped


# ``store`` below is an ``object``: only its id is used (a c10d Store, or a test double).
def _stuck_on(store: object) -> bool:
    with _lock:
        helper = _stuck.get(id(store))
        if helper is not None and not helper.busy():
            del _stuck[id(store)]
            return False
        return helper is not None


def helper_for(store: object) -> Helper:
    """The calling thread's helper for ``store`` (one per store client and thread: a client runs
    one request at a time, and threads that share one, as ranks run as threads in tests do, must
    not queue behind each other's waits).

    Args:
        store: the store client the calls talk to.

    Returns:
        The helper, made on first use.
    """
    helpers: dict[int, Helper] | None = getattr(_local, "helpers", None)
    if helpers is None:
        helpers = _local.helpers = {}
    helper = helpers.get(id(store))
    if helper is None:
        if len(helpers) >= _KEEP_IDLE:  # stores come and go (a rebuild makes new groups): forget idle ones
            for key in [k for k, h in helpers.items() if h.idle()]:
                del helpers[key]
        helper = helpers[id(store)] = Helper()
    return helper


def bounded_store_call(store: object, fn: Callable[[], T], deadline: Deadline, what: str = "store call") -> T:
    """Runs ``fn()`` (a call on ``store``) and returns its result by ``deadline``, on the calling
    thread's :class:`Helper` for ``store``.

    Args:
        store: the store ``fn`` talks to; the key under which a stuck call is remembered.
        fn: the call, e.g. ``lambda: store.add(key, 1)``.
        deadline: when to stop waiting for it (at least 1 ms is given).
        what: how to name the call in the error.

    Returns:
        What ``fn()`` returned.

    Raises:
        StoreUnreachable: ``fn()`` did not return in time, or an earlier call on ``store`` (from any
            thread) is still stuck. The error ``fn()`` raised, if it raised one in time.
    """
    if _stuck_on(store):
        raise still_stuck(what)
    helper = helper_for(store)
    try:
        return helper.call(fn, deadline, what)
    except StoreUnreachable:
        if helper.busy():  # missed its deadline: refuse the other threads' calls on this store too
            with _lock:
                _stuck[id(store)] = helper
        raise
