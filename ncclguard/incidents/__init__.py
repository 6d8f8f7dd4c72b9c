"""Incidents: the typed model, the analysis that names culprits apart from victims, the report on disk.
How the watchdog handles one (its desk, cases, merging, the left-behind fence) is the watchdog's:
:mod:`ncclguard.watching.desk`."""
