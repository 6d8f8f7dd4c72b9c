"""The guarded evaluation: an evaluation that fails or stalls on one rank is skipped on every rank
together, and training goes on (``guarded_evaluate``; the frameworks' integrations wrap it).

- :mod:`~ncclguard.evaluation.guard`: the guard itself, its options and its report;
- :mod:`~ncclguard.evaluation.side_group`: the side group that keeps the evaluation's collectives
  off the training group;
- :mod:`~ncclguard.evaluation.modes`: ``eval_mode``, which puts a wrapped model and the module it
  wraps in evaluation mode together (DeepSpeed's engine keeps its own flag).
"""

from ncclguard.evaluation.guard import FAILED_METRIC, EvalReport, GuardOptions, guarded_evaluate, last_report
from ncclguard.evaluation.modes import eval_mode

__all__ = ["FAILED_METRIC", "EvalReport", "GuardOptions", "eval_mode", "guarded_evaluate", "last_report"]
