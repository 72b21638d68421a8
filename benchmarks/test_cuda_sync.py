"""No host synchronization inside any loss or op on CUDA.

``torch.cuda.set_sync_debug_mode('error')`` turns every synchronizing CUDA call (``.item()``,
``.cpu()``, ``nonzero``, a data-dependent shape, a blocking copy) into an error; each function
runs forward and backward under it. Skipped without CUDA. Not a benchmark: run it without
``--benchmark-only`` (``pytest benchmarks/test_cuda_sync.py``; ``benchmarks/run_cuda.sh`` does).
"""

from __future__ import annotations

import pytest
import torch

from stablelosses.bench.cases import DTYPES, make_inputs, specs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPECS = specs()
CASES = [
    pytest.param(name, case.label, id=f"{name}-{case.label}-cuda")
    for name, spec in SPECS.items()
    for case in spec.cases
    if case.kind == "tiny" or "quick" in case.tiers
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,label", CASES)
def test_no_host_sync(name, label, dtype):
    spec = SPECS[name]
    case = next(c for c in spec.cases if c.label == label)
    tensors, grad_idx = make_inputs(spec, case, DTYPES[dtype], "cuda")
    args = [t.detach().requires_grad_(i in grad_idx) for i, t in enumerate(tensors)]
    wrt = [args[i] for i in grad_idx]
    f = spec.variants["stable"]
    f(*args)  # warm-up: lazy initialization may synchronize once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = f(*args)
        grad_out = None if out.dim() == 0 else torch.ones_like(out)
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()
