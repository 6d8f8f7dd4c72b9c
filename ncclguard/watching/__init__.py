"""The watchdog's thread: started once per process (`watchdog.py`), its loop (`loop.py`), the worlds it
follows (`worlds.py`), what it publishes for `status` (`views.py`); what it stands on is in `base/`, what
it sees in `sensors/`, what it does about an incident in `ladder/` (incidents are handled in
:mod:`ncclguard.watching.desk`)."""
