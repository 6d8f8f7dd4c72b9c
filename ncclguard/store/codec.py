"""The one codec of what ranks exchange through the store: size-bounded JSON into pydantic models.

Whatever a peer (or anything else with access to the store) wrote is read here and nowhere else:
refused when over a size bound before any parsing, parsed as JSON by a pydantic model (never
unpickled), and, unless the caller says otherwise, refused when a float in it is NaN or infinite
(JSON's ``NaN`` and ``Infinity`` parse as floats, and a stillness of ``Infinity`` would read as a
desync at once). Every refusal is a :class:`DecodeError` (a ``ValueError``) whose text names the
value (``what``), the model, and what is wrong; its attributes let a caller word its own log line.

Users: the rounds of :mod:`ncclguard.collectives.rendezvous` (arrivals), the recovery meeting
(arrivals and the outcome) and the watchdog's :class:`~ncclguard.watching.base.watchdog_store.WatchdogStore`
(heartbeats, incidents, statements, with the per-model bounds of its ``LIMITS``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from ncclguard._log import log
from ncclguard.errors import DecodeError, StoreUnreachable

__all__ = ["DEFAULT_LIMIT", "DecodeError", "check_finite", "decode", "decode_each", "decode_outcome", "encode"]

M = TypeVar("M", bound=BaseModel)

DEFAULT_LIMIT = 64 * 1024  # bytes; for a model its caller gives no bound of its own

Reason = Literal["size", "invalid", "non-finite"]


def _non_finite(value: BaseModel) -> float | None:
    """The first NaN or infinite float anywhere in ``value``, or None."""
    todo: list[Any] = [value.model_dump()]
    while todo:
        item = todo.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return item
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return None


def check_finite(value: BaseModel, what: str, size: int = 0, limit: int = 0) -> None:
    """Refuses a value holding a NaN or infinite float anywhere.

    Args:
        value: a decoded value.
        what: how to name it in the error.
        size: its length in bytes, when known (for the error's attributes).
        limit: the bound it was read under, when known (for the error's attributes).

    Raises:
        DecodeError: a float in ``value`` is NaN or infinite (reason ``"non-finite"``).
    """
    bad = _non_finite(value)
    if bad is not None:
        raise DecodeError(
            f"{what}: holds {bad!r} where a finite number belongs",
            what=what,
            model=type(value).__name__,
            reason="non-finite",
            size=size,
            limit=limit,
            detail=repr(bad),
        )


def decode(model: type[M], blob: bytes | str, what: str, limit: int, *, finite: bool = True) -> M:
    """Decodes one value read from the store.

    Args:
        model: the pydantic model it must fit.
        blob: the raw value (a ``str`` is measured in UTF-8 bytes).
        what: how to name it in the error (the key, or the rank and round it came from).
        limit: the most bytes accepted; a longer value is refused before it is parsed.
        finite: also refuse NaN and infinite floats anywhere in it (False where a payload may
            legitimately carry them, as a round's free-form payload may).

    Returns:
        The value, an instance of ``model``.

    Raises:
        DecodeError: over ``limit`` bytes, not valid JSON for ``model``, or (with ``finite``)
            holding a non-finite float. A ``ValueError``.
    """
    raw = blob.encode() if isinstance(blob, str) else blob
    size = len(raw)
    name = model.__name__
    if size > limit:
        raise DecodeError(
            f"{what}: {size} bytes, over the {limit}-byte bound of a {name}",
            what=what,
            model=name,
            reason="size",
            size=size,
            limit=limit,
            detail=f"{size} bytes",
        )
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        msg = errors[0]["msg"] if errors else str(exc)
        raise DecodeError(
            f"{what}: not a valid {name} ({where or 'value'}: {msg}; {exc.error_count()} error(s))",
            what=what,
            model=name,
            reason="invalid",
            size=size,
            limit=limit,
            detail=msg,
        ) from None
    if finite:
        check_finite(value, what, size, limit)
    return value


def decode_each(model: type[M], blobs: Mapping[int, bytes], what: str, limit: int, said: str) -> dict[int, M | None]:
    """Each rank's value in ``blobs`` (a round's arrivals), None for one that cannot be read.

    Args:
        model: the model of one value.
        blobs: the raw values, by rank.
        what: one value in words (``"commit statement"``: "rank 2's commit statement").
        limit: the most bytes one value may hold.
        said: the log line's prefix for a value refused (``"should_commit"``), logged as an error.

    Returns:
        The values by rank; None where the value was refused (its sender counts as failed).
    """
    out: dict[int, M | None] = {}
    for rank, blob in blobs.items():
        try:
            out[rank] = decode(model, blob, f"rank {rank}'s {what}", limit)
        except DecodeError as exc:
            log.error("%s: %s", said, exc)
            out[rank] = None
    return out


def decode_outcome(model: type[M], raw: bytes, what: str, key: str, limit: int) -> M:
    """A round's settled outcome: every rank reads the same one, so one that cannot be read means
    the store cannot be trusted.

    Args:
        model: the outcome's model.
        raw: its raw value.
        what: the outcome in words (``"the commit outcome"``).
        key: its key.
        limit: the most bytes it may hold.

    Raises:
        StoreUnreachable: it cannot be read (what, under which key, and why).
    """
    try:
        return decode(model, raw, f"{what} under {key!r}", limit)
    except DecodeError as exc:
        raise StoreUnreachable(f"{what} under {key!r} cannot be read: {exc}") from exc


def encode(value: BaseModel | Any) -> str:
    """The JSON text of ``value``, as :func:`decode` reads it back.

    Args:
        value: a pydantic model (written by its aliases), or plain JSON-serialisable data
            (written by :func:`json.dumps`, byte for byte as before the codec existed).

    Returns:
        The JSON text.

    Raises:
        TypeError: ``value`` is not JSON-serialisable.
    """
    if isinstance(value, BaseModel):
        return value.model_dump_json(by_alias=True)
    return json.dumps(value)
