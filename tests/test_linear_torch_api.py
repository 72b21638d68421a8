"""linear_cross_entropy / linear_focal_loss with torch's signature: parity with
``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13; the unfused formula everywhere),
the deprecated old spelling, ``options``, zero-size H, meta tensors, bf16 weights converted
block by block, and a compiled graph that does not depend on N."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import stablelosses as sl
import stablelosses._autograd.linear as linear_impl
import stablelosses.functional as SF

HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy")
needs_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE, reason="torch < 2.13 has no F.linear_cross_entropy")
N, H, V = 12, 5, 9


def _data(lead=(N,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, H, generator=g).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    t = torch.randint(0, V, lead, generator=g)
    cw = torch.rand(V, generator=g).add(0.5).to(dtype)
    return x, w, b, t, cw


def _unfused(x, w, t, *, linear_bias=None, **kw):
    """``F.cross_entropy(F.linear(...))`` in float32 (torch's formula on every torch)."""
    u = F.linear(x.reshape(-1, x.shape[-1]), w, linear_bias)
    out = F.cross_entropy(u, t.reshape(-1), **kw)
    return out.reshape(t.shape) if kw.get("reduction") == "none" else out


def _torch_fused(x, w, t, **kw):
    """torch's own ``F.linear_cross_entropy`` (inputs 1-D or 2-D there: 3-D is flattened)."""
    out = F.linear_cross_entropy(x.reshape(-1, x.shape[-1]), w, t.reshape(-1), **kw)
    return out.reshape(t.shape) if kw.get("reduction") == "none" else out


REFERENCES = [
    pytest.param(_torch_fused, id="torch-fused", marks=needs_torch_lce),
    pytest.param(_unfused, id="unfused"),
]


def _value_and_grads(fn, x, w, b, t, go, **kw):
    x, w, b = (v.detach().clone().requires_grad_(True) for v in (x, w, b))
    loss = fn(x, w, t, linear_bias=b, **kw)
    grads = torch.autograd.grad(loss, (x, w, b), go if go is not None else torch.ones_like(loss))
    return loss, grads


@pytest.mark.parametrize("ref", REFERENCES)
@pytest.mark.parametrize("lead", [(N,), (3, 4)], ids=["2d", "3d"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", [
    {}, {"weight": True}, {"ignore_index": 2}, {"label_smoothing": 0.2},
    {"weight": True, "ignore_index": 2, "label_smoothing": 0.3},
], ids=["plain", "class-weight", "ignore", "smoothing", "all"])
def test_float32_parity(ref, lead, reduction, kw):
    x, w, b, t, cw = _data(lead)
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = cw
    if "ignore_index" in kw:
        t = torch.where(t == 3, kw["ignore_index"], t)  # class 2 is ignored, class 3 never occurs
    go = torch.randn(t.shape) if reduction == "none" else None
    la, ga = _value_and_grads(SF.linear_cross_entropy, x, w, b, t, go, reduction=reduction, chunk_size=5, **kw)
    lb, gb = _value_and_grads(ref, x, w, b, t, go, reduction=reduction, **kw)
    torch.testing.assert_close(la, lb, rtol=2e-6, atol=2e-6)
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("ref", REFERENCES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bfloat16_parity(ref, reduction, smoothing):
    """bf16 in, float32 compute: equal to the reference on the same values in float32, rounded
    to bf16 (a bf16-computed reference would be the less accurate one)."""
    x, w, b, t, cw = _data(dtype=torch.bfloat16)
    go = torch.randn(t.shape).bfloat16() if reduction == "none" else None
    kw = dict(reduction=reduction, weight=cw, label_smoothing=smoothing)
    la, ga = _value_and_grads(SF.linear_cross_entropy, x, w, b, t, go, chunk_size=4, **kw)
    kw32 = dict(kw, weight=cw.float())
    lb, gb = _value_and_grads(ref, x.float(), w.float(), b.float(), t, None if go is None else go.float(), **kw32)
    assert la.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in ga)
    torch.testing.assert_close(la, lb.bfloat16(), rtol=8e-3, atol=1e-5)
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q.bfloat16(), rtol=8e-3, atol=1e-5)


