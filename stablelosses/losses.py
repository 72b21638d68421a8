"""``nn.Module`` wrappers of the stable losses.

Each class stores its configuration, registers ``weight`` as a buffer (so ``.to()`` and
``state_dict()`` carry it), and calls the function of the same name in
`stablelosses.functional` in ``forward``. The math, the defined gradients and the examples
are documented once, on those functions. Every ``forward`` takes an optional ``mask``
(bool, True = counts; ``loss_fn(input, target, mask=mask)``) and passes it to the function.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.loss import _Loss as _TorchLoss
from torch.nn.modules.loss import _WeightedLoss as _TorchWeightedLoss

from stablelosses import functional as SF
from stablelosses._spec import (
    KL_REDUCTIONS,
    REDUCTIONS,
    check_finite_nonnegative,
    check_label_smoothing,
    check_reduction,
)
from stablelosses._utils import check_floating, legacy_reduction
from stablelosses.functional._cross_entropy import check_cross_entropy_args
from stablelosses.functional._dice import check_dice_args
from stablelosses.functional._focal import check_focal_loss_args
from stablelosses.functional._info_nce import check_info_nce_args
from stablelosses.functional._kl_div import check_kl_div_args
from stablelosses.functional._linear import check_linear_options
from stablelosses.functional._rmse import check_rmse_args
from stablelosses.functional._sigmoid_focal import check_focal_args


class _Loss(_TorchLoss):
    """What the module classes share; a ``torch.nn.modules.loss._Loss``, as torch's losses are.

    A subclass names its function (``_function``) and its configuration (``_config``): the
    keyword arguments it passes to the function, kept as plain attributes that ``repr`` shows.
    ``__init__`` checks ``reduction`` against ``_reductions``; a subclass checks every other
    argument at construction with its function's check (``check_<op>_args``), so a module
    raises what its function would raise, naming the class. ``forward`` is one call of the
    function.
    """

    _config: tuple[str, ...] = ()
    _reductions: tuple[str, ...] = REDUCTIONS
    _function: Callable[..., Tensor]

    def __init__(self, **config: object) -> None:
        reduction = config["reduction"] = check_reduction(type(self).__name__, config["reduction"],
                                                          self._reductions)
        # torch's _Loss (and _WeightedLoss, with weight None until ours registers it) keeps the
        # reduction, as torch's own modules do
        super().__init__(reduction=reduction)
        for name in self._config:
            setattr(self, name, config[name])

    def _options(self) -> dict[str, Any]:
        """The keyword arguments of ``_function``."""
        return {name: getattr(self, name) for name in self._config}

    def forward(self, input: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        return self._function(input, target, mask=mask, **self._options())

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._config)


class _WeightedLoss(_Loss, _TorchWeightedLoss):
    """A loss with a per-class ``weight``: a registered buffer (``.to()`` and ``state_dict()``
    carry it; ``None`` is not in ``state_dict()``, as in torch), passed to the function and not
    shown by ``repr``. A ``torch.nn.modules.loss._WeightedLoss``, as torch's weighted losses."""

    weight: Tensor | None

    def __init__(self, weight: Tensor | None, **config: object) -> None:
        if weight is not None:  # its shape needs the input's classes: the function checks it
            check_floating(type(self).__name__, "weight", weight)
        super().__init__(**config)
        self.register_buffer("weight", weight)

    def _options(self) -> dict[str, Any]:
        return {"weight": self.weight, **super()._options()}


class RMSELoss(_Loss):
    r"""Root-mean-square error with a finite gradient at zero residual.

    Drop-in for ``torch.sqrt(nn.MSELoss(reduction=reduction)(input, target) + eps)``.
    See [`rmse_loss`][stablelosses.functional.rmse_loss] for the math and the defined gradient.

    Args:
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        eps: added under the square root, as in the expression it replaces. Default: ``0.0``.

    Example:
        >>> import torch, stablelosses as sl
        >>> x = torch.zeros(4, requires_grad=True)
        >>> sl.RMSELoss()(x, torch.zeros(4)).backward()
        >>> x.grad
        tensor([0., 0., 0., 0.])
    """

    _config = ("reduction", "eps")
    _function = staticmethod(SF.rmse_loss)

    def __init__(self, reduction: str = "mean", eps: float = 0.0) -> None:
        reduction, eps = check_rmse_args("RMSELoss", reduction, eps)
        super().__init__(reduction=reduction, eps=eps)


class CrossEntropyLoss(_WeightedLoss):
    r"""Cross-entropy that stays finite with ``-inf`` (masked) logits.

    Drop-in for ``nn.CrossEntropyLoss``, same arguments (``size_average`` and ``reduce`` are
    accepted as torch's deprecated aliases of ``reduction``). See
    [`cross_entropy`][stablelosses.functional.cross_entropy].

    Args:
        weight: per-class rescaling weight of shape ``(C,)``. Default: ``None``.
        ignore_index: target value that is ignored. Default: ``-100``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        label_smoothing: amount of smoothing in ``[0, 1]``. Default: ``0.0``.

    Example:
        >>> import torch, stablelosses as sl
        >>> logits = torch.tensor([[2.0, 0.5, float("-inf")]], requires_grad=True)
        >>> sl.CrossEntropyLoss(label_smoothing=0.1)(logits, torch.tensor([0])).backward()
        >>> bool(torch.isfinite(logits.grad).all())
        True
    """

    _config = ("ignore_index", "reduction", "label_smoothing")
    _function = staticmethod(SF.cross_entropy)

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        reduction, _, ignore_index = check_cross_entropy_args(
            "CrossEntropyLoss", legacy_reduction(size_average, reduce, reduction), 0.0, ignore_index)
        # a bad label_smoothing raises in forward, as torch's module does (its ModuleInfo error
        # input builds CrossEntropyLoss(label_smoothing=1.5) and expects the forward to raise);
        # a good one is kept as the checked float
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            label_smoothing = check_label_smoothing("CrossEntropyLoss", label_smoothing)
        super().__init__(
            weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        )


