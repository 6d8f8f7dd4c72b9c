"""A rank that says it runs, then sleeps in a loop until it is ended (tests/env/test_launcher_death_multirank.py).

argv: OUT. It writes ``OUT/running-<RANK>`` holding its pid, then sleeps; it never exits by itself.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ.get("RANK", "?")
(out / f"running-{rank}.tmp").write_text(str(os.getpid()))
(out / f"running-{rank}.tmp").rename(out / f"running-{rank}")
while True:
    time.sleep(0.2)
