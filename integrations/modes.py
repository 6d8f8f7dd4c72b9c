"""eval_mode, now :mod:`ncclguard.recovery.modes`; kept so old imports work."""

from ncclguard.recovery.modes import eval_mode

__all__ = ["eval_mode"]
