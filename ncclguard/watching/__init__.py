"""Watching: the watchdog thread, its detectors, its store protocol, the incident desk and the action ladder."""
