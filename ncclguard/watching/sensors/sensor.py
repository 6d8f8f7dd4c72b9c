"""The sensor interface: what the watchdog asks of a sensor, and what a sensor is given when built.

A sensor is one object per rank and world. The watchdog's thread calls :meth:`Sensor.tick` at each of
its ticks, :meth:`Sensor.stamp` on each heartbeat it publishes and on this rank's statement for an
incident, and :meth:`Sensor.check` once a beat with the watched peers' last heartbeats; a
:class:`~ncclguard.watching.sensors.detect.Detection` that ``check`` returns is opened as an incident.
A sensor's figures travel in the heartbeat under its name (``Heartbeat.readings[name]``), so that a
peer's sensor reads them; its findings are reports (kind ``sensor``, never a rung past ``report``)
unless the sensor is one of the built-in kinds. Sensors are listed in one place,
:mod:`ncclguard.watching.sensors.registry`; docs/architecture.md ("Where to add things") says how to
add one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ncclguard.incidents.beats import Heartbeat
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.straggler.watch import ArrivalSource

__all__ = ["Sensor", "SensorSite"]

H = TypeVar("H", bound=Heartbeat)


@dataclass(frozen=True)
class SensorSite:
    """What a sensor is built from: where it runs and what it may read.

    Attributes:
        rank: this rank in the world watched.
        world_size: that world's size.
        config: the watchdog's settings.
        arrivals: the world group's backend, for when this rank reached its recent collectives.
    """

    rank: int
    world_size: int
    config: WatchdogConfig
    arrivals: ArrivalSource


class Sensor(Protocol):
    """One sensor of the watchdog (see the module doc). Every call comes from the watchdog's thread;
    none may block or issue a collective, and an exception is logged and the tick goes on."""

    name: str

    def tick(self) -> None:
        """At each watchdog tick: measure what must be measured often (cheap)."""

    def stamp(self, beat: H) -> H:
        """``beat`` (this rank's heartbeat or statement) with this sensor's figures."""
        ...

    def check(self, peers: Mapping[int, Heartbeat]) -> Detection | None:
        """Once a beat, with the watched peers' last heartbeats: a finding to open as an incident, or None."""
        ...
