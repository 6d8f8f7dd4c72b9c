"""The adapter toolkit: what a framework adapter (``ncclguard.integrations``, or one of yours) needs
from the recovery engine's insides, in one public place.

The engine's private modules (``recovery/_rebuild``, ``recovery/_step``, ``_torch_compat``, ``_log``)
may change shape from one release to the next; these names are the contract adapters hold to, and
``tests/house/test_import_contract.py`` checks that ``integrations/`` imports nothing private.

- the library's logger, tagged with the rank: :data:`log`;
- the world: :func:`default_group`, :func:`restart_count` (this process's restart number),
  :func:`stand_in_active` (this restarted process runs on its one-rank stand-in world until it joins),
  :func:`awaiting_join` (the engine joins this restarted process to the survivors at its join point);
- re-pointing what a framework built on the old world: :func:`repoint_ddp`, :func:`rewrapped_ddp`,
  :func:`repoint_sampler`, :func:`unwrapped`;
- DDP's gradient buckets kept across a re-wrap (bit-equal redo and heal): :func:`kept_layout`,
  :func:`layout_source`, :func:`share_layout`, :func:`wrap_in_layout`;
- a step's buffers and random generators, and a scheduler put back with its learning rates:
  :class:`StepState`, :func:`generators_to_send`, :func:`restore_sent_generators`, :func:`load_scheduler`;
- the state codec (tensors beside tagged JSON, never a pickle): :func:`to_json`, :func:`from_json`;
- the micro-batch window of a step under gradient accumulation, recorded for a redo: :class:`Micro`,
  :func:`check_window`, :func:`replay_window` (:mod:`ncclguard.recovery.micro_window`).
"""

from __future__ import annotations

import torch.distributed as dist

from ncclguard import _torch_compat
from ncclguard._log import log
from ncclguard.recovery._rebuild import stand_in
from ncclguard.recovery._rebuild.repoint import repoint_ddp, repoint_sampler, rewrapped_ddp, unwrapped
from ncclguard.recovery._rebuild.restarts import restart_count
from ncclguard.recovery._step.state import (
    Layout,
    StepState,
    generators_to_send,
    kept_layout,
    layout_source,
    load_scheduler,
    restore_sent_generators,
    share_layout,
    wrap_in_layout,
)
from ncclguard.recovery.micro_window import Micro, check_window, replay_window
from ncclguard.recovery.state_json import from_json, to_json

__all__ = [
    "Layout",
    "Micro",
    "StepState",
    "awaiting_join",
    "check_window",
    "default_group",
    "from_json",
    "generators_to_send",
    "kept_layout",
    "layout_source",
    "load_scheduler",
    "log",
    "replay_window",
    "repoint_ddp",
    "repoint_sampler",
    "restart_count",
    "restore_sent_generators",
    "rewrapped_ddp",
    "share_layout",
    "stand_in_active",
    "to_json",
    "unwrapped",
    "wrap_in_layout",
]


def default_group() -> dist.ProcessGroup:
    """The default (world) process group of the world in force now."""
    return _torch_compat.default_group()


def stand_in_active() -> bool:
    """True while this restarted process runs on its one-rank stand-in world: the user's code built
    its framework there, and the engine joins it to the survivors' world at its first step."""
    return stand_in.active()


def awaiting_join(heal: bool) -> bool:
    """True in a process restarted after its rank died that the recovery engine joins to the
    survivors' world at its adapter's join point (``Recovery.join_if_restarted``): ``heal`` is on,
    the restart number is above 0, and the process has no world of its own yet (no process group,
    or its one-rank stand-in). Until then what the framework builds is built again after the join.

    Args:
        heal: the engine's ``heal`` option.

    Raises:
        ValueError: ``NCCLGUARD_RESTART_COUNT`` is set but is no count.
    """
    return stand_in.awaiting_join(heal)
