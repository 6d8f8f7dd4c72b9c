"""Which call each rank is in: the kind and call site of every safe_* call, checked in its round.

Every safe_* call on a group takes the next number of one per-group count
(:func:`~ncclguard.collectives.numbering.next_call`), so the n-th call of each rank meets the
n-th call of the others, whatever its kind. The round's fingerprint carries the kind
(``barrier``, ``all_reduce``) and the call site (``file:line`` of the first frame outside
ncclguard), so that:

- different kinds in one round fail on every rank, naming each rank's call and site (a rank made
  a call the others did not, or skipped one);
- one kind from different sites is logged with both sites, once per group and pair of sites, and
  goes on: legitimate code calls one barrier from two lines (``if rank == 0: ... else: ...``);
- after a failed round every rank moves on to the next number, and a rank that arrives after the
  others gave up fails at once and moves on too, so a later call made at the same point works;
- ``tag=`` meets by name, and a tagged round that every rank passed restarts the count there.

An all_reduce that does not verify makes no store round (its hot path); it meets a barrier of the
same number only after a failure, in the post-mortem, which names each rank's call.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ncclguard._log import log
from ncclguard.collectives.groups import GroupInfo
from ncclguard.collectives.numbering import call_count, call_round, next_call, realign_on_tag, take_number
from ncclguard.collectives.rendezvous import exchange, known_hosts
from ncclguard.config import get_config
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable

__all__ = [
    "NONFINITE_FIELD",
    "Call",
    "CallPrint",
    "FingerprintRound",
    "begin_call",
    "call_site",
    "compare_prints",
    "meet_prints",
    "postmortem",
]

# A fingerprint's field for a rank's own input's values ("NaN", "Inf", or None): said, not compared.
NONFINITE_FIELD = "nonfinite"
# What a tag may look like: it becomes part of a store key and of messages.
_TAG = re.compile(r"^[A-Za-z0-9_.:=+-]{1,128}$")


def call_site(skip_prefix: str = "ncclguard") -> str:
    """``file:line`` of the innermost frame outside ncclguard: where the user called us."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != skip_prefix and not module.startswith(skip_prefix + "."):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def check_tag(tag: Any) -> None:
    """Raises ValueError (before any communication) for a tag that cannot name a round."""
    if tag is not None and not (isinstance(tag, str) and _TAG.match(tag)):
        raise ValueError(
            f"tag must be a short name (1-128 of A-Z a-z 0-9 _ . : = + -), got {tag!r}; e.g. tag=f'eval-{{step}}'"
        )


class Call:
    """One safe_* call of this rank: its group, kind, round name and tag.

    The round name and the call site are made when first asked for (on the failure path, or for
    a store round), so the hot path of an all_reduce that makes no store round builds no string
    and walks no stack.

    Args:
        info: the group.
        kind: ``"all_reduce"``, ``"barrier"``, ...
        round: the round's name; None to make it from ``base`` and ``n`` (the call count).
        tag: the tag the call meets under, or None.
    """

    __slots__ = ("info", "kind", "tag", "_round", "_base", "_n", "_site")

    def __init__(
        self,
        info: GroupInfo,
        kind: str,
        round: str | None = None,
        tag: str | None = None,
        *,
        base: str = "",
        n: int = 0,
    ) -> None:
        self.info, self.kind, self.tag = info, kind, tag
        self._round, self._base, self._n = round, base, n
        self._site: str | None = None

    def __repr__(self) -> str:
        return f"Call(group={self.info.name!r}, kind={self.kind!r}, round={self.round!r}, tag={self.tag!r})"

    @property
    def round(self) -> str:
        if self._round is None:
            self._round = call_round(self.info, self._base, self._n)
        return self._round

    @property
    def site(self) -> str:
        if self._site is None:
            self._site = call_site()
        return self._site

    def print(self, **data: Any) -> dict[str, Any]:
        """This call's fingerprint: kind, site, and what else must agree across ranks."""
        return {"kind": self.kind, "site": self.site, **data}


def begin_call(info: GroupInfo, kind: str, tag: str | None = None) -> Call:
    """Takes this rank's next call number on the group (see :func:`~ncclguard.collectives.numbering.next_call`)."""
    if tag is None:
        base, n = take_number(call_count(info))
        call = Call(info, kind, base=base, n=n)
    else:
        call = Call(info, kind, next_call(info, tag), tag)
    if tag is not None or kind != "all_reduce":
        call._site = call_site()
    return call