class FocalLoss(_WeightedLoss):
    r"""Multi-class focal loss on logits, finite for every ``gamma >= 0``.

    Replaces the hand-written softmax→log ``FocalLoss`` and kornia's ``focal_loss``. See
    [`focal_loss`][stablelosses.functional.focal_loss].

    Args:
        gamma: focusing parameter, ``>= 0``. Default: ``2.0``.
        weight: per-class weight of shape ``(C,)``, as in ``cross_entropy``. Default: ``None``.
        ignore_index: target value that is ignored. Default: ``-100``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> logits = torch.tensor([[10.0, -200.0]], requires_grad=True)
        >>> sl.FocalLoss(gamma=0.5)(logits, torch.tensor([0])).backward()
        >>> bool(torch.isfinite(logits.grad).all())
        True
    """

    _config = ("gamma", "ignore_index", "reduction")
    _function = staticmethod(SF.focal_loss)

    def __init__(self, gamma: float = 2.0, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean") -> None:
        reduction, gamma, ignore_index = check_focal_loss_args("FocalLoss", reduction, gamma, ignore_index)
        super().__init__(weight, gamma=gamma, ignore_index=ignore_index, reduction=reduction)


class SigmoidFocalLoss(_Loss):
    r"""Binary (sigmoid) focal loss of RetinaNet, finite for every ``gamma >= 0``.

    Replaces ``torchvision.ops.sigmoid_focal_loss``; unlike that function the module's default
    reduction is ``'mean'``. See [`sigmoid_focal_loss`][stablelosses.functional.sigmoid_focal_loss].

    Args:
        alpha: weight of the positive class in ``[0, 1]``; ``-1`` disables weighting.
            Default: ``0.25``.
        gamma: focusing parameter, ``>= 0``. Default: ``2.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> logits = torch.tensor([20.0, -20.0], requires_grad=True)
        >>> sl.SigmoidFocalLoss(gamma=0.5)(logits, torch.tensor([1.0, 0.0])).backward()
        >>> bool(torch.isfinite(logits.grad).all())
        True
    """

    _config = ("alpha", "gamma", "reduction")
    _function = staticmethod(SF.sigmoid_focal_loss)

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0, reduction: str = "mean") -> None:
        # torchvision's messages
        reduction, alpha, gamma = check_focal_args("SigmoidFocalLoss", alpha, gamma, reduction)
        super().__init__(alpha=alpha, gamma=gamma, reduction=reduction)


class KLDivLoss(_Loss):
    r"""KL divergence whose zero-probability targets contribute 0 with 0 gradient.

    Drop-in for ``nn.KLDivLoss`` (same arguments, ``size_average``/``reduce`` accepted as
    torch's deprecated aliases). See [`kl_div`][stablelosses.functional.kl_div].

    Args:
        reduction: ``'none'`` | ``'batchmean'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        log_target: whether ``target`` is given as log-probabilities. Default: ``False``.

    Example:
        >>> import torch, stablelosses as sl
        >>> logp = torch.tensor([[0.0, float("-inf")]], requires_grad=True)
        >>> sl.KLDivLoss(reduction="batchmean")(logp, torch.tensor([[1.0, 0.0]])).backward()
        >>> logp.grad
        tensor([[-1., 0.]])
    """

    _config = ("reduction", "log_target")
    _reductions = KL_REDUCTIONS
    _function = staticmethod(SF.kl_div)

    def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean",
                 log_target: bool = False) -> None:
        reduction, log_target = check_kl_div_args(
            "KLDivLoss", legacy_reduction(size_average, reduce, reduction), log_target)
        super().__init__(reduction=reduction, log_target=log_target)


class LogCoshLoss(_Loss):
    r"""``log(cosh(input - target))`` without overflow, gradient ``tanh(r)``.

    See [`log_cosh_loss`][stablelosses.functional.log_cosh_loss].

    Args:
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> x = torch.tensor([1000.0], requires_grad=True)
        >>> sl.LogCoshLoss()(x, torch.zeros(1))
        tensor(999.3068, grad_fn=...)
    """

    _config = ("reduction",)
    _function = staticmethod(SF.log_cosh_loss)

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)


class InfoNCELoss(_Loss):
    r"""In-batch InfoNCE / NT-Xent (SimCLR) or, with ``symmetric=True``, the CLIP loss.

    See [`info_nce_loss`][stablelosses.functional.info_nce_loss]: cosine-similarity logits over
    ``temperature``, positives on the diagonal; a zero embedding gets gradient 0.

    Args:
        temperature: $\tau > 0$. Default: ``0.07``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        symmetric: average both directions (CLIP). Default: ``False``.

    Example:
        >>> import torch, stablelosses as sl
        >>> q = torch.zeros(3, 4, requires_grad=True)
        >>> sl.InfoNCELoss(symmetric=True)(q, torch.zeros(3, 4))
        tensor(1.0986, grad_fn=<...>)
    """

    _config = ("temperature", "reduction", "symmetric")
    _function = staticmethod(SF.info_nce_loss)

    def __init__(self, temperature: float = 0.07, reduction: str = "mean", symmetric: bool = False) -> None:
        temperature, reduction, symmetric = check_info_nce_args(
            "InfoNCELoss", temperature, reduction, symmetric)
        super().__init__(temperature=temperature, reduction=reduction, symmetric=symmetric)

    def forward(self, query: Tensor, key: Tensor, mask: Tensor | None = None) -> Tensor:
        return self._function(query, key, mask=mask, **self._options())


