"""Import torch without its ``Failed to initialize NumPy`` warning.

torch (2.13) warns once, while it is imported, when numpy is not installed. stablelosses never
converts a tensor to numpy, so on a fresh install (torch and stablelosses, no numpy) the warning
is noise in front of ``python -m stablelosses``. This module imports torch with only that one
warning silenced; ``stablelosses/__init__.py`` imports it first. When torch was imported before
stablelosses, torch has already warned (or not) and this changes nothing.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401
