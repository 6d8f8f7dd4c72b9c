"""Read-only, counted, bounded reads of a store for ``python -m ncclguard status``
(:mod:`ncclguard.cli.status_read` explains the bounds: 16,384 ranks in 56 requests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ncclguard.store.bounded_calls import BoundedCalls

__all__ = ["CHUNK", "FIRST_READ", "READ_BYTES", "StatusReader"]

CHUNK = 1024  # keys per check, and the most per multi_get (a request names ~40 KB of keys)
FIRST_READ = 64  # keys of the first multi_get, before any value's size is known
READ_BYTES = 4 << 20  # about this many bytes of values per multi_get (a heartbeat is ~1-3 KB)


class StatusReader:
    """Read-only, counted, bounded reads of a store for the status view.

    Args:
        store: a c10d Store client (or a double with ``check``, ``get``, ``multi_get``).
        timeout: the bound of each request.
    """

    def __init__(self, store: Any, timeout: float) -> None:  # Any: a Store or a test double
        self._calls = BoundedCalls(store, timeout, timeout)
        self.requests = 0
        self.largest_read = 0  # bytes of values the largest multi_get brought back

    def close(self) -> None:
        """Ends the helper thread."""
        self._calls.close()

    def _run(self, method: str, arg: Any) -> Any:
        self.requests += 1
        return self._calls.run(lambda: getattr(self._calls.store, method)(arg), what=method)

    def present(self, keys: Sequence[str]) -> list[int]:
        """Indices of ``keys`` that exist: a ``check`` per :data:`CHUNK` keys, halves of a chunk
        with missing keys checked again (m missing keys cost about 2 m log2(CHUNK / m) checks)."""
        out: list[int] = []

        def walk(lo: int, hi: int) -> None:
            if self._run("check", list(keys[lo:hi])):
                out.extend(range(lo, hi))
            elif hi - lo > 1:
                mid = (lo + hi) // 2
                walk(lo, mid)
                walk(mid, hi)

        for lo in range(0, len(keys), CHUNK):
            walk(lo, min(lo + CHUNK, len(keys)))
        return out

    def read(self, keys: Sequence[str]) -> dict[int, bytes]:
        """The values of ``keys`` that exist, by index: :meth:`present`, then ``multi_get`` in chunks
        of :data:`FIRST_READ` keys, then of as many as fit :data:`READ_BYTES` at the mean size read so
        far (from 1 to :data:`CHUNK`)."""
        idx = self.present(keys)
        out: dict[int, bytes] = {}
        lo, size, got = 0, FIRST_READ, 0
        while lo < len(idx):
            part, before = idx[lo : lo + size], got
            for i, blob in zip(part, self._run("multi_get", [keys[i] for i in part]), strict=True):
                out[i] = bytes(blob)
                got += len(out[i])
            self.largest_read = max(self.largest_read, got - before)
            lo += len(part)
            mean = max(1.0, got / lo)  # a key's value, on average so far (an empty value counts as 1 byte)
            size = max(1, min(CHUNK, int(READ_BYTES / mean)))
        return out
