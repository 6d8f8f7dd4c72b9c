"""The ladder of actions the watchdog takes on an incident, from a report to a dump, an abort and
an exit; each rung configured in the watchdog's settings."""
