"""An incident through the node tier (docs/scale.md): one carrier a node takes its ranks' statements
to the job's store, and one rank a node a window reads the incident counter for the others.

Flat, every rank sets its statement in the job's store, counts itself dumped there and asks to merge:
three requests a rank, 49,000 at 16,384 ranks for one incident. Through the node tier, a rank files
its statement in its node's store (:func:`~ncclguard.store.node_store.file_in_node`: its keys, its
name on the node's list, the node's count). The rank whose count completes its node carries: it
claims the carrying (:func:`~ncclguard.store.node_store.claim_carry`), reads the statements of the
ranks on the list, and sets them in the job's store under the same keys, all in one request, then
counts them dumped and asks to merge. The merge reads the job's store as before
(:mod:`~ncclguard.watching.desk.merging`).

A node whose count does not complete (a rank frozen or dead: often the culprit) is carried by the
first of its ranks whose wait (``carry_wait_s``) is over, with the statements filed by then. A rank
left off the carried list (it filed after the claim), or whose node's store fails, files its own
statement in the job's store, as flat; a rank whose claim was lost waits at most ``carry_wait_s``
more for the carrier's list. A statement is counted dumped once: by its carrier, or by its rank.
(One case counts it twice: a call to the node's store that timed out after it was done, the rank
then filing by itself too. The merge may then start with one statement missing, and reads that
rank's heartbeat instead, as for any rank that said nothing.)

The incident counter (:class:`RelayedCount`): every rank reads it every half beat, and at every tick
while an incident is open: 2 requests a rank a beat, most of the tier's traffic at 16,384 ranks, and
32,768 a second while an incident is open. Through the node's store, in each window (half a beat,
at most 1 s) the first rank of the node to read it reads the job's store and sets a copy, stamped
with the time, in its node's store, with the descriptions of the incidents numbered since; the
node's other ranks read the copy, and each new incident's description there. A copy older than
:data:`STALE_WINDOWS` windows is not taken: the rank reads the job's store itself, so that a job's
store that is gone is still found so by every rank (its calls there fail), as without the tier.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ncclguard._log import log
from ncclguard.incidents.model import Statement
from ncclguard.store import node_store
from ncclguard.store.rounds import read_present
from ncclguard.watching.base.watchdog_store import BRIEF_FROM, WatchdogStore

if TYPE_CHECKING:
    from ncclguard.watching.base.near_store import TieredWatchdogStore

__all__ = ["Filing", "NodeFiling", "RelayedCount", "carry_to_job", "keys_of", "parse_filed"]

MAX_LIST_BYTES = 64 * 12  # a node's list: at most 64 ranks (node_layout.MAX_LOCAL), "r," each
# A statement is at most 1 MB as stored (watchdog_store.LIMITS): the carrier reads READ_KEYS keys a
# request, and sets at most CARRY_BYTES a request (torch's TCPStore took 8 MiB in one value here,
# and reset the connection at 15 MiB: docs/scale.md). A node of 8 ordinary statements is one request.
READ_KEYS = 4
CARRY_BYTES = 4 << 20


def parse_filed(raw: bytes, world_size: int) -> tuple[list[int], bool]:
    """The ranks on a node's list (``"r,"`` each), without repeats, in order; and whether anything
    else was there (a value no rank wrote: the caller says so). An entry cut at the end is dropped."""
    *whole, _ = raw.decode(errors="replace").split(",")
    ranks = [int(x) for x in whole if x.isdecimal() and len(x) <= 9 and int(x) < world_size]
    return list(dict.fromkeys(ranks)), len(ranks) != len(whole) or not raw.endswith(b",") and raw != b""


def keys_of(store: TieredWatchdogStore, n: int, rank: int, world_size: int) -> tuple[str, ...]:
    """``rank``'s statement key on incident ``n``, and its head's above :data:`BRIEF_FROM` ranks."""
    st = store.keys.statement(n, rank)
    return (st, store.keys.head(n, rank)) if world_size > BRIEF_FROM else (st,)


STALE_WINDOWS = 3  # a copy of the counter older than this many windows: the job's store is read
COPY_MAX = 64  # bytes of the node's copy of the counter: "<count> <time.time()>"
COPY_DOCS = 16  # incidents' descriptions copied into a node's store at most at a time
DOC_MAX = 64 * 1024 + 1  # bytes of a description copied: one over its bound (LIMITS) is refused by its readers


class RelayedCount:
    """The incident counter through the node's store (see the module doc).

    Args:
        store: the rank's store with the node tier on.
        window_s: the windows' length.
    """

    def __init__(self, store: TieredWatchdogStore, window_s: float) -> None:
        self.store, self.window_s = store, window_s
        self.relayed = 0  # reads of the job's store this rank made for its node (tests, logs)

    def read(self) -> int:
        """The count: the node's copy when fresh, else the job's store's (then copied for the node).

        Raises:
            StoreTimeout, StoreUnreachable, StoreRefused: reading the job's store, as flat.
        """
        store, key = self.store, self.store.keys.count
        slot = int(time.time() // self.window_s)

        def look(client: Any) -> bytes | None:  # None: this rank's window; else the copy (b"": none)
            if node_store.claim_window(client, f"{key}/relay", slot):
                return None
            return node_store.get_present(client, f"{key}/copy") or b""

        done, copy = store.on_near(look, f"read {key} in the node's store")
        if done and copy:
            count = self._fresh(copy)
            if count is not None:
                return count
        count = store.job_incident_count()
        if done:  # the node's store answers: its ranks read this copy, and the descriptions there
            self._copy_docs(count)
            text = f"{count} {time.time():.3f}"
            store.on_near(lambda client: node_store.put(client, f"{key}/copy", text), f"set {key}/copy")
            self.relayed += 1
        return count

    def _copy_docs(self, count: int) -> None:
        """Copies the descriptions of the incidents numbered since the node's last copy (at most
        :data:`COPY_DOCS` a read) into its store, as they are (each reader parses its copy under its
        bound); one numbered but not described yet, and those after it, are left for the next copy
        (meanwhile its ranks read them in the job's store)."""
        store, mark = self.store, f"{self.store.keys.count}/docs"
        done, raw = store.on_near(lambda client: node_store.get_present(client, mark), f"check {mark}")
        have = int(raw) if done and raw is not None and raw.isdigit() and len(raw) <= 9 else 0
        wanted = list(range(have + 1, min(count, have + COPY_DOCS) + 1))
        if not done or not wanted:
            return
        found = store.read_raw([store.keys.incident(n) for n in wanted])
        keys, values, upto = [], [], have
        for n in wanted:
            doc = found.get(store.keys.incident(n))
            if doc is None:
                break
            keys.append(store.keys.incident(n))
            values.append(doc[:DOC_MAX].decode(errors="replace"))
            upto = n
        if keys:
            store.on_near(lambda client: node_store.put_all(client, [*keys, mark], [*values, str(upto)]), f"set {mark}")

    def _fresh(self, raw: bytes) -> int | None:
        """The count in the node's copy ``raw``, or None: stale (:data:`STALE_WINDOWS`), or not what
        a rank writes (said once)."""
        key = f"{self.store.keys.count}/copy"
        parts = raw[: COPY_MAX + 1].decode(errors="replace").split()
        try:
            count, at = int(parts[0]), float(parts[1])
            if len(raw) > COPY_MAX or len(parts) != 2 or count < 0 or not math.isfinite(at):
                raise ValueError(raw[:40])
        except (ValueError, IndexError):
            self.store.warn_once(key, f"{key} holds {raw[:40]!r}, not '<count> <time>' as a rank copies it")
            return None
        return count if time.time() - at <= STALE_WINDOWS * self.window_s else None


@dataclass
class Filing:
    """A statement filed in the node's store, not yet known to be carried."""

    items: list[tuple[str, str]]
    rank: int
    world_size: int
    carry_at: float  # monotonic: when this rank carries its node itself, if nobody has
    give_up_at: float  # monotonic: when it files by itself, its node's list unseen
    tried: bool = False  # it asked to carry, and another rank had


class NodeFiling:
    """The node tier's side of :meth:`WatchdogStore.file_statement` and ``file_later``.

    Args:
        store: the rank's store with the node tier on.
        carry_wait_s: how long a node's ranks wait for its count to complete before the first of
            them carries what was filed.
    """

    def __init__(self, store: TieredWatchdogStore, carry_wait_s: float) -> None:
        self.store, self.carry_wait_s = store, carry_wait_s
        self.pending: dict[int, Filing] = {}  # by incident, in this world's namespace
        self.carried = 0  # statements this rank took to the job's store for its node (tests, logs)

    def _keys(self, n: int) -> tuple[str, str, str, str]:
        """The node's count, list, claim and carried list of incident ``n``."""
        count = self.store.keys.dumped(n)
        return count, f"{count}/filed", f"{count}/carry", f"{count}/carried"

    def file(self, n: int, statement: Statement) -> bool | None:
        """Files ``statement`` in the node's store; carries the node when its count completes.

        Returns:
            Whether this rank merges; None while the statement waits to be carried.
        """
        store, items = self.store, self.store.statement_items(n, statement)
        filing = Filing(items, statement.rank, statement.world_size, time.monotonic() + self.carry_wait_s, 0.0)
        count, filed, _, _ = self._keys(n)
        done, got = store.on_near(
            lambda c: node_store.file_in_node(c, items, filed, count, statement.rank), f"file statement {n}"
        )
        if not done or got is None:
            return self._direct(n, filing)
        self.pending[n] = filing
        if got >= store.layout.local_size:
            return self._carry(n, filing)
        return None

    def later(self, n: int) -> bool | None:
        """Goes on with incident ``n``'s filing (each tick): None while it waits, else whether this
        rank merges."""
        filing = self.pending.get(n)
        if filing is None:
            return False
        _, _, _, carried = self._keys(n)
        done, raw = self.store.on_near(lambda c: node_store.get_present(c, carried), f"check {carried}")
        if not done:
            return self._direct(n, filing)
        now = time.monotonic()
        if raw is not None:
            ranks, _ = parse_filed(raw, filing.world_size)
            if filing.rank in ranks:
                self.pending.pop(n, None)
                return False
            return self._direct(n, filing)
        if not filing.tried and now >= filing.carry_at:
            return self._carry(n, filing)
        if filing.tried and now >= filing.give_up_at:
            log.info("watchdog: incident %d: the node's carrier named no list in time; this rank files by itself", n)
            return self._direct(n, filing)
        return None

    def _carry(self, n: int, filing: Filing) -> bool | None:
        """Claims the carrying of the node's statements on incident ``n``; the claimer takes them to
        the job's store. None for a rank that lost the claim (it looks for the list next)."""
        store = self.store
        _, filed, claim, carried = self._keys(n)
        done, raw = store.on_near(
            lambda c: node_store.claim_carry(c, claim, filed, carried, MAX_LIST_BYTES), f"claim {claim}"
        )
        if not done:
            return self._direct(n, filing)
        if raw is None:
            filing.tried, filing.give_up_at = True, time.monotonic() + self.carry_wait_s
            return None
        ranks, odd = parse_filed(raw, filing.world_size)
        if odd:
            store.warn_once(filed, f"{filed} holds {raw[:60]!r}, more than the ranks' names; only those are carried")
        keys = [k for r in ranks for k in keys_of(store, n, r, filing.world_size)]
        found: dict[str, bytes] = {}
        for lo in range(0, len(keys), READ_KEYS):
            part = keys[lo : lo + READ_KEYS]

            def read(client: Any, part: list[str] = part) -> dict[str, bytes]:
                return read_present(client, part)

            done, got = store.on_near(read, f"read {len(part)} statement keys")
            if not done or got is None:
                return self._direct(n, filing)
            found.update(got)
        # Counted dumped: the ranks whose statement is there (each set its own before its name).
        ranks = [r for r in ranks if store.keys.statement(n, r) in found and r != filing.rank]
        items: list[tuple[str, str | bytes]] = [
            (k, found[k]) for r in ranks for k in keys_of(store, n, r, filing.world_size) if k in found
        ]
        items += filing.items  # its own, as it made it
        self.pending.pop(n, None)
        merges = carry_to_job(store, n, items, len(ranks) + 1, filing.rank, filing.world_size)
        self.carried += len(ranks) + 1
        log.info("watchdog: incident %d: carried %d statements of node %d", n, len(ranks) + 1, store.layout.node)
        return merges

    def _direct(self, n: int, filing: Filing) -> bool:
        """Files this rank's statement in the job's store by itself, as flat."""
        self.pending.pop(n, None)
        return carry_to_job(self.store, n, filing.items, 1, filing.rank, filing.world_size)


def carry_to_job(
    store: WatchdogStore, n: int, items: Sequence[tuple[str, str | bytes]], k: int, rank: int, world_size: int
) -> bool:
    """Sets ``k`` ranks' statements on incident ``n`` (``items``) in the job's store in one request,
    counts them dumped, and asks to merge for ``rank``; whether it merges.

    Raises:
        StoreTimeout, StoreUnreachable: the store did not answer.
    """
    batch: list[tuple[str, str | bytes]] = []
    size = 0
    for key, value in items:
        if batch and size + len(value) > CARRY_BYTES:
            store.put_items(batch)
            batch, size = [], 0
        batch.append((key, value))
        size += len(value)
    if batch:
        store.put_items(batch)
    store.add_dumped(n, k)
    return store.claim_merger(n, rank, world_size)
