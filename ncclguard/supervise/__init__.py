"""The supervisor that restarts one rank alone and posts its deaths: ``python -m ncclguard.supervise``
(``ncclguard run --ncclguard-restarts N`` runs every rank under it)."""

from ncclguard.supervise.loop import Supervisor, run_rank

__all__ = ["Supervisor", "run_rank"]
