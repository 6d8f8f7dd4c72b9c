"""One validated configuration for the whole library, with ``NCCLGUARD_*`` environment overrides.

Every invariant (positive sizes, thresholds in order, timeouts in order) is stated here once,
so the code that uses a value never re-checks it.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Config", "configure", "get_config"]

# Settings renamed, by old name: the new one (the evaluation deadline has one name everywhere).
_RENAMED = {"eval_deadline_s": "eval_timeout_s"}


class Config(BaseSettings):
    """Settings of ncclguard. Each field can be set as ``NCCLGUARD_<FIELD>`` in the environment.

    Chunk policy (from the seeds): under ``chunk_direct_below`` elements one call; up to
    ``chunk_large_from`` elements ``mid_chunks`` chunks of about ``mid_chunk_numel``; above it
    ``large_chunks`` chunks of about ``large_chunk_numel``.

    Deadline policy: ``timeout_policy="size"`` uses the seeds' tiers (under 1e7 elements 300 s,
    under 1e8 900 s, else 1800 s); ``"bandwidth"`` uses ``timeout_base_s + bytes /
    (min_bandwidth_gbps * 1e9)``. A default deadline (per op and the barrier's) is then capped
    below the group's own timeout ``T``: at ``T * (1 - deadline_headroom) - postmortem_grace_s``,
    and never under ``T / 2``, so ncclguard reports before the backend gives up.
    """

    model_config = SettingsConfigDict(env_prefix="NCCLGUARD_", validate_assignment=True, extra="forbid")

    # Chunking.
    chunk_direct_below: int = Field(100_000_000, gt=0)
    chunk_large_from: int = Field(500_000_000, gt=0)
    mid_chunks: tuple[int, int] = (2, 5)
    mid_chunk_numel: int = Field(100_000_000, gt=0)
    large_chunks: tuple[int, int] = (10, 20)
    large_chunk_numel: int = Field(50_000_000, gt=0)
    max_inflight: int = Field(2, ge=1, le=64)

    # Deadlines of a single collective.
    timeout_policy: Literal["size", "bandwidth"] = "size"
    timeout_small_below: int = Field(10_000_000, gt=0)
    timeout_medium_below: int = Field(100_000_000, gt=0)
    timeout_small_s: float = Field(300.0, gt=0)
    timeout_medium_s: float = Field(900.0, gt=0)
    timeout_large_s: float = Field(1800.0, gt=0)
    timeout_base_s: float = Field(60.0, gt=0)
    min_bandwidth_gbps: float = Field(0.1, gt=0)

    # Share of the group's own timeout kept free after a default deadline, for the post-mortem
    # and whatever the caller does with the error before the backend gives up.
    deadline_headroom: float = Field(0.1, gt=0, lt=1)

    # Barrier and the cross-rank check.
    barrier_timeout_s: float = Field(300.0, gt=0)
    postmortem_grace_s: float = Field(0.5, ge=0, le=0.9)
    # safe_all_reduce's check of its input for NaN and Inf (check_finite=None): "verified" where
    # the call's cross-rank check runs anyway (at or above chunk_direct_below, verify=True, a tag),
    # "always" (every call then runs the cross-rank check), "never". Off by default: measured, the
    # scan adds well over 1% to a gloo call (docs/numerics.md, benchmarks/finite_check_cost.py).
    check_finite: Literal["verified", "always", "never"] = "never"

    # How a guarded call waits for an NCCL collective (ncclguard.collectives.completion):
    # "poll" asks the work every nccl_poll_us (seen ~20 µs after the GPU finished, about a quarter
    # of a core while waiting); "event" sleeps in a blocking CUDA event (a few % of a core, but
    # seen 0.1-0.4 ms late on the H100 measured, benchmarks/nccl_completion.py).
    nccl_wait: Literal["poll", "event"] = "poll"
    nccl_poll_us: float = Field(20.0, gt=0, le=10_000)

    # Flight recorder.
    flight_records: int = Field(2000, gt=0)

    # Timeout hierarchy (ncclguard.env.hierarchy.TimeoutHierarchy); None = not declared.
    # How long one evaluation pass may run on a rank while the others wait (the evaluation deadline,
    # eval_timeout_s wherever it is given; eval_deadline_s, its old name, still read: _old_names).
    eval_timeout_s: float | None = Field(None, gt=0)
    # The progress-heartbeat timeout of a supervisor outside the job (e.g. nvidia-resiliency-ext's
    # ft_launcher), which must exceed the process-group timeout.
    heartbeat_timeout_s: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        # A setting renamed keeps working, given as a keyword or in the environment, with a warning.
        if not isinstance(data, dict):
            return data
        for old, new in _RENAMED.items():
            env_old = os.environ.get(f"NCCLGUARD_{old.upper()}")
            if old in data:  # given by name (configure passes the settings in force beside it: it wins)
                value = data[old]
            elif env_old is not None and data.get(new) is None:
                value = env_old
            else:
                continue
            warnings.warn(
                f"{old} (NCCLGUARD_{old.upper()}) is deprecated: use {new} (NCCLGUARD_{new.upper()})",
                DeprecationWarning,
                stacklevel=2,
            )
            data = {**{k: v for k, v in data.items() if k != old}, new: value}
        return data

    @model_validator(mode="after")
    def _in_order(self) -> Config:
        if self.chunk_direct_below > self.chunk_large_from:
            raise ValueError(
                f"chunk_direct_below ({self.chunk_direct_below}) must be <= chunk_large_from ({self.chunk_large_from})"
            )
        for name in ("mid_chunks", "large_chunks"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.timeout_small_below > self.timeout_medium_below:
            raise ValueError("timeout_small_below must be <= timeout_medium_below")
        if not self.timeout_small_s <= self.timeout_medium_s <= self.timeout_large_s:
            raise ValueError(
                "size tiers must not shrink with size: timeout_small_s <= timeout_medium_s <= "
                f"timeout_large_s, got {self.timeout_small_s}, {self.timeout_medium_s}, {self.timeout_large_s}"
            )
        return self


class _InForce:
    """The configuration in force in this process (a process runs one configuration, whatever
    its world: a rebuild keeps it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.config: Config | None = None


_in_force = _InForce()


def get_config() -> Config:
    """Returns the configuration in force (built from the environment on first use)."""
    config = _in_force.config
    if config is None:
        with _in_force.lock:
            if _in_force.config is None:
                _in_force.config = Config()
            config = _in_force.config
    return config


def configure(**overrides: Any) -> Config:
    """Replaces the configuration in force with one that has ``overrides`` applied.

    Args:
        **overrides: fields of :class:`Config`.

    Returns:
        The new, validated configuration.

    Raises:
        pydantic.ValidationError: an unknown field or a value that breaks an invariant; the
            configuration in force is then unchanged.
    """
    with _in_force.lock:
        current = _in_force.config if _in_force.config is not None else Config()
        _in_force.config = Config(**{**current.model_dump(), **overrides})
        return _in_force.config
