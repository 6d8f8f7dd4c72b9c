"""Private to the commit (:mod:`ncclguard.recovery.commit`): what the ranks state at a step's commit
and the outcome settled from it, as pure functions."""
