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
