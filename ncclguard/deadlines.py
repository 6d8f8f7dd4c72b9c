"""Deadlines: how long one collective may take, by the policy chosen in :class:`ncclguard.Config`,
and how it nests inside the group's own timeout (ours must fire first, so that we can report)."""

from __future__ import annotations

import math
from datetime import timedelta

from ncclguard.config import Config, get_config

__all__ = [
    "adaptive_timeout",
    "bandwidth_timeout",
    "check_below_group_timeout",
    "default_deadline",
    "group_cap_s",
    "size_timeout",
    "to_seconds",
]


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


def group_cap_s(group_timeout_s: float, config: Config | None = None) -> float:
    """The longest default deadline on a group whose own (backend) timeout is ``group_timeout_s``.

    ``group_timeout_s * (1 - deadline_headroom) - postmortem_grace_s``, and at least half the
    group's timeout: the call, its post-mortem included, returns before the backend gives up
    (NCCL's watchdog would tear the process down then), with time left to act on the error.
    """
    c = config or get_config()
    return max(group_timeout_s * (1 - c.deadline_headroom) - c.postmortem_grace_s, group_timeout_s / 2)


def default_deadline(policy_s: float, group_timeout_s: float | None, config: Config | None = None) -> float:
    """``policy_s`` (a deadline from the policy or ``Config.barrier_timeout_s``) capped by :func:`group_cap_s`.

    Args:
        policy_s: the deadline the policy gives.
        group_timeout_s: the group's own timeout, or None when unknown (no cap).
        config: the policy; default the configuration in force.
    """
    if group_timeout_s is None:
        return policy_s
    return min(policy_s, group_cap_s(group_timeout_s, config))


def check_below_group_timeout(seconds: float, group_timeout_s: float | None, group_name: str) -> None:
    """Refuses an explicit deadline at or above the group's own timeout.

    Raises:
        ValueError: ``seconds >= group_timeout_s``: the backend would give up first, and on NCCL
            its watchdog ends the process before ncclguard can report.
    """
    if group_timeout_s is not None and seconds >= group_timeout_s:
        raise ValueError(
            f"timeout={seconds:g} s is not below the timeout of group {group_name!r} ({group_timeout_s:g} s): the "
            f"backend would give up first and ncclguard could not report. Pass a shorter timeout (or none: the "
            f"default is capped at {group_cap_s(group_timeout_s):g} s), or create the group with a longer timeout="
        )
