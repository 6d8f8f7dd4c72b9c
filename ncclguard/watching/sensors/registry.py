"""The sensors the watchdog builds in each world, listed in one place.

A sensor of yours is one object with the :class:`~ncclguard.watching.sensors.sensor.Sensor` protocol
and a factory that builds it from a :class:`~ncclguard.watching.sensors.sensor.SensorSite`; one
:func:`register_sensor` line (before the watchdog starts, or before the next world) adds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ncclguard._log import log
from ncclguard.watching.sensors.sensor import Sensor, SensorSite
from ncclguard.watching.sensors.straggler.watch import from_config

__all__ = ["SensorFactory", "build_sensors", "register_sensor", "registered", "unregister_sensor"]

SensorFactory = Callable[[SensorSite], Sensor]

_lock = threading.Lock()  # a user may register from any thread; the watchdog's thread builds
_factories: dict[str, SensorFactory] = {
    "straggler": lambda site: from_config(site.rank, site.config, site.arrivals),
}


def register_sensor(name: str, factory: SensorFactory) -> None:
    """Adds a sensor: every watchdog builds one with ``factory`` in each world it watches from now on.

    Args:
        name: the sensor's name (its figures' key in the heartbeat's ``readings``).
        factory: builds the sensor for one rank and world.

    Raises:
        ValueError: ``name`` is taken, or is not a short identifier.
    """
    if not name.isidentifier() or len(name) > 40:
        raise ValueError(f"a sensor's name is a Python identifier of at most 40 characters, got {name!r}")
    with _lock:
        if name in _factories:
            raise ValueError(f"a sensor named {name!r} is registered already; unregister_sensor({name!r}) first")
        _factories[name] = factory


def unregister_sensor(name: str) -> None:
    """Removes the sensor ``name`` (from the next world on); no error when it is not registered."""
    with _lock:
        _factories.pop(name, None)


def registered() -> tuple[str, ...]:
    """The names of the sensors registered, in the order they are built."""
    with _lock:
        return tuple(_factories)


def build_sensors(site: SensorSite) -> list[Sensor]:
    """One of each registered sensor for ``site``, in registration order; a factory that fails is
    logged and left out (a sensor must never stop the watchdog)."""
    with _lock:
        factories = list(_factories.items())
    sensors: list[Sensor] = []
    for name, factory in factories:
        try:
            sensors.append(factory(site))
        except Exception:  # noqa: BLE001 - a user's factory may fail: the others and the watchdog go on
            log.exception("watchdog: the sensor %r could not be built; going on without it", name)
    return sensors
