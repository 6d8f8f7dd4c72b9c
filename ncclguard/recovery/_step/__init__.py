"""Private to the step engine (:mod:`ncclguard.recovery.engine`): what watches a step while it runs
(``guards``: the step bound, the learned step timing, the left-behind fence, the loop check) and what
a step run again must find as it was (``state``: the step's state, DDP's gradient buckets)."""
