"""Asking a rank's supervisor to judge and end it: the verdict's reach into another host.

A waiting rank's verdict (:mod:`ncclguard.recovery._verdict.verdict`) judges a peer from what
reaches it: the peer's heartbeats, and ``/proc`` where the peer runs on the same host. A peer on
another host that is SIGSTOPped, or whose main thread holds the GIL in C, publishes nothing: from
there it is ``unknown`` for good, and its connections cannot be cut from there. Its supervisor
(:mod:`ncclguard.supervise`) runs on its host and is not stuck, so the verdict asks it, under
``ncclguard/ask/<restart>/<origin>`` (``<restart>``: ``TORCHELASTIC_RESTART_COUNT``, as for the
death notices; ``<origin>``: the rank's launch rank):

- ``judged="unknown"``: the peers cannot tell; the supervisor judges its process from ``/proc`` and
  ends it (SIGKILL) when it is stuck;
- ``judged="confirm"``: the only waiting rank judged it stuck (no other rank waits to agree); the
  supervisor's own look is the second view: it ends the process only when it sees it stuck too, and
  posts its death (a kill when it restarts the rank, else ``STUCK_RC``);
- ``judged="stuck"``: the peers judged it stuck and posted its death (``STUCK_RC``); the supervisor
  ends it if it has not exited by itself within a grace;
- ``judged="stuck"`` with ``heal``: the peers agreed it is stuck (or it judged itself) and posted
  nothing: the supervisor ends it at once and, with a restart left, restarts it to rejoin and be
  healed (its death posted as a kill, so the rebuild waits for it); else it posts ``STUCK_RC``.

The supervisor answers under ``ncclguard/answer/<restart>/<origin>`` (:class:`JudgeAnswer`), so the
asking ranks can say what was decided (a busy rank stays a report). Nothing is deleted: an ask names
the process it is about (``pid``), and a restarted process has another. Values are JSON read with a
size bound (:mod:`ncclguard.store.codec`); callers bound each call
(:func:`~ncclguard.store.bounded.bounded_store_call`).
"""

from __future__ import annotations

import os
from typing import Literal

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.store.codec import DecodeError, decode, encode

__all__ = ["MAX_ASK_BYTES", "JudgeAnswer", "JudgeAsk", "post_answer", "post_ask", "read_answer", "read_ask"]

MAX_ASK_BYTES = 2 * 1024


class JudgeAsk(BaseModel):
    """What the waiting ranks ask of a rank's supervisor.

    Attributes:
        origin: the rank's launch rank (``RANK`` of its process).
        pid: the process the ask is about (from its last heartbeat).
        judged: ``"unknown"``: judge it; ``"confirm"``: the only waiting rank judged it stuck: end it
            if you see it stuck too; ``"stuck"``: its peers (or the rank itself) agreed it is stuck: end it.
        heal: the engine heals a restarted rank (``heal=True``): a process ended on this ask may be
            restarted to rejoin. On a ``stuck`` ask it also says the askers posted no death notice:
            the supervisor posts it (a kill when it restarts the rank, else ``STUCK_RC``).
        still_s: how long its progress must stand still before it is stuck (the verdict's window).
        asker: the launch rank that asked.
        site: where its last heartbeat placed its main thread.
        at: ``time.time()`` on the asker's host.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    origin: int = Field(ge=0)
    pid: int = Field(ge=0)
    judged: Literal["unknown", "stuck", "confirm"]
    heal: bool = False
    still_s: float = Field(gt=0, le=3600)
    asker: int = Field(ge=0)
    site: str = Field("", max_length=300)
    at: float


class JudgeAnswer(BaseModel):
    """What a supervisor decided about its rank's process.

    Attributes:
        origin: the rank's launch rank.
        pid: the process judged.
        state: ``"moving"`` (left alone), ``"stuck"`` (ended).
        evidence: what decided, in words.
        restarted: a stuck process was ended and its rank restarted (to rejoin and be healed).
        host: the supervisor's host.
        at: ``time.time()`` on that host.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    origin: int = Field(ge=0)
    pid: int = Field(ge=0)
    state: Literal["moving", "stuck"]
    evidence: str = Field(max_length=300)
    restarted: bool = False
    host: str = Field(max_length=255)
    at: float


def _key(kind: str, origin: int, restart: str | None) -> str:
    if restart is None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ncclguard/{kind}/{restart}/{origin}"


_MAX_REFUSED = 1024  # values said refused, per process: a flood of bad values is not a flood of lines
_refused: set[tuple[str, int]] = set()


def _read(store: dist.Store, key: str, model: type[JudgeAsk] | type[JudgeAnswer]) -> JudgeAsk | JudgeAnswer | None:
    if not store.check([key]):  # a look leaves no key behind
        return None
    raw = bytes(store.get(key))
    try:
        return decode(model, raw, f"the value under {key!r}", MAX_ASK_BYTES)
    except DecodeError as exc:  # a hostile or torn value never ends a process; said once per value
        said = (key, hash(raw))
        if said not in _refused and len(_refused) < _MAX_REFUSED:
            _refused.add(said)
            log.warning("%s; refused: nothing is done on it", exc)
        return None


def post_ask(store: dist.Store, ask: JudgeAsk, restart: str | None = None) -> None:
    """Writes ``ask`` for the supervisor of launch rank ``ask.origin`` (two store calls at most).

    Args:
        store: the job's store (unprefixed).
        ask: the ask.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.
    """
    store.set(_key("ask", ask.origin, restart), encode(ask))


def read_ask(store: dist.Store, origin: int, restart: str | None = None) -> JudgeAsk | None:
    """The last ask about launch rank ``origin``, or None (none, or unreadable); one store call when none.

    Args:
        store: the job's store (unprefixed).
        origin: the launch rank.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.
    """
    got = _read(store, _key("ask", origin, restart), JudgeAsk)
    return got if isinstance(got, JudgeAsk) else None


def post_answer(store: dist.Store, answer: JudgeAnswer, restart: str | None = None) -> None:
    """Writes a supervisor's ``answer`` about launch rank ``answer.origin``.

    Args:
        store: the job's store (unprefixed).
        answer: the answer.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.
    """
    store.set(_key("answer", answer.origin, restart), encode(answer))


def read_answer(store: dist.Store, origin: int, restart: str | None = None) -> JudgeAnswer | None:
    """The last answer about launch rank ``origin``, or None.

    Args:
        store: the job's store (unprefixed).
        origin: the launch rank.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.
    """
    got = _read(store, _key("answer", origin, restart), JudgeAnswer)
    return got if isinstance(got, JudgeAnswer) else None
