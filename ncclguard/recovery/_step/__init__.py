"""Private to the step engine (:mod:`ncclguard.recovery.engine`): the step bound, the state a redone
step must find as it was, the learned step timing, and the left-behind fence while the engine runs."""
