"""The private torch APIs behind stablelosses._compat still exist and answer on this torch."""

from __future__ import annotations

import torch

from stablelosses import _compat


def test_private_names_exist_on_this_torch():
    assert _compat._functorch is not None
    assert _compat._transforms_active is not None
    assert _compat._current_node is not None
    assert _compat._disable_functorch is not None
    assert _compat._is_fake is not None
    assert hasattr(torch.zeros(1), "_is_zerotensor")
    assert _compat.set_grad_mode is not torch.set_grad_enabled


def test_set_grad_mode_sets_grad_mode_and_so_does_its_fallback():
    for switch in (_compat.set_grad_mode, torch.set_grad_enabled):
        assert torch.is_grad_enabled()
        switch(False)
        try:
            assert not torch.is_grad_enabled()
        finally:
            switch(True)
        assert torch.is_grad_enabled()


def test_functorch_transforms_active_sees_vmap():
    seen = []

    def f(x):
        seen.append(_compat.functorch_transforms_active())
        return x

    assert not _compat.functorch_transforms_active()
    torch.vmap(f)(torch.zeros(2, 3))
    assert seen == [True]


def test_is_transform_wrapped_sees_batched_tensors():
    seen = []

    def f(x):
        seen.append(_compat.is_transform_wrapped(x))
        return x

    plain = torch.zeros(3)
    assert not _compat.is_transform_wrapped(plain)
    torch.vmap(f)(torch.zeros(2, 3))
    assert seen == [True]


def test_current_autograd_node_names_the_running_backward():
    names = []
    x = torch.ones(2, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: names.append(type(_compat.current_autograd_node()).__name__))
    (y * 2).sum().backward()
    assert _compat.current_autograd_node() is None
    # a tensor hook on y runs as a pre-hook of the node that consumes its gradient: exp's
    assert names and names[0].startswith("ExpBackward")


def test_foreach_norm_equals_per_tensor_norms():
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, -2.0], [2.0, 0.0]])]
    for ord_ in (2.0, float("inf")):
        got = _compat.foreach_norm(ts, ord_)
        want = [torch.linalg.vector_norm(t, ord_) for t in ts]
        assert torch.equal(torch.stack(got), torch.stack(want))
    wide = _compat.foreach_norm(ts, 2.0, torch.float64)
    assert all(t.dtype == torch.float64 for t in wide)


def test_forward_ad_active_sees_a_dual_level():
    import torch.autograd.forward_ad as fwAD

    assert not _compat.forward_ad_active()
    with fwAD.dual_level():
        assert _compat.forward_ad_active()
    seen = []
    torch.func.jvp(lambda x: seen.append(_compat.forward_ad_active()) or x, (torch.ones(2),), (torch.ones(2),))
    assert seen == [True]


def test_softmax_backward_kernels_equal_their_formulas():
    x = torch.randn(4, 6, dtype=torch.float64)
    g = torch.randn(4, 6, dtype=torch.float64)
    y = torch.softmax(x, 1)
    torch.testing.assert_close(_compat.softmax_backward(g, y, 1), y * (g - (g * y).sum(1, keepdim=True)))
    ly = torch.log_softmax(x, 1)
    torch.testing.assert_close(_compat.log_softmax_backward(g, ly, 1), g - ly.exp() * g.sum(1, keepdim=True))
    assert _compat._softmax_bwd is not None and _compat._log_softmax_bwd is not None


def test_is_zero_tensor_sees_forward_ads_zero_tangent():
    assert _compat.is_zero_tensor(torch._efficientzerotensor((2, 3)))
    assert not _compat.is_zero_tensor(torch.zeros(2, 3))


def test_is_fake_sees_fake_and_meta_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2))
    assert _compat.is_fake(fake) and _compat.is_fake(torch.ones(2, device="meta"))
    assert not _compat.is_fake(torch.ones(2))
    monkeypatch.setattr(_compat, "_is_fake", None)  # the fallback: by class name
    assert _compat.is_fake(fake) and not _compat.is_fake(torch.ones(2))


def test_transform_free_value_reads_under_vmap_and_grad():
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    seen = []

    def f(z):
        plain = _compat.transform_free_value(z)
        with _compat.functorch_disabled():
            seen.append((type(plain) is torch.Tensor, plain.sum().item(), tuple(plain.shape)))
        return (z * z).sum()

    torch.vmap(torch.func.grad(f))(x)
    assert seen == [(True, 6.0, (2, 2))]  # the whole batch, read as a plain tensor
    assert _compat.transform_free_value(x) is x


