"""``python -m stablelosses.bench``: the same as ``stablelosses bench``."""

import sys

from stablelosses.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
