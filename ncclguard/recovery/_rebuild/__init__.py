"""Private to the rebuild (:mod:`ncclguard.recovery.rebuild`, :mod:`ncclguard.recovery.rejoin`): the meeting
and its pure rules (``meeting``), the reaper of abandoned groups, a restarted rank's stand-in world and restart number,
and DDP wrappers and samplers re-pointed at the new world."""
