"""A script that crashes (for `stablelosses trace` exit codes): KeyError, or sys.exit(N)."""

import sys


def load(key):
    return {}[key]  # CRASH


if __name__ == "__main__":
    if sys.argv[1:2] == ["exit"]:
        sys.exit(int(sys.argv[2]))
    load("missing")
