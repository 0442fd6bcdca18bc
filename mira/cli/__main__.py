"""`python -m mira.cli`: the same as the `mira` command."""

import sys

from mira.cli import main

sys.exit(main())