def test_transform_free_value_and_functorch_disabled_fallbacks(monkeypatch):
    seen = []

    def f(z):
        seen.append(_compat.transform_free_value(z))
        return z

    monkeypatch.setattr(_compat, "_functorch", None)
    torch.vmap(f)(torch.zeros(2, 3))
    assert seen == [None]
    monkeypatch.setattr(_compat, "_disable_functorch", None)
    assert _compat.functorch_disabled() is None


def test_the_detector_skips_and_says_so_where_torch_cannot_read_past_a_transform(monkeypatch):
    import warnings

    import stablelosses as sl
    from stablelosses.debug import detect_nonfinite

    monkeypatch.setattr(_compat, "_disable_functorch", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with detect_nonfinite() as det:
            y = torch.vmap(sl.safe_sqrt)(torch.tensor([[-1.0], [4.0]]))
            torch.vmap(sl.safe_sqrt)(torch.tensor([[-1.0], [4.0]]))
    said = [str(w.message) for w in record if "cannot read past it" in str(w.message)]
    assert len(said) == 1 and "stablelosses.safe_sqrt" in said[0]
    assert det.reports == [] and torch.isnan(y[0]).all()


# ---- each fallback, forced: what the library does on a torch without the private name --------


def test_fallbacks_of_the_transform_probes(monkeypatch):
    monkeypatch.setattr(_compat, "_transforms_active", None)
    assert _compat.functorch_transforms_active() is True  # conservative: fast paths off
    monkeypatch.setattr(_compat, "_functorch", None)
    assert _compat._wrapped_check_functions() is None  # looked up once, at import
    monkeypatch.setattr(_compat, "_wrapped_checks", None)
    assert _compat.is_transform_wrapped(torch.zeros(2)) is True
    monkeypatch.delattr(torch.autograd.forward_ad, "_current_level")
    assert _compat.forward_ad_active() is True


def test_fallback_of_current_autograd_node(monkeypatch):
    monkeypatch.setattr(_compat, "_current_node", None)
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: seen.append(_compat.current_autograd_node()))
    y.sum().backward()
    assert seen == [None]


def test_fallback_of_foreach_norm(monkeypatch):
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, -2.0], [2.0, 0.0]])]
    want = [torch.linalg.vector_norm(t, 2.0) for t in ts]
    monkeypatch.delattr(torch, "_foreach_norm")
    assert torch.equal(torch.stack(_compat.foreach_norm(ts, 2.0)), torch.stack(want))

    def old_signature(tensors, ord):  # a torch whose _foreach_norm takes no dtype
        raise TypeError("unexpected keyword argument 'dtype'")

    monkeypatch.setattr(torch, "_foreach_norm", old_signature, raising=False)
    wide = _compat.foreach_norm(ts, 2.0, torch.float64)
    assert all(t.dtype == torch.float64 for t in wide)
    assert torch.equal(torch.stack(wide).float(), torch.stack(want))


def test_fallbacks_of_the_softmax_backward_kernels(monkeypatch):
    x = torch.randn(4, 6, dtype=torch.float64)
    g = torch.randn(4, 6, dtype=torch.float64)
    y, ly = torch.softmax(x, 1), torch.log_softmax(x, 1)
    kernel = _compat.softmax_backward(g, y, 1), _compat.log_softmax_backward(g, ly, 1)
    monkeypatch.setattr(_compat, "_softmax_bwd", None)
    monkeypatch.setattr(_compat, "_log_softmax_bwd", None)
    torch.testing.assert_close(_compat.softmax_backward(g, y, 1), kernel[0])
    torch.testing.assert_close(_compat.log_softmax_backward(g, ly, 1), kernel[1])


def test_fallback_of_is_zero_tensor():
    class NoProbe:  # an object without _is_zerotensor, as on a torch that lacks it
        pass

    assert _compat.is_zero_tensor(NoProbe()) is False  # type: ignore[arg-type]


def test_assume_constant_result_marks_what_torch_marks():
    import torch._dynamo

    def f():
        return 1

    def g():
        return 1

    torch._dynamo.assume_constant_result(f)
    _compat.assume_constant_result(g)
    marked = {k for k in vars(f) if "dynamo" in k}
    assert marked and marked == {k for k in vars(g) if "dynamo" in k}
