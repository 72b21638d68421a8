"""Forward-mode AD (design: Composable) for the elementwise ops and the regression/detection losses:
``torch.func.jvp``/``jacfwd``/``hessian`` and ``torch.autograd.forward_ad`` equal torch's
(or the naive formula's) where those are finite, and are finite at the hazards."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from test_sigmoid_focal import torchvision_formula
from torch.autograd import gradcheck

import stablelosses.functional as SF

D = torch.float64


def _pos(*shape):
    return torch.rand(*shape, dtype=D) + 0.1


def _randn(*shape):
    return torch.randn(*shape, dtype=D)


# name -> (ours, reference, inputs); the reference is torch's function or the naive formula.
CASES = {
    "safe_sqrt": (SF.safe_sqrt, torch.sqrt, lambda: (_pos(4, 3),)),
    "safe_div": (SF.safe_div, torch.div, lambda: (_randn(4, 3), _pos(3))),
    "xlogy": (SF.xlogy, torch.special.xlogy, lambda: (_randn(4, 3), _pos(3))),
    "log_cosh_loss": (None, None, lambda: (_randn(4, 3) * 3, _randn(4, 3))),
    "rmse_loss": (None, None, lambda: (_randn(4, 3), _randn(4, 3))),
    "sigmoid_focal_loss": (None, None, lambda: (_randn(4, 3) * 3, _pos(4, 3) * 0.8)),
}
PARAMS: list = []
for _name in ["safe_sqrt", "safe_div", "xlogy"]:
    PARAMS.append(pytest.param(_name, {}, id=_name))
for _red in ["none", "mean", "sum"]:
    PARAMS.append(pytest.param("log_cosh_loss", {"reduction": _red}, id=f"log_cosh_loss-{_red}"))
    for _eps in [0.0, 0.1]:
        PARAMS.append(
            pytest.param("rmse_loss", {"reduction": _red, "eps": _eps}, id=f"rmse_loss-{_red}-{_eps}")
        )
    for _gamma in [0.0, 0.5, 2.0]:
        PARAMS.append(pytest.param("sigmoid_focal_loss", {"reduction": _red, "gamma": _gamma},
                                   id=f"sigmoid_focal_loss-{_red}-{_gamma}"))


def _reduce(v, reduction):
    return v.mean() if reduction == "mean" else v.sum() if reduction == "sum" else v


def _fns(name, kw):
    if name == "log_cosh_loss":
        red = kw["reduction"]
        return (lambda x, y: SF.log_cosh_loss(x, y, **kw),
                lambda x, y: _reduce(torch.log(torch.cosh(x - y)), red))
    if name == "rmse_loss":
        red, eps = kw["reduction"], kw["eps"]
        return (lambda x, y: SF.rmse_loss(x, y, **kw),
                lambda x, y: torch.sqrt(F.mse_loss(x, y, reduction=red) + eps))
    if name == "sigmoid_focal_loss":
        return (lambda x, y: SF.sigmoid_focal_loss(x, y, **kw),
                lambda x, y: torchvision_formula(x, y, **kw))
    ours, ref, _ = CASES[name]
    return ours, ref


@pytest.mark.parametrize("name, kw", PARAMS)
def test_gradcheck_forward_ad(name, kw):
    ours, _ = _fns(name, kw)
    inputs = tuple(t.requires_grad_() for t in CASES[name][2]())
    assert gradcheck(ours, inputs, check_forward_ad=True, check_backward_ad=True,
                     check_batched_forward_grad=True, check_batched_grad=True)


@pytest.mark.parametrize("name, kw", PARAMS)
def test_jvp_jacfwd_hessian_match_reference(name, kw):
    ours, ref = _fns(name, kw)
    primals = CASES[name][2]()
    tangents = tuple(torch.randn_like(p) for p in primals)
    out, tan = torch.func.jvp(ours, primals, tangents)
    r_out, r_tan = torch.func.jvp(ref, primals, tangents)
    torch.testing.assert_close(out, r_out)
    torch.testing.assert_close(tan, r_tan)
    argnums = tuple(range(len(primals)))
    jac = torch.func.jacfwd(ours, argnums=argnums)(*primals)
    r_jac = torch.func.jacrev(ref, argnums=argnums)(*primals)
    torch.testing.assert_close(jac, r_jac)
    hess = torch.func.hessian(lambda *a: ours(*a).sum(), argnums=argnums)(*primals)
    r_hess = torch.func.hessian(lambda *a: ref(*a).sum(), argnums=argnums)(*primals)
    torch.testing.assert_close(hess, r_hess)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        d_tan = fwAD.unpack_dual(ours(*duals)).tangent
    torch.testing.assert_close(d_tan, r_tan)


def _jvp(fn, primals, tangents):
    return torch.func.jvp(fn, tuple(primals), tuple(tangents))[1]


def test_jvp_at_the_hazards_is_the_defined_derivative():
    z = torch.zeros(3, dtype=D)
    one = torch.ones(3, dtype=D)
    # sqrt at 0: tangent 0, like the gradient (torch: inf)
    assert torch.isinf(_jvp(torch.sqrt, [z], [one])).all()
    assert torch.equal(_jvp(SF.safe_sqrt, [z], [one]), z)
    # a / 0: both tangents 0 (torch: inf / nan)
    a = torch.tensor([1.0, 0.0, -2.0], dtype=D)
    assert torch.equal(_jvp(SF.safe_div, [a, z], [one, one]), z)
    # xlogy(0, y) for y <= 0: input-tangent 0 (torch's backward gives 0 too); other-tangent 0 at 0/0
    y = torch.tensor([0.0, -1.0, 2.0], dtype=D)
    t_x = _jvp(SF.xlogy, [z, y], [one, torch.zeros_like(y)])
    torch.testing.assert_close(t_x, torch.tensor([0.0, 0.0, 0.6931471805599453], dtype=D))
    assert torch.equal(_jvp(SF.xlogy, [z, y], [torch.zeros_like(z), one]), z)
    # rmse of a zero residual: 0 for every reduction (torch: nan)
    for red in ["none", "mean", "sum"]:
        assert torch.equal(_jvp(lambda p, red=red: SF.rmse_loss(p, z, reduction=red), [z], [one]),
                           torch.zeros(3 if red == "none" else (), dtype=D))
    # log-cosh of a huge residual: tanh(r) = ±1 (the naive formula: nan)
    big = torch.tensor([1e4, -1e4, 0.0], dtype=D)
    assert torch.equal(_jvp(lambda p: SF.log_cosh_loss(p, z, reduction="none"), [big], [one]),
                       torch.tensor([1.0, -1.0, 0.0], dtype=D))


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sigmoid_focal_hessian_finite_at_saturated_logits(gamma, dtype):
    x = torch.tensor([30.0, -30.0, 100.0, -100.0, 200.0, -200.0], dtype=dtype)
    for target in [0.0, 1.0]:
        t = torch.full_like(x, target)
        h = torch.func.hessian(lambda a, b: SF.sigmoid_focal_loss(a, b, gamma=gamma, reduction="sum"),
                               argnums=(0, 1))(x, t)
        for row in h:
            for block in row:
                assert torch.isfinite(block).all()
