"""Sizes on the command line: element counts like ``5e8`` or ``2**20``, byte sizes like ``64M``.

Parsed with a regular expression, never ``eval``: a size is either a decimal/scientific number
that is a whole count, or ``base**exp``. Byte suffixes are binary, as in nccl-tests
(``K`` = 1024, ``M`` = 1024**2, ``G`` = 1024**3).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["parse_numel", "parse_bytes", "sweep_bytes", "format_bytes", "format_numel"]

_POWER = re.compile(r"^\s*(\d+)\s*(?:\*\*|\^)\s*(\d+)\s*$")
_BYTES = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_MAX_EXP = 64  # 2**64 elements is beyond any machine; a bigger exponent is a typo


def parse_numel(text: str) -> int:
    """Parses an element count: ``1000``, ``1e6``, ``5e8``, ``2.5e7``, ``2**20`` (or ``2^20``).

    Args:
        text: the count as typed.

    Returns:
        The count, a positive int.

    Raises:
        ValueError: not a whole positive number, or not one of the forms above.
    """
    if not isinstance(text, str):
        raise TypeError(f"an element count is parsed from text, got {type(text).__name__}")
    m = _POWER.match(text)
    if m:
        base, exp = int(m.group(1)), int(m.group(2))
        # Bounded before computing, so "9**99999999" cannot stall the parser.
        value = base**exp if exp <= _MAX_EXP and base <= 2**_MAX_EXP else 2**_MAX_EXP + 1
        if value > 2**_MAX_EXP:
            raise ValueError(f"element count {text!r} is too large (at most 2**{_MAX_EXP})")
    else:
        try:
            number = Decimal(text.strip().replace("_", ""))
        except InvalidOperation:
            raise ValueError(f"element count {text!r} is not a number; write it like 1000, 1e6, 5e8 or 2**20") from None
        if number.is_finite() and number > 2**_MAX_EXP:
            raise ValueError(f"element count {text!r} is too large (at most 2**{_MAX_EXP})")
        if not number.is_finite() or number != number.to_integral_value():
            raise ValueError(f"element count {text!r} is not a whole number of elements; write e.g. 1e6 or 2**20")
        value = int(number)
    if value <= 0:
        raise ValueError(f"element count {text!r} must be at least 1")
    return value


def parse_bytes(text: str) -> int:
    """Parses a byte size as nccl-tests does: ``1024``, ``8K``, ``64M``, ``1G`` (binary units).

    ``KB``/``KiB`` spellings are accepted too and mean the same (1024).

    Raises:
        ValueError: not of that form, or zero.
    """
    if not isinstance(text, str):
        raise TypeError(f"a byte size is parsed from text, got {type(text).__name__}")
    m = _BYTES.match(text)
    if not m:
        raise ValueError(f"byte size {text!r} is not of the form N, NK, NM or NG (e.g. 1K, 64M, 1G)")
    value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"byte size {text!r} must be at least 1 byte")
    return value


def sweep_bytes(begin: int, end: int, factor: int) -> list[int]:
    """The byte sizes of a sweep: ``begin``, ``begin*factor``, ... up to and including ``end``.

    Raises:
        ValueError: ``begin`` > ``end`` or ``factor`` < 2 with ``begin`` < ``end``.
    """
    if begin > end:
        raise ValueError(f"-b ({format_bytes(begin)}) must not exceed -e ({format_bytes(end)})")
    if begin == end:
        return [begin]
    if factor < 2:
        raise ValueError(f"-f must be at least 2 for a sweep from -b to -e, got {factor}")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def format_bytes(nbytes: int) -> str:
    """Short binary size: ``1 KiB``, ``64 MiB``, ``1.5 GiB``, ``12 B``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            if value == int(value) or value >= 100:
                return f"{value:.0f} {unit}"
            return f"{value:.3g} {unit}"
    return f"{nbytes} B"


def format_numel(numel: int) -> str:
    """A count the way the CLI accepts it back: ``2**20`` for powers of two, ``1e8``, else digits."""
    if numel >= 1024 and numel & (numel - 1) == 0:
        return f"2**{numel.bit_length() - 1}"
    text = f"{numel:.0e}".replace("e+0", "e").replace("e+", "e")
    return text if numel >= 1000 and parse_numel(text) == numel else str(numel)
