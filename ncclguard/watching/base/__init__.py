"""What every part of the watchdog stands on: its settings, its exchange through the job's store
(heartbeats, statements, incidents, the status index), its metrics, and the hang bound it learns."""