class DiceLoss(_Loss):
    r"""Soft Dice loss on probabilities; both empty gives 0 with gradient 0.

    See [`dice_loss`][stablelosses.functional.dice_loss].

    Args:
        dims: dimension(s) summed per sample. Default: ``None`` (all but dim 0).
        smooth: added to numerator and denominator (smp / MONAI). Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> p = torch.zeros(2, 1, 4, 4, requires_grad=True)
        >>> sl.DiceLoss()(p, torch.zeros(2, 1, 4, 4))
        tensor(0., grad_fn=<...>)
    """

    _config = ("dims", "smooth", "reduction")
    _function = staticmethod(SF.dice_loss)

    def __init__(self, dims: int | tuple[int, ...] | list[int] | None = None, smooth: float = 0.0,
                 reduction: str = "mean") -> None:
        reduction, smooth = check_dice_args("DiceLoss", dims, reduction, smooth)
        super().__init__(dims=dims, smooth=smooth, reduction=reduction)


_OLD_MODULE = (
    "{cls}({old}) without in_features and num_classes is deprecated and will be removed in the next "
    "version: the module now takes torch.nn.LinearCrossEntropyLoss's constructor, "
    "{cls}(in_features, num_classes, *, bias=False, ...), owns its output layer as .linear and is "
    "called as loss_fn(input, target). For tied or shared weights call "
    "stablelosses.functional.{fn}(input, W, target, linear_bias=b, ...) instead."
)


