"""pytest: ``--doctest-modules`` must not import the kernel modules.

They import triton (optional) and fix triton's interpreter mode when imported; they hold no
doctests. Their tests are ``tests/test_triton.py``.
"""

collect_ignore = ["_kernels.py", "ops.py"]
