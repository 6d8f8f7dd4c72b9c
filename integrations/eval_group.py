"""The evaluation's side group, now :mod:`ncclguard.evaluation.side_group`; kept so old imports work."""

from ncclguard.evaluation.side_group import TIMEOUT_REFRESH_S, EvalGroup, deadline_timeout, routed_default_group

__all__ = ["TIMEOUT_REFRESH_S", "EvalGroup", "routed_default_group", "deadline_timeout"]