class _LinearLoss(_WeightedLoss):
    """The fused output-layer losses: own an ``nn.Linear`` (``.linear``), as torch's
    ``nn.LinearCrossEntropyLoss``; ``weight`` is the per-class weight buffer.

    Built without ``in_features``/``num_classes`` (the old spelling, deprecated), the module
    owns no layer and is called as ``loss_fn(input, weight, target, bias=None, mask=None)``.
    """

    _fn_name: str
    _legacy_positional: tuple[str, ...]

    @staticmethod
    def _out_features(name: str, out_features: Any) -> tuple[int, ...]:
        """``out_features`` as a tuple of ints >= 0 (torch's ``(d_1, ..., d_K)``; ``()``: none)."""
        try:
            dims = tuple(out_features)
        except TypeError:
            dims = None
        if dims is None or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise TypeError(f"{name}: out_features must be a tuple of ints >= 0, got {out_features!r}")
        return dims

    def __init__(
        self, in_features: Any, num_classes: Any, legacy: tuple[Any, ...], *, out_features: tuple[int, ...],
        bias: bool, device: Any, dtype: Any, weight: Tensor | None, **config: Any,
    ) -> None:
        name = type(self).__name__
        old = legacy or num_classes is None or in_features is None or isinstance(num_classes, str)
        if old:
            given = (in_features, num_classes, *legacy)
            positional = [v for v in given if v is not None]
            if len(positional) > len(self._legacy_positional):
                raise TypeError(f"{name}: too many positional arguments")
            for key, value in zip(self._legacy_positional, given):
                if value is not None:
                    config[key] = value
            warnings.warn(
                _OLD_MODULE.format(cls=name, fn=self._fn_name, old=", ".join(map(repr, positional))),
                DeprecationWarning, stacklevel=3,
            )
        # ignore_index stays as given, None included: as torch's module, the function maps None
        # to -100 for class-index targets and requires it with probability targets
        super().__init__(weight, **config)
        self.linear: nn.Linear | None = None
        self.in_features: int | None = None
        self.num_classes: int | None = None
        self.out_features: tuple[int, ...] = ()
        if old:
            if tuple(out_features) != ():
                raise TypeError(f"{name}: out_features needs in_features and num_classes (torch's "
                                "constructor)")
            # the old call: loss_fn(input, weight, target, bias=None, mask=None)
            self.forward = self._legacy_forward  # type: ignore[method-assign, assignment]
            return
        for arg, value in (("in_features", in_features), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"{name}: {arg} must be an int >= 0, got {value!r}")
        dims = self._out_features(name, out_features)
        if weight is not None and tuple(weight.shape) != (num_classes,):
            raise RuntimeError(
                f"{name}: weight must have shape ({num_classes},) (one weight per class): expected weight "
                f"shape to be {(num_classes,)}, got {tuple(weight.shape)}"
            )
        self.in_features, self.num_classes, self.out_features = in_features, num_classes, dims
        # torch's storage: a 2-D nn.Linear with num_classes * prod(out_features) outputs, reshaped
        # to (num_classes, *out_features, in_features) in forward (state_dicts are interchangeable)
        self.linear = nn.Linear(in_features, num_classes * math.prod(dims), bias=bias, device=device,
                                dtype=dtype)

    def forward(self, input: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        assert self.linear is not None and self.num_classes is not None
        w: Tensor = self.linear.weight
        b: Tensor | None = self.linear.bias
        if self.out_features:  # K-dimensional: the function's unfused path (see its docstring)
            w = w.reshape(self.num_classes, *self.out_features, w.shape[-1])
            b = None if b is None else b.reshape(self.num_classes, *self.out_features)
        return self._function(input, w, target, linear_bias=b, mask=mask, **self._options())

    def _legacy_forward(
        self, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        return self._function(input, weight, target, linear_bias=bias, mask=mask, **self._options())

    def extra_repr(self) -> str:
        layer = (
            "" if self.linear is None else
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
        )
        return layer + super().extra_repr()


class LinearCrossEntropyLoss(_LinearLoss):
    r"""Fused output layer + cross-entropy that never holds the ``(N, V)`` logits.

    torch's ``nn.LinearCrossEntropyLoss`` constructor: owns ``nn.Linear(in_features,
    num_classes, bias=bias)`` as ``.linear`` and is called as ``loss_fn(input, target,
    mask=None)``. For tied or shared weights use the functional form,
    [`linear_cross_entropy`][stablelosses.functional.linear_cross_entropy], which takes the
    matrix. Built without ``in_features``/``num_classes`` (the 0.3 spelling) it warns
    (``DeprecationWarning``), owns no layer and keeps the old call
    ``loss_fn(input, W, target, bias=None)``.

    Args:
        in_features: the layer's input size ``H`` (required; omitting it is the deprecated form).
        num_classes: the vocabulary size ``V`` (required).
        out_features: ``(d_1, ..., d_K)`` for torch's K-dimensional loss: as in torch,
            ``.linear`` has ``num_classes·d_1···d_K`` outputs (stored flat, so state_dicts are
            interchangeable with torch's), reshaped in ``forward`` to a
            ``(num_classes, d_1, ..., d_K, in_features)`` weight; input ``(N, in_features)``,
            target ``(N, d_1, ..., d_K)`` or probabilities ``(N, num_classes, d_1, ..., d_K)``.
            Computed exactly by the function's **unfused** fallback (the logits are held
            whole; every hazard handled as in ``cross_entropy``), not by the chunk loop.
            Default: ``()``.
        bias: whether ``.linear`` has a bias. Default: ``False``.
        device: of ``.linear``'s parameters. Default: ``None``.
        dtype: of ``.linear``'s parameters. Default: ``None``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        weight: per-class weights ``(num_classes,)`` (a buffer) or ``None``.
        ignore_index: target value that is ignored, or ``None`` (torch's default): -100 with
            class-index targets, and with probability targets (the logits' shape, floating
            point; unfused) it must be ``None``, as torch. Kept as given (``.ignore_index``).
            Default: ``None``.
        label_smoothing: smoothing in ``[0, 1]`` over the unmasked classes. Default: ``0.0``.
        options: ``None`` or a ``torch.nn.LinearCrossEntropyOptions`` (see the function).
        z_loss: coefficient of ``logsumexp(logits)²`` per kept row. Default: ``0.0``.
        softcap: ``c`` of ``c·tanh(logits / c)``, or ``None``. Default: ``None``.
        chunk_size: rows per chunk, or ``None`` (automatic). Default: ``None``.

    Example:
        >>> import torch, stablelosses as sl
        >>> loss_fn = sl.LinearCrossEntropyLoss(8, 100, bias=True, z_loss=1e-4)
        >>> loss = loss_fn(torch.randn(16, 8), torch.randint(0, 100, (16,)))
        >>> loss.backward()
        >>> loss_fn.linear.weight.grad.shape
        torch.Size([100, 8])
    """

    _config = ("reduction", "ignore_index", "label_smoothing", "options", "z_loss", "softcap", "chunk_size")
    _function = staticmethod(SF.linear_cross_entropy)
    _fn_name = "linear_cross_entropy"
    _legacy_positional = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "chunk_size")

    def __init__(
        self, in_features: int | None = None, num_classes: int | None = None, *legacy: Any,
        out_features: tuple[int, ...] = (), bias: bool = False, device: Any = None, dtype: Any = None,
        reduction: str = "mean", weight: Tensor | None = None, ignore_index: int | None = None,
        label_smoothing: float = 0.0, options: Any = None, z_loss: float = 0.0, softcap: float | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            in_features, num_classes, legacy, out_features=out_features, bias=bias, device=device,
            dtype=dtype, weight=weight, reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, options=options, z_loss=z_loss, softcap=softcap,
            chunk_size=chunk_size,
        )
        check_label_smoothing("LinearCrossEntropyLoss", self.label_smoothing)
        check_linear_options("LinearCrossEntropyLoss", _ignore(self.ignore_index), self.z_loss, self.softcap,
                             self.chunk_size)


def _ignore(ignore_index: object) -> object:
    """``ignore_index`` as the function reads it for class-index targets (``None``: -100)."""
    return -100 if ignore_index is None else ignore_index


def _with_gamma(names: tuple[str, ...]) -> tuple[str, ...]:
    """`LinearCrossEntropyLoss`'s argument names as `LinearFocalLoss` takes them: ``gamma`` first,
    no ``label_smoothing``."""
    return ("gamma", *(name for name in names if name != "label_smoothing"))


class LinearFocalLoss(_LinearLoss):
    r"""Fused output layer + multi-class focal loss that never holds the ``(N, V)`` logits.

    The constructor of [`LinearCrossEntropyLoss`][stablelosses.LinearCrossEntropyLoss] with
    ``gamma`` and without ``label_smoothing``; owns ``.linear`` and is called as
    ``loss_fn(input, target, mask=None)``. See
    [`linear_focal_loss`][stablelosses.functional.linear_focal_loss] (which takes the matrix,
    for tied weights). Built without ``in_features``/``num_classes`` it warns
    (``DeprecationWarning``) and keeps the old call ``loss_fn(input, W, target, bias=None)``.

    Args:
        gamma: focusing parameter, ``>= 0``. Default: ``2.0``.

    Every other argument (``in_features``, ``num_classes``, ``out_features``, ``bias``,
    ``device``, ``dtype``, ``reduction``, ``weight``, ``ignore_index``, ``options``, ``z_loss``,
    ``softcap``, ``chunk_size``) is as in ``LinearCrossEntropyLoss``.

    Example:
        >>> import torch, stablelosses as sl
        >>> loss_fn = sl.LinearFocalLoss(8, 50, gamma=0.5)
        >>> loss_fn(torch.randn(4, 8), torch.tensor([1, 2, 3, 4])).backward()
        >>> bool(torch.isfinite(loss_fn.linear.weight.grad).all())
        True
    """

    _config = _with_gamma(LinearCrossEntropyLoss._config)
    _function = staticmethod(SF.linear_focal_loss)
    _fn_name = "linear_focal_loss"
    _legacy_positional = _with_gamma(LinearCrossEntropyLoss._legacy_positional)

    def __init__(
        self, in_features: int | None = None, num_classes: int | None = None, *legacy: Any,
        out_features: tuple[int, ...] = (), bias: bool = False, device: Any = None, dtype: Any = None,
        reduction: str = "mean", weight: Tensor | None = None, ignore_index: int | None = None,
        options: Any = None, gamma: float = 2.0, z_loss: float = 0.0, softcap: float | None = None,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            in_features, num_classes, legacy, out_features=out_features, bias=bias, device=device,
            dtype=dtype, weight=weight, reduction=reduction, ignore_index=ignore_index, options=options,
            gamma=gamma, z_loss=z_loss, softcap=softcap, chunk_size=chunk_size,
        )
        check_finite_nonnegative("LinearFocalLoss", "gamma", self.gamma)
        check_linear_options("LinearFocalLoss", _ignore(self.ignore_index), self.z_loss, self.softcap,
                             self.chunk_size)


# --- post-training (0.4): preference and policy losses -----------------------------------------
# Thin modules over stablelosses.functional: the configuration is checked at construction with
# the function's own spec (the same messages, naming the class), stored as plain attributes
# (``repr`` shows them) and passed to the function in ``forward``.

from stablelosses.functional._policy import check_policy_args  # noqa: E402
from stablelosses.functional._preference import (  # noqa: E402
    check_cpo_args,
    check_dpo_options,
    check_kto_args,
    check_orpo_args,
    check_simpo_args,
)


class _ConfiguredLoss(nn.Module):
    """A module whose ``forward`` is one call of ``_function`` with the stored ``_config``; a
    subclass's ``__init__`` passes on its arguments as its function's check returns them."""

    _config: tuple[str, ...] = ()
    _function: Callable[..., Tensor]

    def __init__(self, values: Sequence[Any]) -> None:
        super().__init__()
        for name, value in zip(self._config, values):
            setattr(self, name, value)

    def _options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._config)


