"""Root pytest configuration: what ``--doctest-modules`` must not import.

The kernel modules import triton (an optional dependency) and fix the interpreter mode when
they are imported, so the doctest collection never imports them; they hold no doctests. Their
tests are ``tests/test_triton.py``.
"""

collect_ignore = ["stablelosses/_triton/_kernels.py", "stablelosses/_triton/ops.py"]
