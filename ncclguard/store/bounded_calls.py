"""Store calls for the watchdog: each bounded in time, classified as slow, refused or gone.

:class:`BoundedCalls` runs each call on its own long-lived helper thread
(:class:`~ncclguard.store.bounded.Helper`, the one bounded-call mechanism, which the rounds use
too): a c10d ``TCPStore`` client's own timeout does not bound every call, and the watchdog thread
must never wait on a dead peer. What this module adds is the watchdog's reading of failures: a
closed connection on a server that still takes connections is one refused request
(:class:`StoreRefused`), and the calls go on over a new connection; a missed deadline is slow,
until the store has failed for ``gone_after`` seconds in a row.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreRefused, StoreTimeout, StoreUnreachable
from ncclguard.store.bounded import Helper, in_torch_call

__all__ = ["BoundedCalls", "Helper", "StoreRefused"]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class BoundedCalls:
    """Store calls bounded by ``timeout`` each (:class:`Helper`: one helper thread; while a call that
    missed its deadline is still blocked, later calls fail at once), classified for the watchdog: torch's ``DistNetworkError`` (refused, reset)
    means the store is gone; a missed deadline or torch's other errors mean slow, until the store
    has failed for ``gone_after`` seconds in a row.

    Args:
        store: the store the calls talk to.
        timeout: the bound of each call.
        gone_after: seconds of failed calls after which the store counts as gone.
    """

    def __init__(self, store: Any, timeout: float, gone_after: float) -> None:
        # Any: a c10d Store, a test double or proxy with its methods (benchmarks' CountingStore),
        # or, for a connect (WatchdogStore.connect), the address the new client will talk to.
        self.store, self.timeout, self.gone_after = store, timeout, gone_after
        self._failing_since: float | None = None
        self._clone: dict[str, Any] | None = None  # a reconnect under way: "done", then "store" or "error"
        self._helper = Helper()

    def close(self) -> None:
        """Ends the helper thread (a later call starts a new one)."""
        self._helper.close()

    def _adopt(self) -> None:
        """Takes the new client a reconnect made, once it is there."""
        box = self._clone
        if box is not None and "store" in box:
            self.store, self._clone = box["store"], None
            if self._helper.busy():  # blocked on the old client: the new one gets a thread of its own
                self._helper = Helper()

    def _reconnect(self) -> bool:
        """After the server closed the connection: True when it still takes connections, False when
        it is gone (a refused connect costs no wait) or this store has no address. A new client
        (``clone()``) is made on a thread of its own and taken when ready: a c10d client's connect
        now and then takes 5 s (torch 2.13, loopback), longer than a call may wait."""
        host, port = getattr(self.store, "host", None), getattr(self.store, "port", None)
        if not isinstance(host, str) or not isinstance(port, int) or not hasattr(self.store, "clone"):
            return False
        try:
            with socket.create_connection((host, port), timeout=min(self.timeout, 1.0)):
                pass
        except OSError:
            return False
        box = self._clone
        if box is None or "error" in box:  # none under way (or the last one failed): start one
            box = self._clone = {}
            old = self.store

            def clone() -> None:
                try:
                    box["store"] = in_torch_call(old.clone, done)
                except Exception as exc:  # noqa: BLE001 - the next reconnect tries again
                    box["error"] = exc
                finally:
                    done.set()

            done = box["done"] = threading.Event()
            threading.Thread(target=clone, name="ncclguard-store-reconnect", daemon=True).start()
        box["done"].wait(self.timeout)
        self._adopt()
        return True

    def _fail(self, text: str) -> StoreTimeout | StoreUnreachable:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        silent = now - self._failing_since
        if silent >= self.gone_after:
            return StoreUnreachable(f"no answer for {silent:.1f} s: {text}")
        return StoreTimeout(text)

    def run(self, fn: Callable[..., Any], *args: Any, what: str = "") -> Any:
        """``fn(*args)``, a call on the store, within ``timeout``; its value.

        Args:
            fn: the call (a method of ``store``, or a function calling it).
            args: its arguments.
            what: the request in words (``add ncclguard/.../count``), for :class:`StoreRefused`.

        Raises:
            StoreTimeout: no answer within ``timeout`` (or an earlier call is still blocked).
            StoreRefused: the server closed the connection on this request but still takes new ones.
            StoreUnreachable: the store is gone.
        """
        from torch.distributed import DistNetworkError

        self._adopt()
        try:
            value = self._helper.call(lambda: fn(*args), Deadline.within(self.timeout), "watchdog store call")
        except DistNetworkError as exc:  # broken pipe, connection reset/refused
            if self._reconnect():  # the server lives: it refused this one request
                raise StoreRefused(
                    f"the store closed the connection on {what or 'a request'} ({_first_line(exc)}); "
                    "the server still takes connections, so it refused that request"
                ) from exc
            raise StoreUnreachable(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        except StoreUnreachable as exc:  # missed its deadline: slow, or gone once it lasts
            raise self._fail(_first_line(exc)) from exc
        except RuntimeError as exc:  # torch's own timeout: slow or gone
            raise self._fail(_first_line(exc)) from exc
        self._failing_since = None
        return value
