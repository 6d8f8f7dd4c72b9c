"""Deadlines: how long one collective may take, by the policy chosen in :class:`ncclguard.Config`."""

from __future__ import annotations

import math
from datetime import timedelta

from ncclguard.config import Config, get_config

__all__ = ["to_seconds", "size_timeout", "bandwidth_timeout", "adaptive_timeout"]


def to_seconds(value: float | timedelta, name: str = "timeout") -> float:
    """Converts seconds or a timedelta to positive seconds.

    Raises:
        TypeError: ``value`` is neither a number nor a timedelta.
        ValueError: ``value`` is not a positive, finite duration.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be seconds (a number) or a datetime.timedelta, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive duration, got {value!r}; pass e.g. {name}=30 (seconds)")
    return seconds


def size_timeout(numel: int, config: Config | None = None) -> float:
    """The seeds' tiers: under 1e7 elements 300 s, under 1e8 900 s, else 1800 s (configurable)."""
    c = config or get_config()
    if numel < c.timeout_small_below:
        return c.timeout_small_s
    if numel < c.timeout_medium_below:
        return c.timeout_medium_s
    return c.timeout_large_s


def bandwidth_timeout(nbytes: int, config: Config | None = None) -> float:
    """``timeout_base_s`` plus the time ``nbytes`` take at the minimum expected bandwidth."""
    c = config or get_config()
    return c.timeout_base_s + nbytes / (c.min_bandwidth_gbps * 1e9)


def adaptive_timeout(numel: int, nbytes: int, config: Config | None = None) -> float:
    """The default deadline of a collective on ``numel`` elements (``nbytes`` bytes), by policy."""
    c = config or get_config()
    if c.timeout_policy == "bandwidth":
        return bandwidth_timeout(nbytes, c)
    return size_timeout(numel, c)
