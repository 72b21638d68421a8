"""The nn.Module classes: config as attributes, repr, buffers, and equality with the functions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stablelosses as sl
import stablelosses.functional as SF


def _inputs(kind: str):
    torch.manual_seed(0)
    if kind == "regression":
        return torch.randn(6, 3, requires_grad=True), torch.randn(6, 3)
    if kind == "classes":
        return torch.randn(6, 5, requires_grad=True), torch.tensor([0, 4, 2, -100, 1, 3])
    if kind == "binary":
        return torch.randn(6, 3, requires_grad=True), (torch.rand(6, 3) > 0.5).float()
    if kind == "kl":
        return torch.log_softmax(torch.randn(6, 5), -1).requires_grad_(), torch.softmax(torch.randn(6, 5), -1)
    raise AssertionError(kind)


CASES = [
    ("regression", sl.RMSELoss(reduction="sum", eps=1e-3), lambda x, y: SF.rmse_loss(x, y, reduction="sum", eps=1e-3)),
    ("regression", sl.LogCoshLoss(), lambda x, y: SF.log_cosh_loss(x, y)),
    ("classes", sl.CrossEntropyLoss(weight=torch.rand(5), label_smoothing=0.1),
     None),  # filled in below: needs the module's weight
    ("classes", sl.FocalLoss(gamma=1.5, reduction="none"), lambda x, y: SF.focal_loss(x, y, gamma=1.5, reduction="none")),
    ("binary", sl.SigmoidFocalLoss(alpha=0.5, gamma=1.0), lambda x, y: SF.sigmoid_focal_loss(x, y, 0.5, 1.0, "mean")),
    ("kl", sl.KLDivLoss(reduction="batchmean"), lambda x, y: SF.kl_div(x, y, reduction="batchmean")),
]


@pytest.mark.parametrize("kind, module, fn", CASES, ids=[type(c[1]).__name__ for c in CASES])
def test_module_equals_function(kind, module, fn):
    if fn is None:
        fn = lambda x, y: SF.cross_entropy(x, y, weight=module.weight, label_smoothing=0.1)  # noqa: E731
    x, y = _inputs(kind)
    out_m = module(x, y)
    (g_m,) = torch.autograd.grad(out_m.sum(), x)
    out_f = fn(x, y)
    (g_f,) = torch.autograd.grad(out_f.sum(), x)
    assert torch.equal(out_m, out_f)
    assert torch.equal(g_m, g_f)


def test_modules_match_torch_modules():
    x, y = _inputs("classes")
    y = y.clamp(min=0)  # ignore_index is 2 here, so -100 would be out of range (as in torch)
    w = torch.rand(5)
    torch.testing.assert_close(
        sl.CrossEntropyLoss(weight=w, ignore_index=2, label_smoothing=0.2)(x, y),
        nn.CrossEntropyLoss(weight=w, ignore_index=2, label_smoothing=0.2)(x, y),
    )
    lp, q = _inputs("kl")
    for red in ["none", "sum", "batchmean", "mean"]:
        torch.testing.assert_close(sl.KLDivLoss(reduction=red)(lp, q), nn.KLDivLoss(reduction=red)(lp, q))
    xr, yr = _inputs("regression")
    torch.testing.assert_close(sl.RMSELoss()(xr, yr), torch.sqrt(nn.MSELoss()(xr, yr)))


def test_weight_is_a_buffer_and_config_attributes():
    w = torch.rand(5)
    ce = sl.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.05)
    assert "weight" in dict(ce.named_buffers())
    assert torch.equal(ce.state_dict()["weight"], w)
    assert ce.ignore_index == 3 and ce.reduction == "mean" and ce.label_smoothing == 0.05
    fl = sl.FocalLoss(gamma=0.5, weight=w)
    assert fl.gamma == 0.5 and torch.equal(fl.weight, w)
    assert sl.FocalLoss().weight is None
    sfl = sl.SigmoidFocalLoss()
    assert (sfl.alpha, sfl.gamma, sfl.reduction) == (0.25, 2.0, "mean")
    assert sl.RMSELoss().eps == 0.0
    assert sl.KLDivLoss(log_target=True).log_target is True
    assert sl.FocalLoss(weight=w).to(torch.float64).weight.dtype == torch.float64


def test_modules_are_torch_loss_modules_with_torchs_state_dict():
    from torch.nn.modules.loss import _Loss, _WeightedLoss

    w = torch.rand(5)
    pairs = [
        (sl.CrossEntropyLoss(weight=w), nn.CrossEntropyLoss(weight=w), True),
        (sl.CrossEntropyLoss(), nn.CrossEntropyLoss(), True),
        (sl.FocalLoss(weight=w), nn.NLLLoss(weight=w), True),
        (sl.FocalLoss(), nn.NLLLoss(), True),
        (sl.KLDivLoss(reduction="sum"), nn.KLDivLoss(reduction="sum"), False),
        (sl.RMSELoss(reduction="none"), nn.MSELoss(reduction="none"), False),
        (sl.LogCoshLoss(), nn.MSELoss(), False),
        (sl.SigmoidFocalLoss(), nn.BCEWithLogitsLoss(), False),
        (sl.DiceLoss(), nn.L1Loss(), False),
        (sl.InfoNCELoss(), nn.L1Loss(), False),
    ]
    for ours, theirs, weighted in pairs:
        name = type(ours).__name__
        assert isinstance(ours, _Loss), name
        assert isinstance(ours, _WeightedLoss) == weighted == isinstance(theirs, _WeightedLoss), name
        assert ours.reduction == theirs.reduction, name
        assert list(ours.state_dict()) == list(theirs.state_dict()), name
        assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()], name
        assert list(ours.parameters()) == [], name
    # a torch module's state loads into ours and back
    ours, theirs = sl.CrossEntropyLoss(weight=torch.zeros(5)), nn.CrossEntropyLoss(weight=w)
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours.weight, w)
    nn.CrossEntropyLoss(weight=torch.zeros(5)).load_state_dict(ours.state_dict())
    assert repr(sl.CrossEntropyLoss(weight=w)) == "CrossEntropyLoss(ignore_index=-100, reduction='mean', label_smoothing=0.0)"


def test_reprs_show_config():
    assert repr(sl.RMSELoss(reduction="sum", eps=0.5)) == "RMSELoss(reduction='sum', eps=0.5)"
    assert "label_smoothing=0.1" in repr(sl.CrossEntropyLoss(label_smoothing=0.1))
    assert "gamma=0.5" in repr(sl.FocalLoss(gamma=0.5))
    assert repr(sl.SigmoidFocalLoss()) == "SigmoidFocalLoss(alpha=0.25, gamma=2.0, reduction='mean')"
    assert repr(sl.KLDivLoss()) == "KLDivLoss(reduction='mean', log_target=False)"
    assert repr(sl.LogCoshLoss()) == "LogCoshLoss(reduction='mean')"


@pytest.mark.parametrize(
    "cls, kwargs",
    [(sl.RMSELoss, {}), (sl.CrossEntropyLoss, {}), (sl.FocalLoss, {}), (sl.SigmoidFocalLoss, {}),
     (sl.LogCoshLoss, {}), (sl.KLDivLoss, {})],
)
def test_bad_reduction_raises_naming_the_class(cls, kwargs):
    with pytest.raises(ValueError, match=f"{cls.__name__}: (Invalid reduction: )?reduction must be"):
        cls(reduction="avg", **kwargs)


def test_legacy_size_average_and_reduce_map_like_torch():
    assert sl.CrossEntropyLoss(size_average=False).reduction == nn.CrossEntropyLoss(size_average=False).reduction
    assert sl.CrossEntropyLoss(reduce=False).reduction == nn.CrossEntropyLoss(reduce=False).reduction
    assert sl.KLDivLoss(size_average=True, reduce=True).reduction == nn.KLDivLoss(size_average=True, reduce=True).reduction


@pytest.mark.parametrize("make, match", [
    (lambda: sl.FocalLoss(gamma=-0.5), "FocalLoss: gamma must be >= 0"),
    (lambda: sl.SigmoidFocalLoss(gamma=float("nan")), "SigmoidFocalLoss: gamma must be >= 0"),
    (lambda: sl.RMSELoss(eps=-1e-3), "RMSELoss: eps must be >= 0"),
])
def test_constructor_checks_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("make, error, match", [
    (lambda: sl.FocalLoss(gamma=INF), ValueError, "FocalLoss: gamma must be finite and >= 0, got inf"),
    (lambda: sl.LinearFocalLoss(4, 5, gamma=INF), ValueError, "LinearFocalLoss: gamma must be finite"),
    (lambda: sl.SigmoidFocalLoss(alpha=1.5), ValueError, r"SigmoidFocalLoss: alpha must be in \[0, 1\]"),
    (lambda: sl.DiceLoss(smooth=INF), ValueError, "DiceLoss: smooth must be finite and >= 0, got inf"),
    (lambda: sl.DiceLoss(smooth=NAN), ValueError, "DiceLoss: smooth must be >= 0, got nan"),
    (lambda: sl.KLDivLoss(log_target="False"), TypeError, "KLDivLoss: log_target must be a bool, got str"),
    # torch's module checks label_smoothing in forward (its ModuleInfo error input), and so do we
    (lambda: sl.CrossEntropyLoss(label_smoothing=1.5)(torch.zeros(1, 2), torch.tensor([0])), RuntimeError,
     "cross_entropy: label_smoothing must be between 0.0 and 1.0"),
    (lambda: sl.LinearCrossEntropyLoss(4, 5, label_smoothing=-0.1), RuntimeError,
     "LinearCrossEntropyLoss: label_smoothing must be between"),
    (lambda: sl.LinearCrossEntropyLoss(4, 5, z_loss=INF), ValueError, "LinearCrossEntropyLoss: z_loss must be finite"),
    (lambda: sl.LinearFocalLoss(4, 5, softcap=0.0), ValueError, "LinearFocalLoss: softcap must be None or a finite"),
    (lambda: sl.LinearFocalLoss(4, 5, chunk_size=0), ValueError, "LinearFocalLoss: chunk_size must be >= 1"),
    (lambda: sl.LinearCrossEntropyLoss(4, 5, z_loss=NAN, chunk_size=0), ValueError,
     "LinearCrossEntropyLoss: z_loss must be >= 0, got nan"),
    (lambda: sl.LinearCrossEntropyLoss(4, 5, chunk_size=0), ValueError, "LinearCrossEntropyLoss: chunk_size must be >= 1"),
    (lambda: sl.LinearCrossEntropyLoss(4, 5, ignore_index=1.0), TypeError, "LinearCrossEntropyLoss: ignore_index"),
    (lambda: sl.InfoNCELoss(temperature=INF), ValueError, "InfoNCELoss: temperature must be a finite float > 0"),
    (lambda: sl.InfoNCELoss(temperature="0.1"), TypeError, "InfoNCELoss: temperature must be a float > 0"),
])
def test_constructor_checks_arguments_with_the_functions_messages(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _export_cases():
    def reg(n):
        return torch.randn(n, 3), torch.randn(n, 3)

    def binary(n):
        return torch.randn(n, 3), torch.rand(n, 3)

    def classes(n):
        return torch.randn(n, 5), torch.randint(0, 5, (n,))

    def kl(n):
        return torch.log_softmax(torch.randn(n, 5), -1), torch.softmax(torch.randn(n, 5), -1)

    return [
        pytest.param(sl.RMSELoss(), reg, id="RMSELoss"),
        pytest.param(sl.RMSELoss(reduction="none", eps=0.1), reg, id="RMSELoss-none-eps"),
        pytest.param(sl.LogCoshLoss(reduction="sum"), reg, id="LogCoshLoss"),
        pytest.param(sl.SigmoidFocalLoss(gamma=0.5), binary, id="SigmoidFocalLoss"),
        pytest.param(sl.SigmoidFocalLoss(reduction="none"), binary, id="SigmoidFocalLoss-none"),
        pytest.param(sl.CrossEntropyLoss(label_smoothing=0.1), classes, id="CrossEntropyLoss"),
        pytest.param(sl.FocalLoss(gamma=0.5), classes, id="FocalLoss"),
        pytest.param(sl.KLDivLoss(reduction="batchmean"), kl, id="KLDivLoss"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("module, make", _export_cases())
def test_export_with_dynamic_batch(module, make):
    """One graph for every batch size (0.1's SigmoidFocalLoss branched on
    numel() > 65536 and failed to export)."""
    batch = torch.export.Dim("batch")
    program = torch.export.export(module, make(4), dynamic_shapes=({0: batch}, {0: batch}))
    for n in [3, 70_000]:  # past the old 65536-element threshold
        x, y = make(n)
        torch.testing.assert_close(program.module()(x, y), module(x, y))


@pytest.mark.slow
@pytest.mark.parametrize("module, make", _export_cases())
def test_compile_dynamic_does_not_recompile_when_input_grows(module, make):
    """torch.compile(dynamic=True) captures one graph for 8 to 70000 rows."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(module, backend=counter, dynamic=True, fullgraph=True)
    for n in [8, 64, 70_000]:
        x, y = make(n)
        torch.testing.assert_close(compiled(x, y), module(x, y))
    assert counter.frame_count == 1
