r"""``stablelosses bench``: stablelosses against the PyTorch built-ins and the naive formulas.

Usage::

    stablelosses bench [--device cpu|cuda] [--compile] [--quick | --full] [--json PATH]
                       [--markdown PATH] [--raw] [--only FN[,FN...]]
                       [--dtype float32[,bfloat16]] [--modes fwd,fwdbwd] [--compile-modes fwdbwd]
                       [--repeats R] [--threads T] [--no-peak] [--no-bytes] [--no-progress]
                       [--no-reexec]

For every function, input shape, dtype and device of the chosen tier it builds the inputs once,
then one callable per *variant* — ``torch`` (the built-in replaced), ``naive`` (a formula from
`stablelosses.naive`), ``kornia`` (when installed), ``stable`` (ours), ``one-pass``
(``torch.neg`` of the input: the memory-bandwidth floor) and with ``--compile``
``<variant>-compiled`` — and measures, in the modes ``fwd`` and ``fwdbwd``:

* time: the median of interleaved rounds (`stablelosses.bench.timing`, on
  ``torch.utils.benchmark.Timer``);
* bytes moved: bytes read and written by the aten operators of one call
  (`stablelosses.bench.traffic`), the device-independent stand-in for GPU speed;
* peak memory of one forward+backward (`stablelosses.bench.memory`);
* kernels launched by a compiled call (`stablelosses.bench.kernels`).

It prints a table of ratios (`stablelosses.bench.report`) and with ``--json`` writes every raw
number (and the command). The design's bounds and speed targets are not installed: in a source
checkout, ``benchmarks/check_targets.py`` reads that JSON and says which are met (each with its
measured value, bytes-moved ratio, aten-op count and compiled kernel count), and
``benchmarks/make_docs.py`` writes the benchmarks page from it.

Tiers: ``--quick`` small shapes and 3 repeats (well under a minute on 2 cores without
``--compile``); the default the shapes the targets are stated for; ``--full`` adds the LLM
vocabulary and segmentation shapes and bfloat16. Unless ``--no-reexec`` is given, the command
re-executes itself with the allocator environment `stablelosses.bench.memory.MALLOC_ENV` when
it is missing, and it uses 2 threads (``--threads``).

The package is tooling, not the library: ``import stablelosses`` does not import it.
"""

from __future__ import annotations

from stablelosses.bench.cli import main

__all__ = ["main"]
