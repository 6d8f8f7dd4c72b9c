"""``python -m ncclguard.bench --help``."""

import sys

from ncclguard.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
