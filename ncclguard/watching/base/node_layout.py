"""The node tier's pure part: which node a process is on, which nodes a node watches, whether the
tier is on, and what a node's digest holds (docs/scale.md).

With the tier on, a node's ranks publish their heartbeats to a store of the node's own (served by
``ncclguard run``'s launcher, else by the process of ``LOCAL_RANK`` 0:
:mod:`~ncclguard.watching.base.node_agent`), whose agent puts one
digest of them per beat into the job's store and copies the digests of the nodes its ranks watch
back into the node's store. No clock, socket or process here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DIGEST_LIMIT", "Digest", "NodeLayout", "tier_wanted", "watched_nodes"]

# The largest digest, in bytes of JSON: half the largest value torch's TCPStore server takes (8 MiB
# went through, 15 MiB reset the connection: torch 2.13, its libuv server). 8 heartbeats at their
# own bound (256 KiB, about 12% more escaped inside the digest's JSON) fit; an agent whose heartbeats
# weigh more cuts each over its share (node_agent.py).
DIGEST_LIMIT = 4 << 20
MAX_LOCAL = 64  # ranks a node at most (torchrun's nproc_per_node; 8 on a GPU node)


class Digest(BaseModel):
    """One node's heartbeats, as its agent put them into the job's store at one of its beats.

    ``beats`` holds each rank's heartbeat as the rank published it (JSON text, parsed by the reader
    under the heartbeat's own bound, as a heartbeat read from the store is), by its rank in the world.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: int = Field(ge=0)
    beat: int = Field(ge=1)  # the agent's beat: a digest whose number stands still comes from a stopped agent
    generation: int = Field(ge=0)
    beats: dict[int, str] = Field(default_factory=dict, max_length=MAX_LOCAL)


@dataclass(frozen=True)
class NodeLayout:
    """Where this process stands among the job's nodes, as its launcher placed it.

    Attributes:
        node: this node's number (torchrun's ``GROUP_RANK``), 0 to ``nodes - 1``.
        nodes: the job's nodes (``GROUP_WORLD_SIZE``, else ``WORLD_SIZE // LOCAL_WORLD_SIZE``).
        local_rank: this process's rank on its node (``LOCAL_RANK``).
        local_size: the ranks of a node (``LOCAL_WORLD_SIZE``).
    """

    node: int
    nodes: int
    local_rank: int
    local_size: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeLayout | None:
        """The layout torchrun (or ``ncclguard run``) describes, or None when it describes none.

        Args:
            env: the environment to read; default ``os.environ``.

        Returns:
            The layout; None without ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``, or with
            numbers that do not fit together (a node number past the nodes, more than 64 ranks a node).
        """
        env = os.environ if env is None else env
        raw = {k: env.get(k, "") for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}
        if not all(v.isdecimal() for v in raw.values()):
            return None
        node, local_rank, local_size, world = (int(raw[k]) for k in raw)
        given = env.get("GROUP_WORLD_SIZE", "")
        nodes = int(given) if given.isdecimal() else (world // local_size if local_size else 0)
        if not (0 < local_size <= MAX_LOCAL and 0 <= node < nodes and 0 <= local_rank < local_size):
            return None
        return cls(node, nodes, local_rank, local_size)

    @property
    def is_agent(self) -> bool:
        """True for the process that serves the node's store and runs its agent where no launcher
        serves it (``LOCAL_RANK`` 0)."""
        return self.local_rank == 0


def watched_nodes(node: int, nodes: int, watch_peers: int, local_size: int) -> list[int]:
    """The nodes whose digests ``node``'s agent copies in: the next ones in ring order, enough to
    hold the ``watch_peers`` next ranks of each of its ranks when ranks are numbered node by node
    (torchrun's order), one more for a node that holds fewer.

    Args:
        node: this node.
        nodes: the job's nodes.
        watch_peers: the ranks each rank watches (``WatchdogConfig.watch_peers``).
        local_size: ranks a node.

    Returns:
        The node numbers, nearest first, never ``node`` itself.
    """
    n = min(nodes - 1, math.ceil(watch_peers / max(1, local_size)) + 1)
    return [(node + i) % nodes for i in range(1, n + 1)]


def tier_wanted(setting: str, world_size: int, min_ranks: int, layout: NodeLayout | None) -> bool:
    """Whether the node tier runs in a world of ``world_size``.

    Args:
        setting: ``WatchdogConfig.node_tier``: ``"on"``, ``"off"`` or ``"auto"`` (on from
            ``min_ranks`` ranks).
        world_size: the ranks of the world.
        min_ranks: ``WatchdogConfig.node_tier_min_ranks``.
        layout: where this process stands (None: the launcher said nothing, and there is no tier).

    Returns:
        True when the tier runs: a layout with more than one rank a node and more than one node.
    """
    if setting == "off" or layout is None or layout.local_size < 2 or layout.nodes < 2:
        return False
    return setting == "on" or world_size >= min_ranks
