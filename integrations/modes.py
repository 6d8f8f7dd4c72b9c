"""eval_mode, now :mod:`ncclguard.evaluation.modes`; kept so old imports work."""

from ncclguard.evaluation.modes import eval_mode

__all__ = ["eval_mode"]
