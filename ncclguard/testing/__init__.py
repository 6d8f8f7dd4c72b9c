"""For users' own multi-rank tests: a launcher that survives a dying rank, and a fault vocabulary."""