class DPOLoss(_ConfiguredLoss):
    r"""Direct Preference Optimization (and robust, hinge, IPO, APO) on per-sequence log-probs.

    Called as ``loss_fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)``.
    See [`dpo_loss`][stablelosses.functional.dpo_loss] for the formulas.

    Args:
        beta: ``>= 0`` (``> 0`` for ``'ipo'``). Default: ``0.1``.
        loss_type: ``'sigmoid'``, ``'robust'``, ``'hinge'``, ``'ipo'``, ``'apo_zero'`` or
            ``'apo_down'``. Default: ``'sigmoid'``.
        label_smoothing: in ``[0, 1]`` (``< 0.5`` for ``'robust'``). Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> loss_fn = sl.DPOLoss(beta=0.5)
        >>> loss_fn
        DPOLoss(beta=0.5, loss_type='sigmoid', label_smoothing=0.0, reduction='mean')
        >>> c = torch.tensor([-1e4], requires_grad=True)
        >>> loss_fn(c, torch.zeros(1), torch.zeros(1), torch.zeros(1)).backward(); c.grad
        tensor([-0.5000])
    """

    _config = ("beta", "loss_type", "label_smoothing", "reduction")
    _function = staticmethod(SF.dpo_loss)

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 reduction: str = "mean") -> None:
        super().__init__(check_dpo_options("DPOLoss", beta, loss_type, label_smoothing, reduction))

    def forward(self, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
                ref_rejected_logps: Tensor) -> Tensor:
        return self._function(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                              **self._options())


class _PairLoss(_ConfiguredLoss):
    """``loss_fn(chosen_logps, rejected_logps)``."""

    def forward(self, chosen_logps: Tensor, rejected_logps: Tensor) -> Tensor:
        return self._function(chosen_logps, rejected_logps, **self._options())


class ORPOLoss(_PairLoss):
    r"""ORPO's odds-ratio term on length-averaged log-probs, with an exact ``log1mexp``.

    Called as ``loss_fn(chosen_logps, rejected_logps)``; see
    [`orpo_loss`][stablelosses.functional.orpo_loss].

    Args:
        beta: ``>= 0``. Default: ``0.1``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> sl.ORPOLoss(beta=0.2)
        ORPOLoss(beta=0.2, reduction='mean')
    """

    _config = ("beta", "reduction")
    _function = staticmethod(SF.orpo_loss)

    def __init__(self, beta: float = 0.1, reduction: str = "mean") -> None:
        super().__init__(check_orpo_args("ORPOLoss", beta, reduction))


