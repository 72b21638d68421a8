"""``python -m stablelosses.lint ARGS``: the same as ``stablelosses lint ARGS``."""

import sys

from stablelosses.lint import main

sys.exit(main())
