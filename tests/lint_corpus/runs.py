"""Inputs for running corpus snippets before and after ``--fix`` (used by benchmarks/lint_corpus.py).

``RUNS[id](env, which)`` calls the snippet's function (from the namespace ``env`` its code made) on
the input that breaks it (``which == "hazard"``) or on a healthy one, and returns the value and
the leaf tensors whose gradients are checked. ``ACCURACY[id](env, dtype)`` evaluates an
accuracy-only hazard (cancellation, not an inf) on float32 inputs computed in ``dtype``.
Written here; the snippets are not.
"""

from __future__ import annotations

import contextlib
import types

import torch


def _leaf(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def _rmse_module(name: str):
    def run(env, which):
        pred = _leaf(1.0, 2.0, 3.0)
        target = torch.tensor([1.0, 2.0, 3.0]) if which == "hazard" else torch.tensor([0.5, 2.5, 2.0])
        return env[name]()(pred, target), [pred]
    return run


def _rmse_fn(name: str):
    def run(env, which):
        pred = _leaf(1.0, 2.0, 3.0)
        target = torch.tensor([1.0, 2.0, 3.0]) if which == "hazard" else torch.tensor([0.5, 2.5, 2.0])
        return env[name](pred, target), [pred]
    return run


def _softmax_fn(name: str, module: bool = False, masked_row: bool = False):
    def run(env, which):
        if which == "hazard":
            rows = [[0.0, 1.0, 2.0], [float("-inf")] * 3] if masked_row else [[100.0, 0.0, -3.0], [1.0, 2.0, 3.0]]
        else:
            rows = [[0.5, -1.0, 2.0], [1.0, 2.0, 3.0]]
        x = torch.tensor(rows, requires_grad=True)
        f = env[name]() if module else env[name]
        # weights make the gradient depend on the output (a plain sum of a softmax has gradient 0)
        return f(x) * torch.tensor([1.0, 2.0, 3.0]), [x]
    return run


def _entropy_chunk(env, which):
    env["maybe_gather_lm_head_ctx"] = lambda w, b: contextlib.nullcontext()
    h = torch.tensor([[1.0, -1.0], [0.5, 2.0]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], requires_grad=True)
    b = torch.tensor([0.0, float("-inf") if which == "hazard" else -3.0, 0.0])  # a masked class
    lbl = torch.tensor([0, 2])
    _, _, entropy = env["_chunk"](h, w, b, lbl, 1.0, None)
    return entropy, [h, w]


def _entropy_from_logits(env, which):
    x = torch.tensor([[0.0, 1.0, float("-inf") if which == "hazard" else -2.0], [2.0, 0.0, 1.0]],
                     requires_grad=True)
    return env["entropy_from_logits"](x), [x]


def _log1mexp(env, which):
    x = _leaf(-1e-9, -1e-3, -5.0) if which == "hazard" else _leaf(-2.0, -0.3, -5.0)
    return env["log1mexp"](x), [x]


def _orpo_liger(env, which):
    chosen = _leaf(-1e-9, -0.5) if which == "hazard" else _leaf(-0.2, -0.5)
    rejected = _leaf(-2.0, -3.0)
    full_target = torch.zeros(4, 3)
    return env["preference_loss_fn"](chosen, rejected, full_target)[0], [chosen, rejected]


def _orpo_liger_test(env, which):
    chosen = _leaf(-1e-9, -0.5) if which == "hazard" else _leaf(-0.2, -0.5)
    rejected = _leaf(-2.0, -3.0)
    this = types.SimpleNamespace(beta=0.1)
    return env["alignment_loss"](this, chosen, rejected)[0], [chosen, rejected]


def _clip(env, which):
    img = torch.tensor([[1.0, 0.0], [0.0 if which == "hazard" else 0.3, 0.0 if which == "hazard" else 1.0]],
                       requires_grad=True)
    txt = torch.tensor([[1.0, 0.5], [0.2, 1.0]], requires_grad=True)
    return env["CLIPLoss"]()(img, txt), [img, txt]


RUNS = {
    "m04": _entropy_chunk,
    "m06": _entropy_from_logits,
    "m13": _log1mexp,
    "m20": _orpo_liger,
    "m29": _orpo_liger_test,
    "s05": _rmse_module("RMSELoss"),
    "s06": _rmse_module("RMSELoss"),
    "s07": _rmse_module("RMSELoss"),
    "s08": _rmse_module("RMSELoss"),
    "s15": _clip,
    "s16": _softmax_fn("softmax"),
    "s17": _softmax_fn("Softmax", module=True),
    "s18": _softmax_fn("toy_softmax", masked_row=True),
    "s27": _rmse_fn("RMSELoss"),
    "s28": _rmse_module("RMSELoss"),
    "s29": _rmse_fn("rmse_loss"),
}


def _k3(name: str, *extra):
    def run(env, dtype):
        p = torch.tensor([-1.0, -2.0, -0.5]).to(dtype)  # float32 inputs, computed in ``dtype``
        q = (torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
             + torch.tensor([1e-4, -3e-5, 2e-6], dtype=torch.float64)).float().to(dtype)
        return env[name](p, q, *extra)
    return run


ACCURACY = {"m21": _k3("k3_loss_fn"), "m30": _k3("compute_approx_kl", "k3")}
