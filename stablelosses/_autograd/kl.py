"""Pointwise KL divergence term whose zero-probability targets give 0 with gradient 0."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stablelosses._autograd._base import applier
from stablelosses._utils import sum_to


def _neg_product(a: Tensor, b: Tensor) -> Tensor:
    """``0 - a·b`` in one pass (``addcmul`` on a zero scalar): ``+0``, not ``-0``, where a
    factor is 0."""
    return torch.addcmul(a.new_zeros(()), a, b, value=-1)


class _KLDiv(torch.autograd.Function):
    """Elementwise ``target · (log target - input)`` (``exp(target) · (target - input)`` if
    ``log_target``), 0 where the target probability is 0."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: Tensor, target: Tensor, log_target: bool) -> Tensor:
        # A term with zero target probability is 0, also at input = ±inf (where the textbook
        # 0·inf is NaN), and NaN at a NaN input; the fix is made in place on our own result.
        if log_target:
            # e^-inf · (-inf - x) is NaN at every zero-probability term
            zero = target == -math.inf
            naive = torch.exp(target) * (target - input)
            return naive.masked_fill_(zero & ~torch.isnan(input), 0.0)
        # xlogy(0, 0) - 0·x is already 0 at every finite x (and NaN at a NaN one)
        naive = torch.addcmul(torch.xlogy(target, target), target, input, value=-1)
        return naive.masked_fill_((target == 0) & torch.isinf(input), 0.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, target, log_target = inputs
        ctx.save_for_backward(input, target)
        ctx.save_for_forward(input, target)
        ctx.log_target = log_target

    @staticmethod
    def backward(ctx, grad_output):
        input, target = ctx.saved_tensors
        grad_input = grad_target = None
        if ctx.log_target:
            p = torch.exp(target)  # exactly 0 at target = -inf
            if ctx.needs_input_grad[0]:
                # 0 - p·g in one op: +0 (not -0) at zero-probability terms.
                grad_input = sum_to(_neg_product(p, grad_output), input.shape)
            if ctx.needs_input_grad[1]:
                # d/dt e^t (t - x) = e^t (t - x + 1); 0 at t = -inf (double where).
                zero = target == -math.inf
                t_safe = torch.where(zero, 0.0, target)
                x_safe = torch.where(zero, 0.0, input)
                g = torch.where(zero, 0.0, p * (t_safe - x_safe + 1))
                grad_target = sum_to(g * grad_output, target.shape)
        else:
            if ctx.needs_input_grad[0]:
                # 0 - t·g in one op: +0 (not -0) at zero-probability terms.
                grad_input = sum_to(_neg_product(target, grad_output), input.shape)
            if ctx.needs_input_grad[1]:
                # d/dt (t log t - t x) = log t + 1 - x; 0 at t = 0 (double where).
                zero = target == 0
                t_safe = torch.where(zero, 1.0, target)
                x_safe = torch.where(zero, 0.0, input)
                g = torch.where(zero, 0.0, torch.log(t_safe) + 1 - x_safe)
                grad_target = sum_to(g * grad_output, target.shape)
        return grad_input, grad_target, None

    @staticmethod
    def jvp(ctx, input_t, target_t, _log_target_t):
        # the same derivatives as backward, times the tangents; 0 at zero-probability terms
        input, target = ctx.saved_tensors
        out = None
        if ctx.log_target:
            zero = target == -math.inf
            p = torch.exp(target)
            if input_t is not None:
                out = torch.where(zero, 0.0, -p * input_t)
            if target_t is not None:
                t_safe = torch.where(zero, 0.0, target)
                x_safe = torch.where(zero, 0.0, input)
                d = torch.where(zero, 0.0, p * (t_safe - x_safe + 1) * target_t)
                out = d if out is None else out + d
        else:
            zero = target == 0
            if input_t is not None:
                out = torch.where(zero, 0.0, -target * input_t)
            if target_t is not None:
                t_safe = torch.where(zero, 1.0, target)
                x_safe = torch.where(zero, 0.0, input)
                d = torch.where(zero, 0.0, (torch.log(t_safe) + 1 - x_safe) * target_t)
                out = d if out is None else out + d
        return out


_kl_div = applier(_KLDiv)
