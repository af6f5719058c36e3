"""``python -m loadtest.faults``."""

import sys

from loadtest.faults.cli import main

sys.exit(main())
