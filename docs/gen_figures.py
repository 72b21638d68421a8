"""Draw the hazard-catalog figures: the naive formula beside stablelosses, value and gradient.

Run at build time by ``docs/hooks.py`` (mkdocs ``on_pre_build``), or by hand:
``python docs/gen_figures.py [OUT_DIR]``. Every figure calls the real functions of
:mod:`stablelosses.functional`, so the pictures show what the installed code does.

Each figure sweeps one scalar ``x`` over the dangerous range. For every ``x`` a case builds
the inputs, runs the loss, and differentiates it with respect to one scalar leaf. Points where
the naive value or gradient is NaN or ±inf are drawn as red crosses on the upper edge of the
panel. Anything wrong on the stablelosses side (an exception, a non-finite point) is returned
as a problem string, which the mkdocs hook turns into a warning so that ``--strict`` fails.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

import stablelosses.functional as SF  # noqa: E402
from stablelosses import naive  # noqa: E402  (the naive formulas, written as people write them)

FIG_DIR = Path(__file__).resolve().parent / "figures"

NAIVE_COLOR = "tab:orange"
STABLE_COLOR = "tab:blue"
BAD_COLOR = "red"

# A case maps the swept value to (loss, leaf): the scalar loss and the scalar tensor it is
# differentiated with respect to.
CaseFn = Callable[[float], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Row:
    """One row of a figure: value panel and gradient panel for one setting."""

    title: str
    xs: np.ndarray
    xlabel: str
    naive: CaseFn
    stable: CaseFn
    naive_label: str
    stable_label: str
    value_label: str
    grad_label: str
    grad_sign: float = 1.0  # plot sign·gradient (e.g. −∂L/∂x on a log axis)
    singular: float | None = None  # x of the singular point, marked on the stable curve
    var: str = "x"  # name of the swept variable in the singular point's legend entry
    linthresh: float = 1.0  # linear range around 0 of a "symlog" axis
    xscale: str = "linear"
    value_scale: str = "linear"
    grad_scale: str = "linear"


@dataclass
class Figure:
    name: str
    rows: list[Row] = field(default_factory=list)


def _leaf(x: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, requires_grad=True)


def evaluate(fn: CaseFn, xs: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Value and gradient of ``fn`` at every ``x``, as float64 arrays."""
    values, grads = [], []
    for x in xs:
        loss, leaf = fn(float(x))
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        values.append(float(loss.detach().double()))
        # A loss that does not depend on the leaf is a bug in the case: show it as NaN.
        grads.append(float(grad.double()) if grad is not None else float("nan"))
    return np.asarray(values), np.asarray(grads)


def _nonfinite_label(ys: np.ndarray) -> str:
    bad = ys[~np.isfinite(ys)]
    has_nan, has_inf = np.isnan(bad).any(), np.isinf(bad).any()
    if has_nan and has_inf:
        return "naive: NaN / inf"
    return "naive: NaN" if has_nan else "naive: inf"


