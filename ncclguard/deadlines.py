"""Deadlines: the one type every wait takes (:class:`Deadline`), how long one collective may take by
the policy chosen in :class:`ncclguard.Config`, and how that nests inside the group's own timeout
(ours must fire first, so that we can report).

Time travels one way through the library: a user passes a timeout as seconds or a ``timedelta``;
the function that receives it turns it into a :class:`Deadline` once, and every wait below takes
that deadline, so the time left shrinks as the calls go and no layer starts its own full timeout
again.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

from ncclguard.config import Config, get_config

__all__ = [
    "Deadline",
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


class Deadline:
    """An instant of ``time.monotonic()`` by which a wait must end.

    Args:
        at: the instant, on the monotonic clock.

    Attributes:
        at: the instant.

    Raises:
        ValueError: ``at`` is not a finite number.
    """

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"a Deadline is a finite time.monotonic() instant, got {at!r}")
        self.at = float(at)

    @classmethod
    def after(cls, timeout: float | timedelta | Deadline, name: str = "timeout") -> Deadline:
        """The deadline ``timeout`` from now; a Deadline is returned as it is.

        Args:
            timeout: positive seconds, a ``timedelta``, or a Deadline (passed through).
            name: the argument's name, for the error.

        Returns:
            The deadline.

        Raises:
            TypeError, ValueError: ``timeout`` is not a positive, finite duration.
        """
        if isinstance(timeout, Deadline):
            return timeout
        return cls(time.monotonic() + to_seconds(timeout, name))

    @classmethod
    def within(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now, for bounds the library computes (0 or less: now).

        Args:
            seconds: the time left, in seconds.

        Returns:
            The deadline.
        """
        return cls(time.monotonic() + max(float(seconds), 0.0))

    def left(self) -> float:
        """Seconds left (0.0 once passed)."""
        return max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        """True once the instant has passed."""
        return time.monotonic() >= self.at

    def plus(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` later (a grace for the clean-up after a round)."""
        return Deadline(self.at + seconds)

    def sooner(self, seconds: float) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now (one call's bound inside a longer wait)."""
        return Deadline(min(self.at, time.monotonic() + max(seconds, 0.0)))

    def as_timedelta(self, floor_s: float = 0.001) -> timedelta:
        """The time left as a ``timedelta``, at least ``floor_s`` (a zero timeout means "the store's
        default" to torch's stores, the opposite of "now")."""
        return timedelta(seconds=max(self.left(), floor_s))

    def sleep(self, seconds: float) -> bool:
        """Sleeps ``seconds``, or until the deadline if that comes first.

        Returns:
            True while the deadline has not passed.
        """
        time.sleep(max(min(seconds, self.at - time.monotonic()), 0.0))
        return not self.passed()

    def __repr__(self) -> str:
        return f"Deadline(left={self.at - time.monotonic():.3f}s)"


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
