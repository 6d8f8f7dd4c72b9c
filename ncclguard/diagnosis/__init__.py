"""Hang diagnosis: the flight recorder, phases, ``instrument()``, the SIGALRM guard, and the
watchdog that turns heartbeats into incidents naming the rank that stalled."""