@needs_torch_lce
def test_bfloat16_close_to_torchs_chunked_path():
    x, w, b, t, _ = _data(dtype=torch.bfloat16)
    la, ga = _value_and_grads(SF.linear_cross_entropy, x, w, b, t, None)
    lb, gb = _value_and_grads(F.linear_cross_entropy, x, w, b, t, None, options=torch.nn.LinearCrossEntropyOptions())
    torch.testing.assert_close(la, lb)
    for p, q in zip(ga, gb):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_focal_with_class_weights_matches_focal_loss(reduction):
    x, w, b, t, cw = _data(dtype=torch.float64)
    t[::4] = -100
    got = SF.linear_focal_loss(x, w, t, linear_bias=b, weight=cw, gamma=1.5, reduction=reduction, chunk_size=5)
    want = SF.focal_loss(F.linear(x, w, b), t, weight=cw, gamma=1.5, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_class_weight_is_not_a_matrix():
    x, w, b, t, _ = _data()
    with pytest.raises(RuntimeError, match="the output layer's matrix is linear_weight"):
        SF.linear_cross_entropy(x, w, t, weight=w)  # never read as the matrix


# --- the old spelling: one version with a DeprecationWarning ---------------------------------


def _new(x, w, t, b):
    return SF.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1)


@pytest.mark.parametrize("call", [
    lambda x, w, t, b: SF.linear_cross_entropy(x, w, t, b, label_smoothing=0.1),
    lambda x, w, t, b: SF.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1),
    lambda x, w, t, b: SF.linear_cross_entropy(x, weight=w, target=t, bias=b, label_smoothing=0.1),
    lambda x, w, t, b: SF.linear_cross_entropy(input=x, weight=w, target=t, bias=b, label_smoothing=0.1),
], ids=["positional-bias", "bias-keyword", "weight-keyword", "all-keywords"])
def test_old_functional_spelling_warns_and_agrees(call):
    x, w, b, t, _ = _data()
    with pytest.warns(DeprecationWarning, match="linear_bias=b"):
        old = call(x, w, t, b)
    assert torch.equal(old, _new(x, w, t, b))


def test_new_spelling_does_not_warn():
    x, w, b, t, cw = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SF.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw)
        SF.linear_cross_entropy(input=x, linear_weight=w, target=t, weight=cw)
        SF.linear_focal_loss(x, w, t, weight=cw, gamma=1.0)
        sl.LinearCrossEntropyLoss(H, V)(x, t)


def test_old_spelling_argument_errors():
    x, w, b, t, _ = _data()
    with pytest.raises(TypeError, match="both bias= .* and linear_bias="):
        SF.linear_cross_entropy(x, w, t, bias=b, linear_bias=b)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        SF.linear_cross_entropy(x, w, t, b, b)


def test_old_module_spelling_warns_and_agrees():
    x, w, b, t, _ = _data()
    with pytest.warns(DeprecationWarning, match=r"LinearCrossEntropyLoss\(in_features, num_classes"):
        old = sl.LinearCrossEntropyLoss(label_smoothing=0.1)
    assert old.linear is None
    assert torch.equal(old(x, w, t, b), _new(x, w, t, b))
    with pytest.warns(DeprecationWarning, match="LinearFocalLoss"):
        old_focal = sl.LinearFocalLoss(0.5, -100, "sum")  # old positional: gamma, ignore_index, reduction
    assert old_focal.gamma == 0.5 and old_focal.reduction == "sum"
    assert torch.equal(old_focal(x, w, t), SF.linear_focal_loss(x, w, t, gamma=0.5, reduction="sum"))


def test_module_owns_its_layer_like_torchs():
    m = sl.LinearCrossEntropyLoss(H, V, bias=True, weight=torch.ones(V))
    assert isinstance(m, torch.nn.modules.loss._WeightedLoss)
    assert [n for n, _ in m.named_parameters()] == ["linear.weight", "linear.bias"]
    if HAS_TORCH_LCE:
        theirs = torch.nn.LinearCrossEntropyLoss(H, V, bias=True, weight=torch.ones(V))
        assert list(m.state_dict()) == list(theirs.state_dict())
        m.load_state_dict(theirs.state_dict())
        x, _, _, t, _ = _data()
        torch.testing.assert_close(m(x, t), theirs(x, t))


# --- options --------------------------------------------------------------------------------


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.shapes.append((func, tuple(o.shape), o.dtype))
        return out


