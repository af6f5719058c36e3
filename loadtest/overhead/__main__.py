"""``python -m loadtest.overhead``."""

import sys

from loadtest.overhead.cli import main

sys.exit(main())
