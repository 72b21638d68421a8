"""``python -m stablelosses``: see `stablelosses.cli`."""

import sys

from stablelosses.cli import main

if __name__ == "__main__":
    sys.exit(main())