@needs_torch_lce
def test_options_batch_chunk_size_is_our_chunking():
    x, w, b, t, _ = _data()
    opt = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=3)
    with _Largest() as mode:
        got = SF.linear_cross_entropy(x, w, t, linear_bias=b, options=opt)
    logits = {s for f, s, _ in mode.shapes if f in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
              and s[1:] == (V,)}
    assert logits == {(3, V)}
    assert torch.equal(got, SF.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=3))
    assert torch.equal(SF.linear_cross_entropy(x, w, t, options=opt, chunk_size=3),
                       SF.linear_cross_entropy(x, w, t, chunk_size=3))
    with pytest.raises(ValueError, match="chunk_size=4 and options"):
        SF.linear_cross_entropy(x, w, t, options=opt, chunk_size=4)


@needs_torch_lce
def test_options_acc_dtype():
    x, w, b, t, _ = _data()
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), t)
    got = SF.linear_cross_entropy(x, w, t, linear_bias=b,
                                  options=torch.nn.LinearCrossEntropyOptions(acc_dtype=torch.float64))
    assert got.dtype == torch.float32
    assert got.item() == ref.float().item()  # computed in float64, then rounded once
    with pytest.raises(ValueError, match="acc_dtype=torch.bfloat16 is not supported"):
        SF.linear_cross_entropy(x, w, t, options=torch.nn.LinearCrossEntropyOptions(acc_dtype=torch.bfloat16))


def test_options_type_is_checked():
    x, w, _, t, _ = _data()
    with pytest.raises(TypeError, match="options must be None or a torch.nn.LinearCrossEntropyOptions"):
        SF.linear_cross_entropy(x, w, t, options={"batch_chunk_size": 2})