class SimPOLoss(_PairLoss):
    r"""SimPO on length-averaged log-probs.

    Called as ``loss_fn(chosen_logps, rejected_logps)``; see
    [`simpo_loss`][stablelosses.functional.simpo_loss].

    Args:
        beta: ``>= 0``. Default: ``2.0``.
        gamma_beta_ratio: the target margin over ``beta``. Default: ``0.5``.
        label_smoothing: in ``[0, 1]``. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import stablelosses as sl
        >>> sl.SimPOLoss()
        SimPOLoss(beta=2.0, gamma_beta_ratio=0.5, label_smoothing=0.0, reduction='mean')
    """

    _config = ("beta", "gamma_beta_ratio", "label_smoothing", "reduction")
    _function = staticmethod(SF.simpo_loss)

    def __init__(self, beta: float = 2.0, gamma_beta_ratio: float = 0.5, label_smoothing: float = 0.0,
                 reduction: str = "mean") -> None:
        super().__init__(check_simpo_args("SimPOLoss", beta, gamma_beta_ratio, label_smoothing, reduction))


class CPOLoss(_PairLoss):
    r"""CPO's preference term.

    Called as ``loss_fn(chosen_logps, rejected_logps)``; see
    [`cpo_loss`][stablelosses.functional.cpo_loss].

    Args:
        beta: ``>= 0``. Default: ``0.1``.
        label_smoothing: in ``[0, 1]``. Default: ``0.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import stablelosses as sl
        >>> sl.CPOLoss(beta=0.5)
        CPOLoss(beta=0.5, label_smoothing=0.0, reduction='mean')
    """

    _config = ("beta", "label_smoothing", "reduction")
    _function = staticmethod(SF.cpo_loss)

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0, reduction: str = "mean") -> None:
        super().__init__(check_cpo_args("CPOLoss", beta, label_smoothing, reduction))


class KTOLoss(_ConfiguredLoss):
    r"""KTO on per-sequence log-probs of unpaired examples.

    Called as ``loss_fn(policy_logps, ref_logps, desirable, kl=0.0)`` (``kl``: the detached
    reference point of this batch); see [`kto_loss`][stablelosses.functional.kto_loss].

    Args:
        beta: ``>= 0``. Default: ``0.1``.
        desirable_weight: ``>= 0``. Default: ``1.0``.
        undesirable_weight: ``>= 0``. Default: ``1.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import stablelosses as sl
        >>> sl.KTOLoss(undesirable_weight=1.33)
        KTOLoss(beta=0.1, desirable_weight=1.0, undesirable_weight=1.33, reduction='mean')
        >>> import torch
        >>> policy, ref = torch.tensor([-10.0, -12.0]), torch.tensor([-11.0, -11.0])
        >>> sl.KTOLoss(beta=1.0)(policy, ref, torch.tensor([True, False]), kl=0.0)  # σ(-1) each
        tensor(0.2689)
    """

    _config = ("beta", "desirable_weight", "undesirable_weight", "reduction")
    _function = staticmethod(SF.kto_loss)

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reduction: str = "mean") -> None:
        super().__init__(check_kto_args("KTOLoss", beta, desirable_weight, undesirable_weight, reduction))

    def forward(self, policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor,
                kl: float | Tensor = 0.0) -> Tensor:
        return self._function(policy_logps, ref_logps, desirable, kl=kl, **self._options())


class PolicyLoss(_ConfiguredLoss):
    r"""PPO's clipped surrogate (GRPO / GSPO importance, TRL's aggregations, optional ref KL).

    Called as ``loss_fn(logps, old_logps, advantages, mask, ref_logps=None, normalizer=None)``
    (``normalizer`` per call: the token count of this step); see
    [`policy_loss`][stablelosses.functional.policy_loss].

    Args:
        clip_eps: in ``[0, 1)``. Default: ``0.2``.
        clip_eps_high: ``None`` (= ``clip_eps``) or ``>= 0``. Default: ``None``.
        importance: ``'token'`` | ``'sequence'``. Default: ``'token'``.
        loss_type: ``'grpo'`` | ``'bnpo'`` | ``'dr_grpo'`` | ``'dapo'``. Default: ``'grpo'``.
        beta: the KL coefficient, ``>= 0``. Default: ``0.0``.
        kl_estimator: ``'k1'`` | ``'k2'`` | ``'k3'``. Default: ``'k3'``.

    Example:
        >>> import stablelosses as sl
        >>> sl.PolicyLoss(clip_eps_high=0.28, loss_type="dapo")
        PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, importance='token', loss_type='dapo', beta=0.0,
        kl_estimator='k3')
    """

    _config = ("clip_eps", "clip_eps_high", "importance", "loss_type", "beta", "kl_estimator")
    _function = staticmethod(SF.policy_loss)

    def __init__(self, clip_eps: float = 0.2, clip_eps_high: float | None = None, importance: str = "token",
                 loss_type: str = "grpo", beta: float = 0.0, kl_estimator: str = "k3") -> None:
        values = check_policy_args("PolicyLoss", clip_eps, clip_eps_high, importance, loss_type, beta,
                                   kl_estimator, None)
        super().__init__(values[:-1])

    def forward(self, logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor,
                ref_logps: Tensor | None = None, normalizer: float | Tensor | None = None) -> Tensor:
        return self._function(logps, old_logps, advantages, mask, ref_logps=ref_logps, normalizer=normalizer,
                              **self._options())


# --- distillation (0.4) -------------------------------------------------------------------------


