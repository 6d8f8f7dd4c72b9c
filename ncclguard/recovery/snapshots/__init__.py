"""In-memory snapshots of each rank's own (sharded) state, replicated on a buddy rank of another
host, and the restore that brings a restarted rank back from them: no disk on any path.

``state`` (what a rank's state is, per framework), ``packing`` (a snapshot's manifest and bytes),
``placement`` (who holds whose replica), ``exchange`` (moving snapshots), ``keeper`` (taking and
keeping them), ``restore`` (going back to one). docs/recovery.md, "Sharded state".
"""
