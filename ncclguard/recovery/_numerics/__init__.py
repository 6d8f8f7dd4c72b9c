"""Private to the recovery engine's numerical check (docs/numerics.md): what a rank says of its
gradient's values at the commit (``findings``, pure), the DDP comm hook that checks each bucket
before its all-reduce (``hook``), and what the engine does on a finding (``policy``)."""