class DistillationLoss(_Loss):
    r"""Distillation divergence between student and teacher logits, exact with ``-inf`` logits.

    See [`distillation_loss`][stablelosses.functional.distillation_loss] for the formulas and
    the ``-inf`` contract. Called as ``loss_fn(student_logits, teacher_logits, mask=None,
    normalizer=None)``.

    Args:
        kind: ``'forward_kl'`` | ``'reverse_kl'`` | ``'jsd'`` | ``'tvd'``. Default: ``'forward_kl'``.
        beta: the JSD interpolation in ``[0, 1]``. Default: ``0.5``.
        temperature: divides both logits (no ``T²`` factor). Default: ``1.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.

    Example:
        >>> import torch, stablelosses as sl
        >>> s = torch.tensor([[1.0, float("-inf")]], requires_grad=True)
        >>> sl.DistillationLoss(kind="jsd")(s, torch.tensor([[0.0, float("-inf")]])).backward()
        >>> s.grad
        tensor([[0., 0.]])
    """

    _config = ("kind", "beta", "temperature", "reduction")

    def __init__(self, kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                 reduction: str = "mean") -> None:
        from stablelosses.functional._distillation import check_distillation_args

        # the checked values (Python numbers: a tensor or NumPy scalar is read once, here)
        kind, beta, temperature, reduction, _ = check_distillation_args(
            "DistillationLoss", kind, beta, temperature, reduction, None)
        super().__init__(kind=kind, beta=beta, temperature=temperature, reduction=reduction)

    def forward(self, student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None,
                normalizer: float | Tensor | None = None) -> Tensor:
        return SF.distillation_loss(student_logits, teacher_logits, mask=mask, normalizer=normalizer,
                                    **self._options())


class LinearDistillationLoss(_Loss):
    r"""Fused distillation from both models' hidden states; neither ``(N, V)`` is held.

    See [`linear_distillation_loss`][stablelosses.functional.linear_distillation_loss]. Called
    as ``loss_fn(student_input, student_weight, teacher_input, teacher_weight,
    student_bias=None, teacher_bias=None, mask=None, normalizer=None)`` (the weights are the
    models' own output layers, passed in, as tied embeddings often are).

    Args:
        kind: as in [`DistillationLoss`][stablelosses.DistillationLoss]. Default: ``'forward_kl'``.
        beta: the JSD interpolation in ``[0, 1]``. Default: ``0.5``.
        temperature: divides both logits. Default: ``1.0``.
        reduction: ``'none'`` | ``'mean'`` | ``'sum'``. Default: ``'mean'``.
        chunk_size: rows per chunk (``None``: the engine's default). Default: ``None``.

    Example:
        >>> import torch, stablelosses as sl
        >>> ws = torch.randn(20, 4, requires_grad=True)
        >>> loss = sl.LinearDistillationLoss(kind="tvd")(torch.randn(3, 4), ws, torch.randn(3, 6),
        ...                                               torch.randn(20, 6))
        >>> loss.backward()
        >>> ws.grad.shape
        torch.Size([20, 4])
    """

    _config = ("kind", "beta", "temperature", "reduction", "chunk_size")

    def __init__(self, kind: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                 reduction: str = "mean", chunk_size: int | None = None) -> None:
        from stablelosses._spec import check_chunk_size
        from stablelosses.functional._distillation import check_distillation_args

        kind, beta, temperature, reduction, _ = check_distillation_args(
            "LinearDistillationLoss", kind, beta, temperature, reduction, None)
        chunk_size = check_chunk_size("LinearDistillationLoss", chunk_size)
        super().__init__(kind=kind, beta=beta, temperature=temperature, reduction=reduction,
                         chunk_size=chunk_size)

    def forward(self, student_input: Tensor, student_weight: Tensor, teacher_input: Tensor,  # type: ignore[override]
                teacher_weight: Tensor, student_bias: Tensor | None = None,
                teacher_bias: Tensor | None = None, mask: Tensor | None = None,
                normalizer: float | Tensor | None = None) -> Tensor:
        return SF.linear_distillation_loss(
            student_input, student_weight, teacher_input, teacher_weight, student_bias=student_bias,
            teacher_bias=teacher_bias, mask=mask, normalizer=normalizer, **self._options())


# ---------------------------------------------------------------- every torch.nn loss (0.4)
# Each class below is torch's own class (constructor, buffers, state_dict keys, repr, pickling)
# with a forward that calls the stablelosses function of the same name. The math and the
# defined gradients are documented once, on those functions.


