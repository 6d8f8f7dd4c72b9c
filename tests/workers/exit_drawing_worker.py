"""Process side of tests/watching/test_watchdog.py's exit test: a process that ends while its
watchdog's desk is still drawing an incident's ``timeline.png``. Usage:
exit_drawing_worker.py {on,off} INCIDENT_DIR.

A world of one with a real watchdog (every default but a short heartbeat and hang timeout, and the
``report`` rung alone): a flight record left in flight past the hang timeout is an incident, merged and
written. The script ends the moment the report is settled and its drawing begun, without stopping the watchdog, as a job's
last line does. The drawing is made to take 2 s more (a slow, loaded machine), so that it is still under
way when the script ends, in both modes. ``off`` turns the exit wait off (``finish_drawings`` waits
0 s); ``on`` is the library. Its last atexit handler (registered first, so it runs last) prints how many
drawings are still under way when finalization begins: 1 with ``off``, 0 with ``on``.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from pathlib import Path

import ncclguard.incidents.pictures as pictures
from ncclguard.recording.flight import recorder
from ncclguard.watching.watchdog import Watchdog


def under_way_at_finalization() -> None:
    print(f"drawings under way at finalization: {len(pictures._drawings.under_way)}", flush=True)


def slow(plot):  # type: ignore[no-untyped-def]
    def plot_slowly(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return plot(*args, **kwargs)

    return plot_slowly


def main() -> None:
    atexit.register(under_way_at_finalization)  # before the library's hooks register: runs after them
    if sys.argv[1] == "off":
        pictures._drawings.wait_s = 0.0
    pictures.plot_timeline = slow(pictures.plot_timeline)
    wd = Watchdog(heartbeat_s=0.1, hang_timeout_s=0.3, incident_dir=Path(sys.argv[2]), actions=["report"])
    recorder.start("all_reduce(SUM)", "exit-test", 4, "float32", site="/job/exit.py:1")
    wd.start()
    (incident,) = wd.wait_for_incident(30, merged=True, settled=True)  # hang guard: it comes after ~0.4 s
    # The report is written just before its drawing starts: wait for the drawing (hang guard 30 s).
    deadline = time.monotonic() + 30
    while not any(t.name == "ncclguard-watchdog-plot" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"incident {incident['id']} settled", flush=True)


if __name__ == "__main__":
    main()
