"""Incidents: the typed model, the analysis that names culprits apart from victims, the report on disk."""
