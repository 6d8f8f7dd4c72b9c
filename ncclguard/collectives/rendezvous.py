"""A round of JSON exchange over a group's store, bounded by a deadline, that every rank agrees on.

This is the one mechanism behind safe_barrier, the fingerprint check of safe_all_reduce and the
cross-rank agreements of the integrations. It never touches the communicator, so it works on a
group whose NCCL or gloo communicator is broken, and it never unpickles: payloads are JSON.

Protocol for a round named ``P`` (all keys below ``ncclguard/P``):

1. each rank sets ``r<rank>`` to its payload and increments ``n``;
2. the rank that makes ``n`` equal the group size settles the outcome ``o`` to ``ok`` with
   compare-and-set; the others wait for ``o`` until the deadline, then try to settle it to
   ``timeout <n>`` (with the arrival count then). compare-and-set makes the first settlement
   final, so every rank, late ones included, reads the same outcome, and a rank whose arrival
   number is above that count knows it came late;
3. each rank increments ``gone`` when it leaves; the last one deletes the round's keys, so a
   loop of rounds leaves the store small.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

from ncclguard.collectives.groups import GroupInfo

__all__ = ["RoundResult", "exchange", "next_round", "known_hosts", "StoreUnreachable"]

HOST = socket.gethostname()


class StoreUnreachable(RuntimeError):
    """The group's store did not answer (its server, usually on rank 0, is gone)."""


@dataclass
class RoundResult:
    """What one round told this rank.

    Attributes:
        ok: every rank of the group arrived before the deadline.
        outcome: ``"ok"`` or ``"timeout"``.
        payloads: payloads by group rank, for every rank that arrived.
        missing: group ranks whose payload this rank did not find after the outcome was settled
            (sorted; empty when ``ok``).
        late: the round had already been given up when this rank arrived.
        elapsed_s: seconds this rank spent in the round.
    """

    ok: bool
    outcome: str
    payloads: dict[int, Any] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    late: bool = False
    elapsed_s: float = 0.0


_seq_lock = threading.Lock()
_seqs: dict[tuple[str, str], itertools.count] = defaultdict(itertools.count)
_hosts: dict[str, dict[int, str]] = defaultdict(dict)


def next_round(info: GroupInfo, kind: str) -> str:
    """Returns the name of this rank's next round of ``kind`` on the group.

    Every rank counts its own calls, so the n-th call of each rank meets the n-th of the others.
    """
    with _seq_lock:
        return f"{kind}/{info.name}/{next(_seqs[(info.name, kind)])}"


def known_hosts(info: GroupInfo) -> dict[int, str]:
    """Hostnames by group rank learned from earlier rounds on this group."""
    return dict(_hosts[info.name])


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    try:
        # A zero timedelta would mean "the store's default"; a millisecond is "now".
        store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except DistStoreError:
        return False


def exchange(info: GroupInfo, name: str, payload: Any, deadline: float) -> RoundResult:
    """Runs one round: publishes ``payload`` and collects the others' until ``deadline``.

    Args:
        info: the group (its store carries the round).
        name: the round's name, the same on every rank (see :func:`next_round`).
        payload: JSON-serialisable data for the other ranks.
        deadline: ``time.monotonic()`` value after which the round is given up.

    Returns:
        The round's outcome, the same on every rank that took part.

    Raises:
        StoreUnreachable: the store did not answer.
    """
    start = time.monotonic()
    store, size, me = info.store, info.size, info.rank
    p = f"ncclguard/{name}"
    outcome_key = f"{p}/o"
    try:
        store.set(f"{p}/r{me}", json.dumps({"host": HOST, "payload": payload}))
        arrived = store.add(f"{p}/n", 1)
        if arrived >= size:
            settled = store.compare_set(outcome_key, "", "ok").decode()
        elif _wait(store, outcome_key, deadline - time.monotonic()):
            settled = store.get(outcome_key).decode()
        else:
            # The verdict records how many ranks had arrived, so a rank can tell whether it came
            # before the verdict (on time, only slower to notice) or after it (late).
            settled = store.compare_set(outcome_key, "", f"timeout {store.add(f'{p}/n', 0)}").decode()
        outcome, _, arrived_by = settled.partition(" ")
        late = outcome != "ok" and arrived > int(arrived_by or size)
        keys = [f"{p}/r{r}" for r in range(size)]
        if outcome == "ok":
            present = keys
        else:
            present = [k for k in keys if store.check([k])]
        raw = store.multi_get(present) if present else []
        if store.add(f"{p}/gone", 1) >= size:
            for key in keys + [f"{p}/n", outcome_key, f"{p}/gone"]:
                store.delete_key(key)
    except DistStoreError as exc:
        raise StoreUnreachable(f"the group's store did not answer during round {name!r}: {exc}") from exc
    except RuntimeError as exc:  # connection refused / reset surface as plain RuntimeError
        raise StoreUnreachable(f"the group's store did not answer during round {name!r}: {exc}") from exc

    payloads: dict[int, Any] = {}
    for key, blob in zip(present, raw):
        rank = int(key.rsplit("/r", 1)[1])
        doc = json.loads(blob)
        payloads[rank] = doc["payload"]
        _hosts[info.name][rank] = doc["host"]
    missing = [] if outcome == "ok" else sorted(set(range(size)) - set(payloads))
    return RoundResult(
        ok=outcome == "ok",
        outcome=outcome,
        payloads=payloads,
        missing=missing,
        late=late,
        elapsed_s=time.monotonic() - start,
    )
