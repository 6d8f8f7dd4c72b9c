"""What a rank states at a step's commit beside its problems: where the backend's sequence stands on
each of its groups, the groups whose numbers are not compared, its generators' digests, and what
the recovery engine's check saw of its gradient's values.

The commit (:mod:`ncclguard.recovery.commit`) builds its statement from these; the recovery engine
notes the generators before it commits (:func:`note_generators`), so that a heal that hands a
restarted rank its live peer's generators knows whether they can be its own, and the check's
findings (:func:`note_numerics`), so that a non-finite gradient fails the step with this rank named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import TorchCompatError
from ncclguard.recording.flight import recorder
from ncclguard.recovery._commit.statements import (
    MAX_DIGEST_CHARS,
    MAX_GENERATOR_NAME_CHARS,
    MAX_GENERATORS,
    MAX_GROUP_NAME_CHARS,
    MAX_GROUPS,
)
from ncclguard.recovery._numerics.drift import MAX_REPLICA_PARTS, PART_CHARS
from ncclguard.recovery._numerics.findings import NumericsSaid
from ncclguard.world import Slot, current_world

if TYPE_CHECKING:
    from ncclguard.collectives.groups import GroupInfo

__all__ = [
    "generators_noted",
    "note_generators",
    "note_numerics",
    "note_point_to_point",
    "note_replicas",
    "numerics_noted",
    "other_sequences",
    "p2p_groups",
    "replicas_noted",
    "sequence",
]


def sequence(group: dist.ProcessGroup, name: str) -> int | None:
    try:
        return compat.sequence_number(group)
    except (TorchCompatError, RuntimeError) as exc:
        log.debug("should_commit: the backend's sequence number of group %r is unreadable (%s)", name, exc)
        return None


def other_sequences(info: GroupInfo) -> dict[str, int]:
    """The backend's sequence number on every other group of this world that this rank is in."""
    found: dict[str, int] = {}
    for pg, name in sorted(compat.group_names().items(), key=lambda kv: kv[1]):
        if pg is info.group or len(name) > MAX_GROUP_NAME_CHARS or compat.rank_not_in_group(pg):
            continue
        if len(found) == MAX_GROUPS:
            log.debug("should_commit: this rank is in more than %d other groups; the rest are not compared", MAX_GROUPS)
            break
        seq = sequence(pg, name)
        if seq is not None:
            found[name] = seq
    return found


_P2P: Slot[set[str]] = Slot("groups declared point-to-point", lambda world: set[str]())


def note_point_to_point(group: dist.ProcessGroup) -> None:
    """Declares a group of this world whose ranks run point-to-point ops that the flight recorder
    does not see (the snapshots' side group): its sequence numbers differ between healthy ranks,
    and the commit does not compare them.

    Args:
        group: a process group of the current world.
    """
    name = compat.group_names().get(group)
    if name is not None:
        current_world().get(_P2P).add(name)


def p2p_groups() -> list[str]:
    """The groups on which the flight recorder saw point-to-point ops, and those declared so
    (:func:`note_point_to_point`; see CommitStatement.p2p_groups)."""
    seen = {k.removesuffix(":p2p") for k in recorder.last_seq() if k.endswith(":p2p")}
    declared: set[str] = current_world().get(_P2P)
    names = sorted(seen | declared)
    # Past the bounds, say every group ("*"): a comparison left out is safer than a healthy rank named.
    fits = len(names) <= MAX_GROUPS and all(len(n) <= MAX_GROUP_NAME_CHARS for n in names)
    return names if fits else ["*"]


class _Noted:
    """What the engine noted for this thread's next commit (consumed by it): the generators'
    digests and the numerical check's findings."""

    def __init__(self) -> None:
        self.generators: dict[str, str] = {}
        self.numerics: NumericsSaid | None = None
        self.replicas: dict[str, str] = {}


_NOTED: Slot[_Noted] = Slot("generators noted for the next commit", lambda world: _Noted())


def note_generators(digests: dict[str, str]) -> None:
    """States ``digests`` (by generator name) in this rank's next commit statement, once.

    Args:
        digests: a short digest of each random generator as the step found it
            (:func:`~ncclguard.recovery._step.state.generator_digests`).

    Raises:
        ValueError: more than MAX_GENERATORS generators, or a name or digest too long to state.
    """
    if len(digests) > MAX_GENERATORS or any(
        len(k) > MAX_GENERATOR_NAME_CHARS or len(v) > MAX_DIGEST_CHARS for k, v in digests.items()
    ):
        raise ValueError(f"note_generators takes at most {MAX_GENERATORS} short digests, got {sorted(digests)}")
    current_world().get(_NOTED).generators = dict(digests)


def generators_noted() -> dict[str, str]:
    """The digests noted for this commit (emptied: a commit not preceded by a note states none)."""
    noted = current_world().get(_NOTED)
    digests, noted.generators = noted.generators, {}
    return digests


def note_numerics(said: NumericsSaid | None) -> None:
    """States what the numerical check saw of this rank's gradient in its next commit statement, once.

    Args:
        said: the check's statement (None: nothing checked).
    """
    current_world().get(_NOTED).numerics = said


def numerics_noted() -> NumericsSaid | None:
    """The findings noted for this commit (emptied: a commit not preceded by a note states none)."""
    noted = current_world().get(_NOTED)
    said, noted.numerics = noted.numerics, None
    return said


def note_replicas(digests: dict[str, str]) -> None:
    """States the digests of this rank's replica (by part) in its next commit statement, once.

    Args:
        digests: :func:`~ncclguard.recovery._numerics.digest.replica_digests` (empty: none stated).

    Raises:
        ValueError: more than MAX_REPLICA_PARTS parts, or a name or digest too long to state.
    """
    if len(digests) > MAX_REPLICA_PARTS or any(
        len(k) > PART_CHARS or len(v) > MAX_DIGEST_CHARS for k, v in digests.items()
    ):
        raise ValueError(f"note_replicas takes at most {MAX_REPLICA_PARTS} short digests, got {sorted(digests)}")
    current_world().get(_NOTED).replicas = dict(digests)


def replicas_noted() -> dict[str, str]:
    """The replica digests noted for this commit (emptied: a commit not preceded by a note states none)."""
    noted = current_world().get(_NOTED)
    digests, noted.replicas = noted.replicas, {}
    return digests
