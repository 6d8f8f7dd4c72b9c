"""The guarded evaluation: an evaluation that fails or stalls on one rank is skipped on every rank
together, and training goes on (``guarded_evaluate``; the frameworks' integrations wrap it).

- :mod:`~ncclguard.evaluation.guard`: the guard itself and its report;
- :mod:`~ncclguard.evaluation.options`: its keywords (``EvalKeywords``), declared once, and their
  validated model (``GuardOptions``, built by ``eval_options``);
- :mod:`~ncclguard.evaluation.side_group`: the side group that keeps the evaluation's collectives
  off the training group;
- :mod:`~ncclguard.evaluation.modes`: ``eval_mode``, which puts a wrapped model and the module it
  wraps in evaluation mode together (DeepSpeed's engine keeps its own flag).
"""

from ncclguard.evaluation.guard import FAILED_METRIC, EvalReport, guarded_evaluate, last_report
from ncclguard.evaluation.modes import eval_mode
from ncclguard.evaluation.options import EvalKeywords, GuardOptions, eval_options

__all__ = [
    "FAILED_METRIC",
    "EvalKeywords",
    "EvalReport",
    "GuardOptions",
    "eval_mode",
    "eval_options",
    "guarded_evaluate",
    "last_report",
]
