"""The base of the typed incident model: the model class, the format version, the enums, a flight record.

See :mod:`ncclguard.incidents.model` for the model as a whole and its file format.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "FORMAT_VERSION",
    "INCIDENT_KIND",
    "RANK_DUMP_KIND",
    "CulpritReason",
    "FindingKind",
    "IncidentKind",
    "Model",
    "OpRecord",
]

FORMAT_VERSION: Literal[2] = 2
INCIDENT_KIND: Literal["ncclguard-incident"] = "ncclguard-incident"
RANK_DUMP_KIND: Literal["ncclguard-rank-dump"] = "ncclguard-rank-dump"


class IncidentKind(str, Enum):
    """Why an incident was raised."""

    HANG = "hang"  # an op of the raising rank stayed in flight past hang_timeout_s
    BACKEND_DESYNC = "desync"  # a group's ranks stand at different backend sequence numbers, none moving
    PEERS_LOST = "lost"  # watched peers' heartbeats stopped changing for peer_timeout_s
    STORE_GONE = "store"  # the rendezvous store stopped answering (handled on each rank alone)
    BACKEND_STUCK = "stuck"  # a group's ranks stand at one backend sequence number, its op open past the timeout
    STRAGGLER = "straggler"  # a rank slower than its peers window after window (a report, never escalated)
    SENSOR = "sensor"  # a registered sensor's finding (watching/sensors/sensor.py; a report, never escalated)
    NUMERICS = "numerics"  # the recovery engine's commit named a NaN, an Inf or a drifted replica (a report)


class FindingKind(str, Enum):
    """What the analysis found in a group, or about the ranks."""

    DESYNC = "desync"  # some members wait in an op, others are elsewhere
    STUCK = "stuck"  # every member waits in the same op: the transport, not a desync
    MISMATCH = "mismatch"  # members wait at the same number in different ops, sizes or dtypes
    P2P = "p2p"  # a send/recv whose peer is not in the matching op
    RANKS_LOST = "lost"  # ranks whose heartbeat stopped, outside any desync
    SILENT = "silent"  # ranks that gave no statement (their watchdog thread did not run)
    STORE = "store"  # the store went away; a text only


class CulpritReason(str, Enum):
    """Why a rank is named a culprit."""

    BEHIND = "behind"  # a member that had not issued the op the others wait in
    MISMATCH = "mismatch"  # called a different op at the same number than the majority
    P2P = "p2p"  # has not posted the send/recv its peer waits for
    STOPPED_BEATING = "lost"  # its heartbeat stopped: died, or frozen holding the GIL


class Model(BaseModel):
    """The base of every model here."""

    # Unknown fields are dropped, not refused: a file or a peer from a newer release still reads.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        """The model as plain JSON data, with the on-disk field names."""
        return self.model_dump(mode="json", by_alias=True)


class OpRecord(Model):
    """One flight record (see :class:`ncclguard.recording.flight.FlightRecord`) as plain data."""

    seq: int
    op: str
    group: str
    numel: int = 0
    dtype: str = ""
    start: float
    state: str = "started"
    end: float | None = None
    phase: str = ""
    site: str = ""
    error: str | None = None
    async_op: bool = False
    peer: int | None = None
    thread: int = 0
    # A chunked call's progress: chunks completed of ``chunks``, and bytes reduced (0: not chunked).
    chunks_done: int = 0
    chunks: int = 0
    bytes_done: int = 0
