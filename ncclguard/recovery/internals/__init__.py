"""The recovery engine's internals: nothing here is called by a training script.

Start from the entry points one level up (:mod:`ncclguard.recovery`). What each module holds:

- ``bound``: the step bound, how long a collective inside a recovering step waits for its peers;
- ``commit_protocol``: what the ranks state at a step's commit and the verdict decided from it
  (pure functions);
- ``meeting`` and ``protocol``: the rebuild's meeting in the job's store, and its pure rules;
- ``reaper``: the thread that releases the abandoned process groups off the training thread;
- ``repoint``: a DDP wrapper and a data loader's sharding pointed at a rebuilt world;
- ``restarts``: this process's restart number (``NCCLGUARD_RESTART_COUNT``);
- ``stand_in``: a restarted rank's world of one until it joins the survivors;
- ``step_state``: the buffers and random generators a redone step must find as they were;
- ``fence``: the left-behind fence while an engine runs.
"""
