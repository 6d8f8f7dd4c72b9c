"""Recording: what each rank's collectives were, where, in which phase."""