class CallPrint(BaseModel):
    """A rank's fingerprint as read from the store: kind and site, then the call's own fields."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: str = Field(max_length=64)
    site: str = Field(max_length=4096)

    def data(self) -> dict[str, Any]:
        """The fields that must agree across ranks (everything but the kind, the site and what a
        rank says of its own input's values, :data:`NONFINITE_FIELD`)."""
        return {k: v for k, v in (self.model_extra or {}).items() if k != NONFINITE_FIELD}

    def where(self) -> str:
        return f"{self.kind} at {self.site}"


def _parse(payload: Any) -> CallPrint | None:
    try:
        return CallPrint.model_validate(payload)
    except ValidationError:
        return None


def compare_prints(prints: Mapping[int, CallPrint | None]) -> tuple[str | None, str | None]:
    """Compares the fingerprints of one round (pure).

    Args:
        prints: each rank's fingerprint (by global rank), None where it could not be read.

    Returns:
        (why the ranks cannot go on together, or None; a note on differing call sites, or None).
    """
    listing = "; ".join(
        f"rank {r}: {p.where() if p else 'an unreadable fingerprint'}" for r, p in sorted(prints.items())
    )
    if any(p is None for p in prints.values()):
        return f"a rank's fingerprint could not be read ({listing})", None
    readable = {r: p for r, p in prints.items() if p is not None}
    if len({p.kind for p in readable.values()}) > 1:
        return (
            f"the ranks are in different calls ({listing}): a rank made a safe_* call the others did not, or "
            "skipped one; calls meet by their count on the group (tag= names a meeting point)",
            None,
        )
    data = {r: p.data() for r, p in readable.items()}
    if len({repr(sorted(d.items())) for d in data.values()}) > 1:
        return "ranks disagree, nothing was sent (" + "; ".join(
            f"rank {r}: {d}" for r, d in sorted(data.items())
        ) + ")", None
    sites = {p.site for p in readable.values()}
    note = None
    if len(sites) > 1:
        note = f"one {next(iter(readable.values())).kind} called from different lines ({listing})"
    return None, note


_noted_lock = threading.Lock()
_noted: set[tuple[str, frozenset[str]]] = set()


def _note_sites(info: GroupInfo, prints: Mapping[int, CallPrint | None], note: str) -> None:
    """Logs a site difference once per group and set of sites (a loop would repeat it every step)."""
    key = (info.name, frozenset(p.site for p in prints.values() if p is not None))
    with _noted_lock:
        if key in _noted:
            return
        _noted.add(key)
    log.warning("group %r: %s; fine if intended, else pass tag= to align the calls", info.name, note)


@dataclass
class FingerprintRound:
    """What a round of fingerprints told this rank.

    Attributes:
        ok: every rank arrived, in the same kind of call, agreeing on every field.
        prints: each rank's fingerprint as sent (global ranks; the ranks that arrived).
        missing: global ranks that did not arrive by the deadline (sorted).
        missing_hosts: hostnames of the missing ranks, where earlier rounds taught them.
        late: this rank arrived after the others had given up.
        mismatch: why the ranks that arrived cannot go on together, or None.
    """

    ok: bool
    prints: dict[int, dict[str, Any]]
    missing: list[int]
    missing_hosts: dict[int, str]
    late: bool
    mismatch: str | None


def meet_prints(call: Call, mine: dict[str, Any], deadline: float) -> FingerprintRound:
    """Runs the call's round with fingerprint ``mine`` and compares what the ranks sent.

    Raises:
        StoreUnreachable: the store did not answer.
    """
    info = call.info
    rnd = exchange(info, call.round, mine, Deadline(deadline))
    sent = {info.global_rank(r): p for r, p in sorted(rnd.payloads.items())}
    parsed = {r: _parse(p) for r, p in sent.items()}
    mismatch, note = compare_prints(parsed)
    if note is not None and mismatch is None:
        _note_sites(info, parsed, note)
    ok = rnd.ok and mismatch is None
    if ok and call.tag is not None:
        realign_on_tag(info, call.round)
    hosts = known_hosts(info)
    return FingerprintRound(
        ok=ok,
        prints={r: p if isinstance(p, dict) else {"unreadable": repr(p)[:200]} for r, p in sent.items()},
        missing=sorted(info.global_rank(r) for r in rnd.missing),
        missing_hosts={info.global_rank(r): hosts[r] for r in rnd.missing if r in hosts},
        late=rnd.late,
        mismatch=mismatch,
    )


@dataclass
class Postmortem:
    """Who else gave up in a failed round, learned through the store.

    Attributes:
        missing: global ranks that never reached the round (sorted), or None: the store did not answer.
        elsewhere: global rank -> ``"kind at site"`` for ranks that gave up in this round in a
            different call than this rank's.
        store_error: why the store did not answer (``missing`` is then None), else None.
    """

    missing: list[int] | None
    elsewhere: dict[int, str]
    store_error: str | None = None

    def describe(self) -> str:
        """``"; rank 1 was in barrier at x.py:3"`` for the ranks that were elsewhere, or, when the
        store did not answer, that this rank cannot tell who arrived and why; ``""`` otherwise."""
        if self.store_error is not None:
            # A rank cut off from the store's host cannot learn who arrived: say so, not nothing.
            return (
                "; the store did not answer the post-mortem, so this rank cannot tell which ranks arrived: "
                f"its link to the store's host is down or the store is frozen ({self.store_error})"
            )
        return "".join(f"; rank {r} was in {where} in this round" for r, where in sorted(self.elsewhere.items()))


def postmortem(call: Call, give_up_at: float) -> Postmortem:
    """After a failure, every rank that gave up in this round says so and which call it was in.

    Waits at most ``Config.postmortem_grace_s`` (and not past ``give_up_at``) for the others; a
    rank still absent never reached this round.
    """
    info = call.info
    mine = CallPrint(kind=call.kind, site=call.site)
    grace = min(get_config().postmortem_grace_s, give_up_at - time.monotonic())
    try:
        rnd = exchange(info, f"{call.round}/pm", mine.model_dump(), Deadline.within(grace))
    except StoreUnreachable as exc:
        return Postmortem(None, {}, store_error=str(exc))
    elsewhere = {}
    for r, payload in rnd.payloads.items():
        theirs = _parse(payload)
        if theirs is not None and (theirs.kind, theirs.site) != (mine.kind, mine.site):
            elsewhere[info.global_rank(r)] = theirs.where()
    return Postmortem(sorted(info.global_rank(r) for r in rnd.missing), elsewhere)