def _plot_panel(ax, row: Row, xs, naive_y, stable_y, ylabel: str, yscale: str) -> None:
    ax.set_xscale(row.xscale)
    ax.set_yscale(yscale, **({"linthresh": row.linthresh} if yscale == "symlog" else {}))
    ok = np.isfinite(naive_y)
    # NaN breaks the line, so the naive curve stops where it stops being finite.
    (naive_line,) = ax.plot(xs, np.where(ok, naive_y, np.nan), color=NAIVE_COLOR, lw=2.2,
                            ls="--", label=row.naive_label, zorder=3)
    handles = [naive_line]
    # Finite naive points with no finite neighbour draw no line segment: mark them.
    prev = np.concatenate([[False], ok[:-1]])
    nxt = np.concatenate([ok[1:], [False]])
    lone = ok & ~prev & ~nxt
    if lone.any():
        ax.plot(xs[lone], naive_y[lone], "o", color=NAIVE_COLOR, ms=6, zorder=4)
    if stable_y is not None:
        (h,) = ax.plot(xs, stable_y, color=STABLE_COLOR, lw=1.6, label=row.stable_label, zorder=2)
        handles.append(h)
        if row.singular is not None:
            i = int(np.argmin(np.abs(xs - row.singular)))
            h = ax.scatter([xs[i]], [stable_y[i]], s=36, color=STABLE_COLOR, edgecolor="black",
                           zorder=5, label=f"stablelosses at {row.var} = {row.singular:g} (defined)")
            handles.append(h)
    else:
        ax.text(0.5, 0.5, "stablelosses: not available", transform=ax.transAxes,
                ha="center", va="center", color="gray")
    if (~ok).any():
        # Non-finite naive points: red crosses on the upper edge, outside the data range.
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        bad = np.flatnonzero(~ok)
        step = -(-bad.size // 40)  # at most about 40 crosses, so the edge stays readable
        bad_x = xs[np.union1d(bad[::step], bad[[0, -1]])]
        ax.scatter(bad_x, np.full(bad_x.shape, 0.97), transform=trans, marker="x",
                   color=BAD_COLOR, s=40, lw=1.8, clip_on=False, zorder=6)
        handles.append(Line2D([], [], ls="none", marker="x", color=BAD_COLOR, markersize=7,
                              mew=1.8, label=_nonfinite_label(naive_y)))
    finite = [y[np.isfinite(y)] for y in (naive_y, stable_y) if y is not None]
    finite = np.concatenate(finite) if finite else np.array([])
    if yscale == "log":
        finite = finite[finite > 0]
    if finite.size:
        lo, hi = finite.min(), finite.max()
        if yscale == "log":
            ax.set_ylim(lo / 3, hi * 30)
        elif yscale == "symlog" and lo >= 0:
            ax.set_ylim(0, hi * 30)
        elif yscale == "linear":
            pad = 0.08 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.5
            ax.set_ylim(lo - pad, hi + 2.2 * pad)  # head room for the red crosses
    ax.set_xlabel(row.xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8,
              frameon=False)


def render(fig_spec: Figure, out_dir: Path) -> list[str]:
    """Draw one figure into ``out_dir/<name>.png``; return problems on the stablelosses side."""
    problems: list[str] = []
    nrows = len(fig_spec.rows)
    fig, axes = plt.subplots(nrows, 2, figsize=(11, 4.6 * nrows), squeeze=False)
    for (ax_v, ax_g), row in zip(axes, fig_spec.rows):
        xs = np.asarray(row.xs, dtype=np.float64)
        naive_v, naive_g = evaluate(row.naive, xs)
        try:
            stable_v, stable_g = evaluate(row.stable, xs)
        except Exception as exc:  # noqa: BLE001  (any failure is reported: --strict then fails)
            stable_v = stable_g = None
            problems.append(f"{fig_spec.name} [{row.title}]: stablelosses raised "
                            f"{type(exc).__name__}: {exc}".rstrip(": "))
        else:
            for what, ys in (("value", stable_v), ("gradient", stable_g)):
                if not np.isfinite(ys).all():
                    where = xs[~np.isfinite(ys)]
                    problems.append(f"{fig_spec.name} [{row.title}]: stablelosses {what} is "
                                    f"not finite at {where.size} points, first x = {where[0]:g}")
        _plot_panel(ax_v, row, xs, naive_v, stable_v, row.value_label, row.value_scale)
        _plot_panel(ax_g, row, xs, row.grad_sign * naive_g,
                    None if stable_g is None else row.grad_sign * stable_g,
                    row.grad_label, row.grad_scale)
        ax_v.set_title(f"{row.title}: value", fontsize=10)
        ax_g.set_title(f"{row.title}: gradient", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{fig_spec.name}.png", dpi=100)
    plt.close(fig)
    return problems


def _with_zero(xs: np.ndarray) -> np.ndarray:
    return np.union1d(xs, [0.0])


# ----------------------------------------------------------------------------------------
# The figures, one per hazard page.


def figures() -> list[Figure]:
    inf = float("inf")
    figs: list[Figure] = []

    # --- sqrt at 0: RMSE of a zero residual ------------------------------------------------
    target = torch.tensor([0.3, -1.2, 2.0, 0.7])

    def rmse_case(loss_fn):
        def case(r):
            leaf = _leaf(r)
            return loss_fn(target + leaf, target), leaf
        return case

    figs.append(Figure("sqrt-at-zero", [Row(
        "RMSE, residual r on all 4 elements", _with_zero(np.linspace(-1, 1, 201)),
        "residual r = input − target",
        rmse_case(naive.sqrt_mse),
        rmse_case(SF.rmse_loss),
        "naive: torch.sqrt(nn.MSELoss()(x, y))", "stablelosses: rmse_loss(x, y)",
        "loss", "∂loss/∂r", singular=0.0, var="r")]))

    # --- division by zero --------------------------------------------------------------------
    def div_case(fn):
        def case(b):
            leaf = _leaf(b)
            return fn(torch.tensor(1.0), leaf), leaf
        return case

    figs.append(Figure("division-by-zero", [Row(
        "a / b with a = 1", _with_zero(np.linspace(-1, 1, 201)), "denominator b",
        div_case(naive.where_div),
        div_case(SF.safe_div),
        "naive: torch.where(b != 0, a / b, 0)", "stablelosses: safe_div(a, b)",
        "a / b (0 where b = 0)", "∂/∂b", singular=0.0, var="b",
        value_scale="symlog", grad_scale="symlog")]))

    # --- softmax / logsumexp overflow and fully masked rows ---------------------------------
    def lse_case(fn):
        def case(x):
            leaf = _leaf(x)
            return fn(torch.stack([leaf, torch.tensor(1.0), torch.tensor(0.0)])), leaf
        return case

    def masked_softmax_case(fn):
        # Row 0 keeps two entries, row 1 is fully masked (padding). The rows are then mixed,
        # as the next layer of an attention block mixes positions.
        mask = torch.tensor([[True, False, True], [False, False, False]])
        w = torch.tensor([1.0, 2.0, 3.0])

        def case(x):
            leaf = _leaf(x)
            logits = torch.stack([leaf, torch.tensor(0.5), torch.tensor(-1.0)]).expand(2, 3)
            return ((fn(logits, mask).sum(0) * w) ** 2).sum(), leaf
        return case

    figs.append(Figure("softmax-logsumexp", [
        Row("logsumexp([x, 1, 0])", np.linspace(0, 200, 201), "logit x",
            lse_case(lambda z: naive.exp_logsumexp(z, 0)),
            lse_case(lambda z: SF.logsumexp(z, 0)),
            "naive: torch.log(torch.exp(z).sum())", "stablelosses: logsumexp(z, 0)",
            "log Σ exp z", "∂/∂x  (= softmax(z)₀)"),
        Row("softmax with a fully masked row", np.linspace(-5, 5, 201), "logit x",
            masked_softmax_case(
                lambda z, m: naive.masked_softmax(z, m, -1)),
            masked_softmax_case(lambda z, m: SF.softmax(z, -1, mask=m)),
            "naive: torch.softmax(z.masked_fill(~mask, -inf), -1)",
            "stablelosses: softmax(z, -1, mask=mask)",
            "Σⱼ (wⱼ Σᵣ softmax(z)ᵣⱼ)²", "∂/∂x"),
    ]))

    # --- log 0 in the classic focal loss ------------------------------------------------------
    def focal_case(fn, target_class, gamma):
        t = torch.tensor([target_class])

        def case(d):
            leaf = _leaf(d)
            logits = torch.stack([torch.tensor(10.0), 10.0 - leaf])[None]
            return fn(logits, t, gamma), leaf
        return case

    def sl_focal(logits, t, gamma):
        return SF.focal_loss(logits, t, gamma=gamma)

    gaps = np.linspace(0, 250, 251)
    figs.append(Figure("focal-log-zero", [
        Row("γ = 2, target = confident class", gaps, "logit gap d  (logits [10, 10 − d])",
            focal_case(naive.classic_focal, 0, 2.0), focal_case(sl_focal, 0, 2.0),
            "naive: softmax → log FocalLoss", "stablelosses: focal_loss(gamma=2)",
            "loss", "∂loss/∂d"),
        Row("γ = 2, target = unlikely class", gaps, "logit gap d  (logits [10, 10 − d])",
            focal_case(naive.classic_focal, 1, 2.0), focal_case(sl_focal, 1, 2.0),
            "naive: softmax → log FocalLoss", "stablelosses: focal_loss(gamma=2)",
            "loss", "∂loss/∂d"),
    ]))

    # --- focal with gamma < 1 as p_t → 1 ------------------------------------------------------
    def focal_gap_case(fn, gamma):
        t = torch.tensor([0])

        def case(d):
            leaf = _leaf(d)
            return fn(torch.stack([leaf, torch.tensor(0.0)])[None], t, gamma), leaf
        return case

    figs.append(Figure("focal-gamma-below-one", [Row(
        "γ = 0.5, logits [d, 0], target 0", np.linspace(0, 40, 401),
        "logit margin d of the target class",
        focal_gap_case(naive.classic_focal, 0.5), focal_gap_case(sl_focal, 0.5),
        "naive: softmax → log FocalLoss", "stablelosses: focal_loss(gamma=0.5)",
        "loss", "−∂loss/∂d", grad_sign=-1.0, linthresh=1e-12,
        value_scale="symlog", grad_scale="symlog")]))

    # --- label smoothing with masked classes -------------------------------------------------
    def smoothing_case(fn):
        t = torch.tensor([0])

        def case(eps):
            leaf = _leaf(2.0)
            logits = torch.stack([leaf, torch.tensor(0.5), torch.tensor(-inf)])[None]
            return fn(logits, t, eps), leaf
        return case

    figs.append(Figure("label-smoothing-masked", [Row(
        "logits [2, 0.5, −inf], target 0", np.linspace(0, 0.5, 201), "label_smoothing ε",
        smoothing_case(lambda z, t, e: F.cross_entropy(z, t, label_smoothing=e)),
        smoothing_case(lambda z, t, e: SF.cross_entropy(z, t, label_smoothing=e)),
        "naive: F.cross_entropy", "stablelosses: cross_entropy",
        "loss", "∂loss/∂z₀ (target logit)")]))

    # --- KL with zero targets against -inf log-probabilities ---------------------------------
    p_target = torch.tensor([[0.7, 0.3, 0.0]])
    kl_mask = torch.tensor([[True, True, False]])

    def kl_case(fn):
        def case(x):
            leaf = _leaf(x)
            logits = torch.stack([leaf, torch.tensor(0.0), torch.tensor(1.0)])[None]
            return fn(logits), leaf
        return case

    figs.append(Figure("kl-zero-targets", [Row(
        "target [0.7, 0.3, 0], class 2 masked", np.linspace(-4, 4, 201), "logit x of class 0",
        kl_case(lambda z: F.kl_div(
            F.log_softmax(z.masked_fill(~kl_mask, -inf), -1), p_target, reduction="batchmean")),
        kl_case(lambda z: SF.kl_div(
            SF.log_softmax(z, -1, mask=kl_mask), p_target, reduction="batchmean")),
        "naive: F.kl_div(log_softmax(masked z), p)", "stablelosses: kl_div",
        "KL(p ‖ q)", "∂/∂x")]))

    # --- log-cosh overflow --------------------------------------------------------------------
    def logcosh_case(fn):
        def case(r):
            leaf = _leaf(r)
            return fn(leaf, torch.tensor(0.0)), leaf
        return case

    figs.append(Figure("log-cosh-overflow", [Row(
        "log cosh(r), float32", np.linspace(-120, 120, 241), "residual r",
        logcosh_case(lambda x, y: naive.log_cosh(x, y, reduction="none")),
        logcosh_case(SF.log_cosh_loss),
        "naive: torch.log(torch.cosh(x − y))", "stablelosses: log_cosh_loss(x, y)",
        "loss", "∂loss/∂r")]))

    # --- squared residual overflow (float16 and float32 RMSE) --------------------------------
    def rmse_dtype_case(fn, dtype):
        def case(r):
            leaf = _leaf(r, dtype)
            return fn(leaf.expand(4), torch.zeros(4, dtype=dtype)), leaf
        return case

    figs.append(Figure("half-precision-overflow", [
        Row("float16", np.linspace(4, 1000, 250), "residual r (float16)",
            rmse_dtype_case(naive.sqrt_mse, torch.float16),
            rmse_dtype_case(SF.rmse_loss, torch.float16),
            "naive: torch.sqrt(F.mse_loss(x, y))", "stablelosses: rmse_loss(x, y)",
            "RMSE", "∂RMSE/∂r"),
        Row("float32", np.logspace(15, 25, 121), "residual r (float32)",
            rmse_dtype_case(naive.sqrt_mse, torch.float32),
            rmse_dtype_case(SF.rmse_loss, torch.float32),
            "naive: torch.sqrt(F.mse_loss(x, y))", "stablelosses: rmse_loss(x, y)",
            "RMSE", "∂RMSE/∂r", xscale="log", value_scale="log"),
    ]))

    # --- torchvision sigmoid focal loss at saturated logits, gamma < 1 ------------------------
    def sigmoid_focal_case(fn):
        t = torch.tensor(1.0)

        def case(x):
            leaf = _leaf(x)
            return fn(leaf, t), leaf
        return case

    figs.append(Figure("sigmoid-focal-saturated", [Row(
        "γ = 0.5, α = 0.25, target 1", np.linspace(0, 40, 401), "logit x",
        sigmoid_focal_case(lambda x, t: naive.torchvision_sigmoid_focal(x, t, 0.25, 0.5)),
        sigmoid_focal_case(lambda x, t: SF.sigmoid_focal_loss(x, t, alpha=0.25, gamma=0.5)),
        "naive: torchvision.ops.sigmoid_focal_loss", "stablelosses: sigmoid_focal_loss",
        "loss", "−∂loss/∂x", grad_sign=-1.0, linthresh=1e-30,
        value_scale="symlog", grad_scale="symlog")]))

    return figs


def main(out_dir: Path | None = None, specs: Callable[[], list] | None = None) -> list[str]:
    """Write every figure of ``specs()`` (default: this module's); return the problems found
    on the stablelosses side."""
    out_dir = FIG_DIR if out_dir is None else Path(out_dir)
    problems: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread hand-off would dominate
    try:
        for spec in (specs or figures)():
            problems += render(spec, out_dir)
    finally:
        torch.set_num_threads(threads)
    return problems


if __name__ == "__main__":
    found = main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    for line in found:
        print("problem:", line, file=sys.stderr)
    sys.exit(1 if found else 0)