# --- H = 0 and meta tensors ---------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_focal_loss"])
def test_zero_features_give_what_torch_gives(reduction, fn):
    x = torch.randn(4, 0, requires_grad=True)
    w = torch.randn(5, 0, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    t = torch.tensor([0, 1, 4, 2])
    got = getattr(SF, fn)(x, w, t, linear_bias=b, reduction=reduction)
    logits = F.linear(x, w, b)
    want = F.cross_entropy(logits, t, reduction=reduction) if fn == "linear_cross_entropy" else (
        SF.focal_loss(logits, t, reduction=reduction))
    torch.testing.assert_close(got, want)
    go = torch.ones_like(got)
    for p, q in zip(torch.autograd.grad(got, (x, w, b), go), torch.autograd.grad(want, (x, w, b), go)):
        assert p.shape == q.shape
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_tensors_like_the_unfused_version(reduction, dtype):
    def make():
        x = torch.empty(6, 4, device="meta", dtype=dtype, requires_grad=True)
        w = torch.empty(7, 4, device="meta", dtype=dtype, requires_grad=True)
        return x, w
    t = torch.zeros(6, dtype=torch.long, device="meta")
    (xa, wa), (xb, wb) = make(), make()
    got = SF.linear_cross_entropy(xa, wa, t, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    want = F.cross_entropy(F.linear(xb, wb), t, reduction=reduction, label_smoothing=0.1)
    assert (got.device, got.shape, got.dtype) == (want.device, want.shape, want.dtype)
    ga = torch.autograd.grad(got, (xa, wa), torch.ones_like(got))
    gb = torch.autograd.grad(want, (xb, wb), torch.ones_like(want))
    assert [(g.device, g.shape, g.dtype) for g in ga] == [(g.device, g.shape, g.dtype) for g in gb]


# --- a bf16 weight is never converted to float32 whole ------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_weight_is_converted_block_by_block(monkeypatch, reduction):
    monkeypatch.setattr(linear_impl, "W_BLOCK_BYTES", 3 * H * 4)  # 3 vocabulary rows per block
    x, w, b, t, _ = _data(dtype=torch.bfloat16)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with _Largest() as mode:
        loss = SF.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, chunk_size=4)
        gx, gw = torch.autograd.grad(loss, (x, w), torch.ones_like(loss))
    converted = [s for f, s, d in mode.shapes if f is torch.ops.aten._to_copy.default and d == torch.float32]
    assert converted and max(s[0] for s in converted if len(s) == 2 and s[1] == H) <= 4  # blocks, chunks
    assert (V, H) not in converted
    monkeypatch.undo()
    x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    loss2 = SF.linear_cross_entropy(x2, w2, t, linear_bias=b, reduction=reduction, chunk_size=4)
    assert torch.equal(loss, loss2)
    for p, q in zip((gx, gw), torch.autograd.grad(loss2, (x2, w2), torch.ones_like(loss2))):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_weight_gradient_is_accumulated_in_float32():
    """Over many chunks a bf16 accumulator would lose the small per-chunk terms."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g).bfloat16()
    w = torch.randn(16, 8, generator=g).bfloat16().requires_grad_(True)
    t = torch.randint(0, 16, (512,), generator=g)
    (gw,) = torch.autograd.grad(SF.linear_cross_entropy(x, w, t, reduction="sum", chunk_size=1), (w,))
    w64 = w.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(F.cross_entropy(F.linear(x.double(), w64), t, reduction="sum"), (w64,))
    torch.testing.assert_close(gw, ref.bfloat16(), rtol=8e-3, atol=1e-3)


# --- compiled, z_loss not a literal, graph independent of N --------------------------------------


def _graph_size(gm):
    return sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_graph_does_not_depend_on_n(reduction):
    import torch._dynamo

    sizes = []

    def backend(gm, example_inputs):
        sizes.append(_graph_size(gm))
        return gm.forward

    def loss(x, w, t, z):
        return SF.linear_cross_entropy(x, w, t, z_loss=z, chunk_size=2, reduction=reduction).sum()

    for chunks in (2, 8):
        torch._dynamo.reset()
        x, w, _, _, _ = _data()
        x = torch.randn(2 * chunks, H, requires_grad=True)
        t = torch.randint(0, V, (2 * chunks,))
        z = 1e-3 * chunks  # a Python float argument: a SymFloat under dynamic=True
        f = torch.compile(loss, backend=backend, fullgraph=True, dynamic=True)
        got = f(x, w, t, z)
        torch.testing.assert_close(got, loss(x, w, t, z))
    assert len(sizes) == 2 and sizes[0] == sizes[1]


@pytest.mark.slow
def test_compiled_with_runtime_z_loss_matches_eager():
    x, w, b, t, cw = _data()
    leaves = [v.clone().requires_grad_(True) for v in (x, w, b)]
    kw = dict(weight=cw, label_smoothing=0.1, softcap=5.0, chunk_size=5)
    f = torch.compile(lambda x, w, b, z: SF.linear_cross_entropy(x, w, t, linear_bias=b, z_loss=z, **kw),
                      fullgraph=True, dynamic=True)
    got = f(*leaves, 1e-3)
    eager = [v.clone().requires_grad_(True) for v in (x, w, b)]
    want = SF.linear_cross_entropy(eager[0], eager[1], t, linear_bias=eager[2], z_loss=1e-3, **kw)
    torch.testing.assert_close(got, want)
    for p, q in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, eager)):
        torch.testing.assert_close(p, q)


# --- torch's own samples: ModuleInfo (nn.LinearCrossEntropyLoss) and OpInfo -------------------
# Every sample of torch's test suite for the module and the function, compared to torch's own
# module / function on the same values: forward, and the gradients of the input, a float target
# and the layer's parameters (float32 and float64); every error input raises torch's exception
# type with a message that torch's regex finds.


def _module_info():
    from torch.testing._internal.common_modules import module_db

    return next(m for m in module_db if m.module_cls is torch.nn.LinearCrossEntropyLoss)


def _op_infos():
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if o.name == "nn.functional.linear_cross_entropy"]


def _grads_agree(ours, theirs, ours_leaves, their_leaves, what, seed):
    torch.testing.assert_close(ours, theirs, msg=lambda m: f"{what}: value: {m}")
    go = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(seed), dtype=theirs.dtype)
    ga = torch.autograd.grad(ours, ours_leaves, go, allow_unused=True)
    gb = torch.autograd.grad(theirs, their_leaves, go, allow_unused=True)
    for i, (p, q) in enumerate(zip(ga, gb)):
        assert (p is None) == (q is None), f"{what}: gradient {i}: {p} vs {q}"
        if p is not None:
            torch.testing.assert_close(p, q, msg=lambda m, i=i: f"{what}: gradient {i}: {m}")


def _leaf(v):
    return v.detach().clone().requires_grad_(v.is_floating_point())


@needs_torch_lce
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_every_moduleinfo_sample_matches_torchs_module(dtype):
    info = _module_info()
    torch.manual_seed(0)
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True)
    kinds = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when it ignores options (K-dim, probabilities)
        for k, s in enumerate(samples):
            args, kwargs = s.constructor_input.args, s.constructor_input.kwargs
            theirs = torch.nn.LinearCrossEntropyLoss(*args, **kwargs)
            ours = sl.LinearCrossEntropyLoss(*args, **kwargs)
            assert ours.ignore_index == theirs.ignore_index and ours.out_features == tuple(theirs.out_features)
            ours.load_state_dict(theirs.state_dict())  # the same parameters, stored as torch's
            x, t = s.forward_input.args
            xa, ta, xb, tb = _leaf(x), _leaf(t), _leaf(x), _leaf(t)
            kinds.add((bool(kwargs["out_features"]), t.is_floating_point(), kwargs.get("bias", False)))
            _grads_agree(ours(xa, ta), theirs(xb, tb), [xa, *([ta] if t.is_floating_point() else []),
                         *ours.parameters()], [xb, *([tb] if t.is_floating_point() else []), *theirs.parameters()],
                         f"sample {k}: {kwargs}, input {tuple(x.shape)}, target {t.dtype} {tuple(t.shape)}", k)
    # the features the audit found missing are among the samples: K-dimensional, probabilities, bias
    assert {(True, True, False), (False, True, False), (True, False, True), (False, False, True)} <= kinds


@needs_torch_lce
def test_every_moduleinfo_error_input_raises_torchs_error():
    import re

    from torch.testing._internal.common_modules import ModuleErrorEnum

    info = _module_info()
    errors = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=True)
    assert errors
    for e in errors:
        s = e.module_error_input
        with pytest.raises(e.error_type) as raised:
            m = sl.LinearCrossEntropyLoss(*s.constructor_input.args, **s.constructor_input.kwargs)
            assert e.error_on == ModuleErrorEnum.FORWARD_ERROR, "constructed where torch refuses"
            m(*s.forward_input.args, **s.forward_input.kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's "[[]0, 1[]]" reads as a nested set
            found = re.search(e.error_regex, str(raised.value))
        assert found, (e.error_regex, str(raised.value))


@needs_torch_lce
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("variant", ["", "chunked", "chunked_none"])
def test_every_opinfo_sample_matches_torchs_function(variant, dtype):
    (op,) = [o for o in _op_infos() if o.variant_test_name == variant]
    torch.manual_seed(0)
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, s in enumerate(op.sample_inputs("cpu", dtype, requires_grad=True)):
            tensors = [s.input, *s.args]
            names = [n for n, v in s.kwargs.items() if isinstance(v, torch.Tensor)]
            mine = [_leaf(v) if v.requires_grad else v for v in (*tensors, *(s.kwargs[n] for n in names))]
            ref = [_leaf(v) if v.requires_grad else v for v in (*tensors, *(s.kwargs[n] for n in names))]
            kw_a = dict(s.kwargs, **dict(zip(names, mine[3:])))
            kw_b = dict(s.kwargs, **dict(zip(names, ref[3:])))
            got = SF.linear_cross_entropy(*mine[:3], **kw_a)
            want = F.linear_cross_entropy(*ref[:3], **kw_b)
            _grads_agree(got, want, [v for v in mine if v.requires_grad], [v for v in ref if v.requires_grad],
                         f"sample {k}: {s}", k)
            count += 1
    assert count > 10


@needs_torch_lce
def test_every_opinfo_error_input_raises_torchs_error():
    import re

    errors = [e for op in _op_infos() if op.variant_test_name == "" for e in op.error_inputs("cpu")]
    assert errors
    for e in errors:
        s = e.sample_input
        with pytest.raises(e.error_type) as raised:
            SF.linear_cross_entropy(s.input, *s.args, **s.kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's "[[]0, 1[]]" reads as a nested set
            found = re.search(e.error_regex, str(raised.value))
        assert found, (e.error_regex, str(raised.value))


# --- the module's constructor is torch's ---------------------------------------------------------


@needs_torch_lce
@pytest.mark.parametrize("cls", [sl.LinearCrossEntropyLoss, sl.LinearFocalLoss])
def test_constructor_defaults_are_torchs(cls):
    import inspect

    theirs = inspect.signature(torch.nn.LinearCrossEntropyLoss.__init__).parameters
    ours = inspect.signature(cls.__init__).parameters
    for name, p in theirs.items():
        if name not in ("self", "in_features", "num_classes") and name in ours:
            assert ours[name].default == p.default, name
    m = cls(H, V)
    assert m.ignore_index is None and m.out_features == ()


def test_probability_targets_with_the_default_module():
    """torch's default ignore_index=None: probability targets work with a default module, class
    indices still ignore -100 (the old default's behaviour is kept)."""
    x, _, _, t, _ = _data(dtype=torch.float64)
    m = sl.LinearCrossEntropyLoss(H, V, bias=True, dtype=torch.float64)
    w, b = m.linear.weight, m.linear.bias
    y = torch.softmax(torch.randn(N, V, dtype=torch.float64), -1)
    torch.testing.assert_close(m(x, y), F.cross_entropy(F.linear(x, w, b), y), rtol=1e-12, atol=1e-12)
    t[::3] = -100
    torch.testing.assert_close(m(x, t), F.cross_entropy(F.linear(x, w, b), t), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="ignore_index cannot be specified when target contains probabilities"):
        sl.LinearCrossEntropyLoss(H, V, ignore_index=-100)(x.float(), y.float())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_k_dimensional_modules(bias, reduction):
    """out_features (d_1, ..., d_K): torch's flat storage, the unfused formula; the focal module
    takes the same constructor (gamma=0 is cross-entropy)."""
    g = torch.Generator().manual_seed(3)
    of = (3, 2)
    x = torch.randn(4, H, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (4, *of), generator=g)
    t[0, 0, 0] = 1
    kw = dict(out_features=of, bias=bias, dtype=torch.float64, reduction=reduction, ignore_index=1)
    m = sl.LinearCrossEntropyLoss(H, V, **kw)
    f = sl.LinearFocalLoss(H, V, gamma=0.0, **kw)
    f.load_state_dict(m.state_dict())
    assert m.linear.weight.shape == (V * 6, H) and "out_features=(3, 2)" in repr(m)
    w = m.linear.weight.reshape(V, *of, H)
    b = None if m.linear.bias is None else m.linear.bias.reshape(V, *of)
    u = F.linear(x, w.reshape(-1, H), None if b is None else b.reshape(-1)).reshape(4, V, *of)
    want = F.cross_entropy(u, t, reduction=reduction, ignore_index=1)
    torch.testing.assert_close(m(x, t), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f(x, t), want, rtol=1e-12, atol=1e-12)
    y = torch.softmax(torch.randn(4, V, *of, generator=g, dtype=torch.float64), 1)
    m.ignore_index = None
    torch.testing.assert_close(m(x, y), F.cross_entropy(u, y, reduction=reduction), rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="out_features must be a tuple of ints"):
        sl.LinearCrossEntropyLoss(H, V, out_features=(2, -1))


def test_message_keeps_ours_and_says_torchs():
    x, w, _, t, _ = _data()
    with pytest.raises(ValueError, match=r"target must have shape \[12\].*\(torch: Expected input batch_size \(12\)"):
        SF.linear_cross_entropy(x, w, t[:5])
    with pytest.raises(RuntimeError, match=r"target of the logits' shape .*\(torch: Expected floating point type"):
        SF.linear_cross_entropy(x, w, torch.zeros(N, V, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"target must hold class indices.*\(torch: expected input with "
                                           r"dimensionality 1 or 2, got 3\)"):
        SF.linear_cross_entropy(x.reshape(3, 4, H), w, t.float().reshape(3, 4))


@pytest.mark.parametrize("fn", [SF.linear_cross_entropy, SF.linear_focal_loss], ids=["ce", "focal"])
@pytest.mark.parametrize("target, ignore_index", [([0, 1, 7], -100), ([0, -100, 1], 3), ([0, -1, 1], -100)])
def test_a_target_out_of_range_is_torchs_index_error(fn, target, ignore_index):
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor(target)
    bad = next(v for v in target if not 0 <= v < 5)
    if HAS_TORCH_LCE:
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
            F.linear_cross_entropy(x, w, t, ignore_index=ignore_index)
    for reduction in ("mean", "none"):
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds") as caught:
            fn(x, w, t, ignore_index=ignore_index, reduction=reduction)
        assert isinstance(caught.value, RuntimeError)  # the gather's type, as documented before


@pytest.mark.slow
@pytest.mark.parametrize("fn", [SF.linear_cross_entropy, SF.linear_focal_loss], ids=["ce", "focal"])
def test_the_old_positional_bias_compiles(fn):
    # the deprecation warning is skipped while compiling (Dynamo cannot trace warnings.warn)
    h, w, b, t = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3), torch.tensor([0, 2, 1, 2])
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = torch.compile(lambda h, w, b: fn(h, w, t, b), fullgraph=True)(h, w, b)
    torch.testing.assert_close(got, fn(h, w, t, linear_bias=b))