class L1Loss(nn.L1Loss):
    """``nn.L1Loss`` calling [`l1_loss`][stablelosses.functional.l1_loss] (torch's computation)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.l1_loss(input, target, reduction=self.reduction)


class MSELoss(nn.MSELoss):
    """``nn.MSELoss`` calling [`mse_loss`][stablelosses.functional.mse_loss] (torch's computation)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.mse_loss(input, target, reduction=self.reduction)


class HuberLoss(nn.HuberLoss):
    """``nn.HuberLoss`` calling [`huber_loss`][stablelosses.functional.huber_loss] (torch's computation)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class SmoothL1Loss(nn.SmoothL1Loss):
    """``nn.SmoothL1Loss`` calling [`smooth_l1_loss`][stablelosses.functional.smooth_l1_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class PoissonNLLLoss(nn.PoissonNLLLoss):
    """``nn.PoissonNLLLoss`` calling [`poisson_nll_loss`][stablelosses.functional.poisson_nll_loss]."""

    def forward(self, log_input: Tensor, target: Tensor) -> Tensor:
        return SF.poisson_nll_loss(log_input, target, log_input=self.log_input, full=self.full, eps=self.eps,
                                   reduction=self.reduction)


class GaussianNLLLoss(nn.GaussianNLLLoss):
    """``nn.GaussianNLLLoss`` whose variance floor has gradient 0 below ``eps``; see
    [`gaussian_nll_loss`][stablelosses.functional.gaussian_nll_loss].

    Example:
        >>> import torch, stablelosses as sl
        >>> var = torch.tensor([1e-12], requires_grad=True)
        >>> sl.GaussianNLLLoss()(torch.tensor([1.0]), torch.tensor([0.0]), var).backward()
        >>> var.grad
        tensor([0.])
    """

    def forward(self, input: Tensor, target: Tensor, var: Tensor | float) -> Tensor:
        return SF.gaussian_nll_loss(input, target, var, full=self.full, eps=self.eps,
                                    reduction=self.reduction)


class BCELoss(nn.BCELoss):
    """``nn.BCELoss`` calling [`binary_cross_entropy`][stablelosses.functional.binary_cross_entropy]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(nn.BCEWithLogitsLoss):
    """``nn.BCEWithLogitsLoss`` exact at ±inf logits (``weight`` and ``pos_weight`` buffers as
    torch's); see
    [`binary_cross_entropy_with_logits`][stablelosses.functional.binary_cross_entropy_with_logits].

    Example:
        >>> import torch, stablelosses as sl
        >>> x = torch.tensor([float("inf"), float("-inf")], requires_grad=True)
        >>> sl.BCEWithLogitsLoss(reduction="sum")(x, torch.tensor([1.0, 0.0]))
        tensor(0., grad_fn=<SumBackward0>)
    """

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.binary_cross_entropy_with_logits(input, target, self.weight, pos_weight=self.pos_weight,
                                                   reduction=self.reduction)


class CTCLoss(nn.CTCLoss):
    """``nn.CTCLoss`` whose impossible samples get gradient exactly 0; see
    [`ctc_loss`][stablelosses.functional.ctc_loss]."""

    def forward(self, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                target_lengths: Tensor) -> Tensor:
        return SF.ctc_loss(log_probs, targets, input_lengths, target_lengths, self.blank, self.reduction,
                           self.zero_infinity)


class CosineEmbeddingLoss(nn.CosineEmbeddingLoss):
    """``nn.CosineEmbeddingLoss`` whose zero vectors get gradient 0; see
    [`cosine_embedding_loss`][stablelosses.functional.cosine_embedding_loss]."""

    def forward(self, input1: Tensor, input2: Tensor, target: Tensor) -> Tensor:
        return SF.cosine_embedding_loss(input1, input2, target, margin=self.margin, reduction=self.reduction)


class HingeEmbeddingLoss(nn.HingeEmbeddingLoss):
    """``nn.HingeEmbeddingLoss`` calling
    [`hinge_embedding_loss`][stablelosses.functional.hinge_embedding_loss] (torch's computation)."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.hinge_embedding_loss(input, target, margin=self.margin, reduction=self.reduction)


class MarginRankingLoss(nn.MarginRankingLoss):
    """``nn.MarginRankingLoss`` calling
    [`margin_ranking_loss`][stablelosses.functional.margin_ranking_loss] (torch's computation)."""

    def forward(self, input1: Tensor, input2: Tensor, target: Tensor) -> Tensor:
        return SF.margin_ranking_loss(input1, input2, target, margin=self.margin, reduction=self.reduction)


class MultiMarginLoss(nn.MultiMarginLoss):
    """``nn.MultiMarginLoss`` with NaN in → NaN out; see
    [`multi_margin_loss`][stablelosses.functional.multi_margin_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.multi_margin_loss(input, target, p=self.p, margin=self.margin, weight=self.weight,
                                    reduction=self.reduction)


class MultiLabelMarginLoss(nn.MultiLabelMarginLoss):
    """``nn.MultiLabelMarginLoss`` with NaN in → NaN out; see
    [`multilabel_margin_loss`][stablelosses.functional.multilabel_margin_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.multilabel_margin_loss(input, target, reduction=self.reduction)


class MultiLabelSoftMarginLoss(nn.MultiLabelSoftMarginLoss):
    """``nn.MultiLabelSoftMarginLoss`` exact at ±inf scores; see
    [`multilabel_soft_margin_loss`][stablelosses.functional.multilabel_soft_margin_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.multilabel_soft_margin_loss(input, target, weight=self.weight, reduction=self.reduction)


class SoftMarginLoss(nn.SoftMarginLoss):
    """``nn.SoftMarginLoss`` without overflow at large margins (torch's value is ``inf`` once
    $-y x > 88.7$ in float32); see [`soft_margin_loss`][stablelosses.functional.soft_margin_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.soft_margin_loss(input, target, reduction=self.reduction)


class NLLLoss(nn.NLLLoss):
    """``nn.NLLLoss`` whose ``-inf`` log-probabilities at weightless entries add 0; see
    [`nll_loss`][stablelosses.functional.nll_loss]."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return SF.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                           reduction=self.reduction)


class TripletMarginLoss(nn.TripletMarginLoss):
    """``nn.TripletMarginLoss`` calling
    [`triplet_margin_loss`][stablelosses.functional.triplet_margin_loss]."""

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        return SF.triplet_margin_loss(anchor, positive, negative, margin=self.margin, p=self.p, eps=self.eps,
                                      swap=self.swap, reduction=self.reduction)


class TripletMarginWithDistanceLoss(nn.TripletMarginWithDistanceLoss):
    """``nn.TripletMarginWithDistanceLoss`` calling
    [`triplet_margin_with_distance_loss`][stablelosses.functional.triplet_margin_with_distance_loss]."""

    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        return SF.triplet_margin_with_distance_loss(anchor, positive, negative,
                                                    distance_function=self.distance_function,
                                                    margin=self.margin, swap=self.swap,
                                                    reduction=self.reduction)
