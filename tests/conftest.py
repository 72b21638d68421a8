"""Shared fixtures: devices, dtypes, one tolerance table, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"))]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# One tolerance table: (rtol, atol) for comparing against a float64 reference.
TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tol(dtype: torch.dtype) -> dict:
    rtol, atol = TOL[dtype]
    return {"rtol": rtol, "atol": atol}


def assert_compiled_matches_eager(f, x: torch.Tensor) -> torch.Tensor:
    """``torch.compile(f, fullgraph=True)`` at ``x`` gives eager's value and gradient with
    respect to ``x``; returns that gradient for the test's own checks."""
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out = torch.compile(f, fullgraph=True)(x1)
    ref = f(x2)
    torch.testing.assert_close(out, ref)
    (g,) = torch.autograd.grad(out, x1)
    (g_ref,) = torch.autograd.grad(ref, x2)
    torch.testing.assert_close(g, g_ref)
    return g


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
