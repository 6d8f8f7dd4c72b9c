"""Incidents: the typed model, the analysis that names culprits apart from victims, the report on disk;
how the watchdog handles one (its desk, cases, merging, the left-behind fence) in `handling/`."""
