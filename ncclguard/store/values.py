"""Single values in the job's store, each exchange bounded by a deadline: read one JSON value into
its model, wait until one says what the caller waits for, delete keys.

Every exchange outside a settle-once round (:mod:`ncclguard.store.rounds`) goes through these, on
the calling thread's bounded helper (:func:`~ncclguard.store.bounded.bounded_store_call`): a store
whose host is cut off never answers ``set``, ``add`` or ``check``, and a caller must still get its
answer, or an error, by its deadline. What is read is parsed by the one codec
(:func:`~ncclguard.store.codec.decode`: size bound first, then JSON into a pydantic model); nothing is
unpickled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch.distributed as dist
from pydantic import BaseModel

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.codec import decode, encode
from ncclguard.store.rounds import GRACE_S

__all__ = ["count_up", "delete_keys", "delete_prefix", "poll_value", "read_value", "write_value"]

M = TypeVar("M", bound=BaseModel)

FIRST_SLEEP_S = 0.01  # the first pause of a poll; then a quarter of the time waited so far
MAX_SLEEP_S = 0.25  # the longest pause: a value that appears is seen at most this late


def read_value(store: dist.Store, key: str, model: type[M], limit: int, deadline: Deadline, what: str) -> M | None:
    """The value under ``key`` parsed into ``model``, or None when the key is not there.

    Args:
        store: the store.
        key: the key.
        model: the pydantic model of the value.
        limit: the value's size bound, in bytes (checked before parsing).
        deadline: when to stop waiting for the store.
        what: the value in words, for errors (``"the world record"``).

    Returns:
        The parsed value, or None.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        DecodeError: the value is over ``limit``, not JSON, or not a ``model``.
        RuntimeError, DistStoreError: the store failed (connection refused or reset).
    """
    raw = bounded_store_call(store, lambda: bytes(store.get(key)) if store.check([key]) else None, deadline, what)
    return None if raw is None else decode(model, raw, f"{what} under {key!r}", limit)


def write_value(store: dist.Store, key: str, value: BaseModel, deadline: Deadline, what: str) -> None:
    """Writes ``value`` (JSON) under ``key``.

    Args:
        store: the store.
        key: the key.
        value: the value.
        deadline: when to stop waiting for the store.
        what: the value in words, for errors.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    text = encode(value)
    bounded_store_call(store, lambda: store.set(key, text), deadline, what)


def poll_value(
    store: dist.Store,
    key: str,
    model: type[M],
    limit: int,
    deadline: Deadline,
    what: str,
    accept: Callable[[M], bool] | None = None,
) -> M | None:
    """Reads ``key`` until its value is there (and ``accept`` takes it), or ``deadline`` passes.

    A poll, not a store ``wait``: the key may exist already with an older value (a record rewritten
    at each rebuild), and a timed-out ``wait`` logs warnings in torch's store client. The pauses
    grow with the time waited (a quarter of it, :data:`FIRST_SLEEP_S` to :data:`MAX_SLEEP_S`).

    Args:
        store: the store.
        key: the key.
        model: the value's pydantic model.
        limit: its size bound, in bytes.
        deadline: when to give up.
        what: the value in words, for errors.
        accept: whether a value read is the one waited for; default any value.

    Returns:
        The value accepted, or None at the deadline.

    Raises:
        StoreUnreachable: a read begun before ``deadline`` got no answer by ``deadline`` plus
            :data:`~ncclguard.store.rounds.GRACE_S`.
        DecodeError: a value that cannot be parsed.
        RuntimeError, DistStoreError: the store failed.
    """
    start = time.monotonic()
    # Each read may answer up to GRACE_S past the deadline, as a round's last reads may: the last
    # read of a poll begins a few milliseconds before the deadline, and a store slow for that moment
    # means "not there by the deadline" (None), not a store that is gone.
    late = deadline.plus(GRACE_S)
    while True:
        value = read_value(store, key, model, limit, late, what)
        if value is not None and (accept is None or accept(value)):
            return value
        waited = time.monotonic() - start
        if not deadline.sleep(min(max(waited / 4, FIRST_SLEEP_S), MAX_SLEEP_S)):
            return None


def count_up(store: dist.Store, key: str, deadline: Deadline, what: str) -> int:
    """Adds 1 to the counter under ``key`` (0 when missing) and returns the new count.

    Args:
        store: the store.
        key: the counter's key.
        deadline: when to stop waiting for the store.
        what: the count in words, for errors.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    return int(bounded_store_call(store, lambda: store.add(key, 1), deadline, what))


def delete_keys(store: dist.Store, keys: Sequence[str], deadline: Deadline, what: str) -> None:
    """Deletes ``keys`` (a missing one is no error).

    Args:
        store: the store.
        keys: the keys.
        deadline: when to stop waiting for the store.
        what: the deletion in words, for errors.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    wanted = list(keys)

    def delete() -> None:
        for key in wanted:
            store.delete_key(key)

    bounded_store_call(store, delete, deadline, what)


def delete_prefix(store: dist.Store, prefix: str, deadline: Deadline, what: str) -> int:
    """Deletes every key that starts with ``prefix``.

    Args:
        store: the store (it must list its keys: ``TCPStore`` and ``HashStore`` do).
        prefix: the keys' common start.
        deadline: when to stop waiting for the store.
        what: the deletion in words, for errors.

    Returns:
        How many keys were deleted.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, AttributeError: the store failed, or cannot list its keys.
    """

    def delete() -> int:
        keys = [k for k in store.list_keys() if k.startswith(prefix)]
        for key in keys:
            store.delete_key(key)
        return len(keys)

    return bounded_store_call(store, delete, deadline, what)
