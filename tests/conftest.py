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

# The lint corpus's cached snippets (git-ignored, fetched by benchmarks/lint_corpus.py) are user
# code for the linter to read, not modules for pytest's --doctest-modules to import.
collect_ignore_glob = ["lint_corpus/*"]

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


def grad_of(fn, *inputs, weight=None):
    """Gradient of ``sum(weight * fn(*inputs))`` w.r.t. every input (weights fixed, random)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    w = torch.ones_like(out) if weight is None else weight
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def value_and_grad(fn, x, *, seed_shape_like=None):
    """``fn(x)`` and the gradient of ``Σ w · fn(x)`` in ``x``, ``w`` a fixed ramp from -1 to 1."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    return out.detach(), g


def ref_index_loss(x, t, w, gamma, eps, ignore_index, reduction):
    """float64 reference written with torch ops: mean = Σ w_t ℓ / Σ w_t."""
    lsm = torch.log_softmax(x, 1)
    keep = t != ignore_index
    ts = torch.where(keep, t, 0)
    lt = lsm.gather(1, ts[:, None])[:, 0]
    wt = w[ts] * keep
    rest = torch.softmax(x, 1).scatter(1, ts[:, None], 0.0).sum(1)  # 1 - p_t from the other classes
    val = rest**gamma * -lt
    loss = (1 - eps) * wt * val - keep * (eps / x.shape[1]) * (lsm * w).sum(1)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / wt.sum()
