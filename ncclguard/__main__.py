import sys

from ncclguard.cli import main

sys.exit(main())
