"""Arguments that used to be accepted and silently changed the result: a bool ``ignore_index``
(True is class 1 in Python) and a ``mask`` on another device (moved without a word)."""

import pytest
import torch

import stablelosses as sl
import stablelosses.functional as SF


@pytest.mark.parametrize("fn", [SF.cross_entropy, SF.focal_loss], ids=["cross_entropy", "focal_loss"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_ignore_index_is_rejected_as_torch_does(fn, value):
    x, t = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="ignore_index must be an int, got bool"):
        fn(x, t, ignore_index=value)
    # torch refuses it too
    with pytest.raises(TypeError):
        torch.nn.functional.cross_entropy(x, t, ignore_index=value)


x4, t4 = torch.randn(3, 4), torch.tensor([0, 1, 2])
MASKED_CALLS = {
    "cross_entropy": lambda m: SF.cross_entropy(x4, t4, mask=m),
    "focal_loss": lambda m: SF.focal_loss(x4, t4, mask=m),
    "rmse_loss": lambda m: SF.rmse_loss(x4[:, 0], x4[:, 1], mask=m),
    "kl_div": lambda m: SF.kl_div(x4[:, 0], x4[:, 1].sigmoid(), mask=m),
    "sigmoid_focal_loss": lambda m: SF.sigmoid_focal_loss(x4[:, 0], x4[:, 1].sigmoid(), mask=m),
    "masked_mean": lambda m: sl.masked_mean(x4[:, 0], m),
    "softmax": lambda m: sl.softmax(x4[:, 0], 0, mask=m),
    "log_softmax": lambda m: sl.log_softmax(x4[:, 0], 0, mask=m),
    "entropy": lambda m: sl.entropy(x4[:, 0], mask=m, dim=0),
}


@pytest.mark.parametrize("name", list(MASKED_CALLS))
def test_mask_on_another_device_raises_instead_of_moving(name):
    call = MASKED_CALLS[name]
    ok = torch.tensor([True, False, True])
    assert not torch.isnan(call(ok)).any()  # same device: fine
    with pytest.raises(RuntimeError, match="same device"):
        call(ok.to("meta"))


def _outcome(call, x):
    """Value (or the error type) and the input gradient's shape of one call."""
    try:
        out = call()
    except (IndexError, RuntimeError, ValueError) as e:
        return type(e).__name__
    (g,) = torch.autograd.grad(out.sum(), x, allow_unused=True)
    return out.detach(), None if g is None else g.shape


ZERO_CLASS_CASES = [
    ((3, 0), (3, 0), torch.float32),  # probabilities over no class
    ((0, 0), (0,), torch.int64),
    ((0, 0), (0, 0), torch.float32),
    ((2, 0, 3), (2, 0, 3), torch.float32),
    ((3, 0), (3,), torch.int64),  # any index is out of bounds: torch's IndexError
]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shapes", ZERO_CLASS_CASES, ids=str)
def test_zero_classes_give_what_torch_gives(shapes, label_smoothing, reduction):
    # 0.2 raised amax's internal IndexError ("Expected reduction dim 1 to have non-zero size")
    xs, ts, tdt = shapes
    x = torch.zeros(xs, requires_grad=True)
    t = torch.zeros(ts, dtype=tdt)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    ours = _outcome(lambda: SF.cross_entropy(x, t, **kw), x)
    theirs = _outcome(lambda: torch.nn.functional.cross_entropy(x, t, **kw), x)
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        torch.testing.assert_close(ours[0], theirs[0], equal_nan=True)
        assert ours[1] == theirs[1]


def test_focal_loss_and_info_nce_on_empty_batches_give_torch_nan():
    x = torch.zeros(0, 0, requires_grad=True)
    assert torch.isnan(SF.focal_loss(x, torch.zeros(0, dtype=torch.long)))
    q = torch.zeros(0, 8, requires_grad=True)
    for symmetric in (False, True):
        loss = SF.info_nce_loss(q, torch.zeros(0, 8), symmetric=symmetric)
        assert torch.isnan(loss)  # the hand-written InfoNCE: cross_entropy of a 0x0 matrix
        (g,) = torch.autograd.grad(loss, q)
        assert g.shape == (0, 8)
    assert SF.info_nce_loss(q, torch.zeros(0, 8), reduction="none").shape == (0,)
    # with a mask an empty denominator is 0, as everywhere else
    assert SF.cross_entropy(x, torch.zeros(0, dtype=torch.long), mask=torch.zeros(0, dtype=torch.bool)) == 0


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


META_CALLS = {
    "softmax": lambda: SF.softmax(_meta(3, 4), -1),
    "log_softmax": lambda: SF.log_softmax(_meta(3, 4), -1),
    "logsumexp": lambda: SF.logsumexp(_meta(3, 4), -1),
    "cross_entropy": lambda: SF.cross_entropy(_meta(3, 4), _meta(3, dtype=torch.long)),
    "cross_entropy_smoothing": lambda: SF.cross_entropy(_meta(3, 4), _meta(3, dtype=torch.long), label_smoothing=0.1),
    "cross_entropy_probs": lambda: SF.cross_entropy(_meta(3, 4), _meta(3, 4)),
    "focal_loss": lambda: SF.focal_loss(_meta(3, 4), _meta(3, dtype=torch.long)),
    "sigmoid_focal_loss": lambda: SF.sigmoid_focal_loss(_meta(3, 4), _meta(3, 4)),
    "kl_div": lambda: SF.kl_div(_meta(3, 4), _meta(3, 4), reduction="batchmean"),
    "rmse_loss": lambda: SF.rmse_loss(_meta(3, 4), _meta(3, 4)),
    "log_cosh_loss": lambda: SF.log_cosh_loss(_meta(3, 4), _meta(3, 4)),
    "normalize": lambda: SF.normalize(_meta(3, 4)),
    "cosine_similarity": lambda: SF.cosine_similarity(_meta(3, 4), _meta(3, 4)),
    "logaddexp": lambda: SF.logaddexp(_meta(3), _meta(3)),
    "masked_mean": lambda: SF.masked_mean(_meta(3), _meta(3, dtype=torch.bool)),
    "entropy": lambda: SF.entropy(_meta(3, 4)),
    "info_nce_loss": lambda: SF.info_nce_loss(_meta(3, 4), _meta(3, 4)),
    "dice_loss": lambda: SF.dice_loss(_meta(3, 4), _meta(3, 4)),
    "safe_div": lambda: SF.safe_div(_meta(3), _meta(3)),
    "safe_sqrt": lambda: SF.safe_sqrt(_meta(3)),
    "xlogy": lambda: SF.xlogy(_meta(3), _meta(3)),
    "linear_cross_entropy": lambda: SF.linear_cross_entropy(_meta(3, 4), _meta(5, 4), _meta(3, dtype=torch.long)),
    "linear_focal_loss": lambda: SF.linear_focal_loss(_meta(3, 4), _meta(5, 4), _meta(3, dtype=torch.long)),
}


@pytest.mark.parametrize("name", list(META_CALLS))
def test_meta_tensors_give_the_shape_without_computing(name):
    # torch's counterparts all run on meta tensors (shape inference, FSDP's deferred init)
    out = META_CALLS[name]()
    assert out.device.type == "meta"
