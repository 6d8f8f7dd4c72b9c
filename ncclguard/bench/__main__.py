"""``python -m ncclguard.bench --help``."""

import sys

from ncclguard.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
