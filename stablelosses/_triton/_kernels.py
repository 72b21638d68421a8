"""Triton kernels: one program per row of a contiguous ``(N, V)`` matrix, fp32 arithmetic.

This module imports triton and is only imported by ``stablelosses._triton.ops``, which the
dispatch in ``stablelosses._triton`` imports on the first call that selects the kernels.

Every kernel reads its row in blocks of ``BLOCK`` columns (any width: the last block is masked,
and a masked column reads as ``-inf``, which adds nothing to a sum). The running maximum is
kept online, as in the "online softmax" of Milakov and Gimelshein (2018): a new block rescales
the running sum by ``exp(m_old − m_new)``. The hazard rules are those of the torch path
(``stablelosses._autograd.rows.bounded``):

* entries are clamped to ``finfo(float32).max`` (``+inf → finfo.max``; the identity on every
  row without ``+inf``), so a ``+inf`` row puts uniform mass on its ``+inf`` entries;
* the shift is ``m_safe`` = 0 while the running max is ``-inf`` (``(−inf) − (−inf)`` never
  forms), so a row whose entries are all ``-inf`` ends with the sum ``S = 0`` — that is how
  fully masked rows are recognised (every other row has ``S ≥ 1``);
* NaN propagates through the sum (clamping is a ``where`` on ``x > max``, false for NaN), so a
  NaN row ends with ``S = NaN`` and NaN outputs.

Every output is computed in float32 and rounded once to its dtype; bfloat16 is rounded to nearest
even by `_round_out` (the interpreter's own float32 → bfloat16 cast truncates). Load and store
masks are block-shaped comparisons with the row's width (a kept-row flag becomes a width of 0):
triton 3.9's interpreter refuses a mask that mixes a block and a scalar flag.

``log1p`` is spelled with the exact identity ``log1p(z) = log(u) · z / (u − 1)``, ``u = 1 + z``
rounded (``z`` where ``u == 1``), since ``libdevice.log1p`` is not available in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

# torch.finfo(torch.float32).max; a constexpr: triton's compiler refuses any other global
FMAX = tl.constexpr(3.4028234663852886e38)


# Reductions as tl.reduce with the standard library's own combine functions (private names, the
# same in triton 3.2 to 3.9). tl.sum/tl.max/tl.min are jit functions made when triton is
# imported: they do not run in the interpreter when triton was imported before
# TRITON_INTERPRET=1 was set (a test session imports triton early through torch's own test
# utilities), while tl.reduce is a builtin, and the interpreter runs these combine functions
# through numpy. Compiled, the code is exactly tl.sum's.


@triton.jit
def _sum(x):
    return tl.reduce(x, 0, tl.standard._sum_combine)


@triton.jit
def _max(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@triton.jit
def _min(x):
    return tl.reduce(x, 0, tl.standard._elementwise_min)


@triton.jit
def _log1p(z):
    """``log1p(z)`` to a few ulp (Goldberg's identity; ``z`` where ``1 + z`` rounds to 1)."""
    u = 1.0 + z
    d = u - 1.0
    return tl.where(d == 0.0, z, tl.log(u) * (z / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _round_out(x, OUT: tl.constexpr):
    """float32 ``x`` rounded once to the output dtype ``OUT`` (to nearest even)."""
    if OUT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = up.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), y)  # NaN stays NaN (its carry could reach inf)
    else:
        return x.to(OUT)


@triton.jit
def _ce_forward_kernel(
    X, stride_x, T, W, KEEP, LOSS, LT, M, S, REST, KINF, CNT, WSUM, VALID, DEN, n_cols, ignore_index,
    eps, sm_scale, HAS_W: tl.constexpr, HAS_KEEP: tl.constexpr, SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Class-index cross-entropy of one row: **one read of the row**, N-sized writes.

    Online over the blocks: the clamped row max ``m`` and ``s = Σ_{j≠t} exp(x_j − m)``
    (the target column left out), and the count of ``+inf`` entries. Then with
    ``e_t = exp(x_t − m)`` (one more load of one element), ``S = s + e_t``, ``p_t = e_t / S``
    and ``rest = s / S = Σ_{j≠t} p_j``:

    * ``log p_t = (x_t − m) − log S`` (torch's log-softmax), or ``log p_t = log1p(−rest)`` where
      ``rest < ½`` (the exact tail: it keeps full relative accuracy as ``p_t → 1``);
    * ``+inf`` rows: ``log p_t = log(p_t)`` (the limit: ``−log k`` on the k ``+inf`` entries,
      ``-inf`` elsewhere);
    * fully masked rows (``S = 0``) and rows not kept: ``log p_t = −inf``, not valid, loss 0;
    * NaN rows: NaN; a target out of ``[0, V)`` (not ``ignore_index``): a device-side assert
      when launched with ``debug=True`` (the wrapper does on CUDA; on the CPU it raises before
      the launch), else NaN.

    ``SMOOTH`` (label smoothing ε) also sums, over the K unmasked classes (logit ≠ ``-inf``),
    ``A = Σ_c (ε/V) w_c (m − x_c)`` (every term ≥ 0 and scaled before the sum; rescaled by
    ``(m_new − m) (ε/V) Σ w`` when the max moves) and ``Σ_c w_c``, so that the smoothing term
    ``ε/K Σ_c w_c (−log p_c) = (V/K) (A + (ε/V) log S Σ_c w_c)`` costs no second pass. On ``+inf``
    rows each finite unmasked class has ``−log p_c = +inf`` (the torch path's exact shift), a
    term of 0 where ``w_c = 0`` (``0 · inf = 0``).

    Writes per row: ``LOSS`` (valid rows; 0 elsewhere; ``0 · inf = 0`` for a zero class
    weight); ``LT = log p_t``; ``M = m`` (``-inf`` on fully masked rows); ``S``; ``REST`` (0 on
    fully masked rows); ``KINF`` (the ``+inf`` count); ``CNT`` (K); ``WSUM`` (``Σ_c w_c`` over
    the unmasked classes); ``VALID`` (target not ``ignore_index``, row kept, not fully masked);
    ``DEN`` (the mean's denominator term: ``w_t``, or 1, on valid rows, else 0).
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row)
    is_target = t != ignore_index
    idx = tl.where(is_target, t, 0)
    in_range = (idx >= 0) & (idx < n_cols)
    keep = t == t  # a scalar True (a tensor, as the kept-row flag below)
    if HAS_KEEP:
        keep = tl.load(KEEP + row) != 0
    # torch's "Target t is out of bounds" on a kept row: a device-side assert where the launch
    # sets debug
    tl.device_assert(in_range | ~is_target | ~keep, "stablelosses: a target class index is out of range")
    n_read = tl.where(keep, n_cols, 0)  # the columns read: none on a row not kept
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    kinf = 0
    acc = 0.0  # SMOOTH: (ε/V) Σ w_c (m − x_c) over the unmasked classes
    wsum = 0.0
    cnt = 0
    fin_w = 0  # SMOOTH: finite classes with w_c ≠ 0 (for +inf rows)
    winf = 0.0  # SMOOTH: Σ w_c over the +inf entries
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        inb = cols < n_cols
        raw = tl.load(x_row + cols, mask=cols < n_read, other=float("-inf")).to(tl.float32)
        is_inf = raw == float("inf")
        kinf += _sum(is_inf.to(tl.int32))
        x = tl.where(raw > FMAX, FMAX, raw)
        m_new = tl.maximum(m, _max(x))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        e = tl.where(cols == idx, 0.0, tl.exp(x - m_safe))
        s = s * tl.exp(m - m_safe) + _sum(e)
        if SMOOTH:
            um = raw != -float("inf")
            wc = tl.full((BLOCK,), 1.0, tl.float32)
            if HAS_W:
                wc = tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
            wv = tl.where(um, wc, 0.0)
            # scaled by ε/V before the sums: V terms of 2e37 overflow float32, their mean does not
            shift = tl.where(wsum == 0.0, 0.0, (m_safe - m) * (sm_scale * wsum))
            acc = acc + shift + _sum(tl.where(um, (sm_scale * wv) * (m_safe - x), 0.0))
            wsum += _sum(wv)
            cnt += _sum(um.to(tl.int32))
            fin = um & ~is_inf
            fin_w += _sum((fin & (wc != 0.0)).to(tl.int32))
            winf += _sum(tl.where(is_inf, wc, 0.0))
        m = m_new
    x_t = tl.load(x_row + idx, mask=in_range & (idx < n_read), other=float("-inf")).to(tl.float32)
    x_t = tl.where(x_t > FMAX, FMAX, x_t)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    e_t = tl.exp(x_t - m_safe)
    total = s + e_t
    masked = total == 0.0
    total_safe = tl.where(masked, 1.0, total)
    rest = s / total_safe
    pinf = kinf > 0
    lt = (x_t - m_safe) - tl.log(total_safe)
    lt = tl.where(pinf, tl.log(e_t / total_safe), lt)
    near_one = (rest < 0.5) & (lt == lt)
    lt = tl.where(near_one, _log1p(-tl.where(near_one, rest, 0.0)), lt)
    lt = tl.where(masked, -float("inf"), lt)
    lt = tl.where(in_range | ~is_target | ~keep, lt, float("nan"))
    valid = is_target & ~masked
    val = -lt
    w_t = 1.0
    if HAS_W:
        w_t = tl.load(W + idx, mask=in_range, other=0.0).to(tl.float32)
        val = tl.where(w_t == 0.0, 0.0, w_t * val)  # 0 · inf = 0
    if SMOOTH:
        k = tl.maximum(cnt, 1).to(tl.float32)
        smooth = (acc + sm_scale * tl.log(total_safe) * wsum) * (n_cols / k)
        # +inf rows: −log p_c = +inf on finite classes (0 times a zero weight), log k on +inf ones
        log_k = tl.log(tl.maximum(kinf, 1).to(tl.float32))
        on_inf = tl.where(fin_w > 0, float("inf"), (eps / k) * winf * log_k)
        smooth = tl.where(pinf, on_inf, smooth)
        val = tl.where(eps < 1.0, (1.0 - eps) * val, 0.0) + smooth
        tl.store(CNT + row, k)
        tl.store(WSUM + row, wsum)
    tl.store(LOSS + row, tl.where(valid, val, 0.0))
    tl.store(LT + row, lt)
    tl.store(M + row, tl.where(masked, -float("inf"), m))
    tl.store(S + row, total)
    tl.store(REST + row, tl.where(masked, 0.0, rest))
    tl.store(KINF + row, kinf)
    tl.store(VALID + row, valid)
    tl.store(DEN + row, tl.where(valid, w_t, 0.0))


@triton.jit
def _ce_backward_kernel(
    X, stride_x, T, W, KEEP, G, stride_g, VALID, SCALE, LT, M, S, REST, KINF, CNT, WSUM, DX, stride_dx,
    n_cols, ignore_index, eps, HAS_W: tl.constexpr, HAS_KEEP: tl.constexpr, FOCAL: tl.constexpr,
    SMOOTH: tl.constexpr, BLOCK: tl.constexpr,
):
    """Gradient of the class-index loss for one row: **one read of the row, one write of its
    gradient** (the logits are never overwritten).

    The row scale ``a = w_t · g`` (focal: ``· SCALE``, the N-sized focal factor) on valid rows,
    0 elsewhere, NaN on NaN rows; then ``dx_j = a · p_j`` with ``p_j = exp(x_j − m) / S`` and
    ``dx_t = −a · rest`` (``a (p_t − 1)`` without cancellation as ``p_t → 1``). Fully masked
    rows and rows not kept read nothing and get 0.

    ``SMOOTH``: ``dx_c = p_c · row − dense_c − [c = t] (1 − ε) a`` with
    ``dense_c = g ε/K w_c`` on the unmasked classes and ``row = (1 − ε) a + Σ_c dense_c`` (the
    torch path's ``p · Σq − q``); on ``+inf`` rows ``p`` is uniform over the ``+inf`` entries.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    t = tl.load(T + row)
    idx = tl.where(t != ignore_index, t, 0)
    keep = t == t
    if HAS_KEEP:
        keep = tl.load(KEEP + row) != 0
    n_read = tl.where(keep, n_cols, 0)
    g = tl.load(G + row * stride_g).to(tl.float32)
    valid = tl.load(VALID + row) != 0
    sv = tl.where(valid, g, 0.0)
    a = sv
    if FOCAL:
        a = tl.where(valid, a * tl.load(SCALE + row), 0.0)
    if HAS_W:
        a = a * tl.load(W + idx, mask=(idx >= 0) & (idx < n_cols), other=0.0).to(tl.float32)
    lt = tl.load(LT + row)
    a = tl.where(lt != lt, lt, a)  # NaN rows: NaN gradient
    m = tl.load(M + row)
    total = tl.load(S + row)
    rest = tl.load(REST + row)
    kinf = tl.load(KINF + row)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    total_safe = tl.where(total == 0.0, 1.0, total)
    offs = tl.arange(0, BLOCK)
    if SMOOTH:
        a = (1.0 - eps) * a
        per = sv * (eps / tl.load(CNT + row))  # dense_c = per · w_c on unmasked classes
        rsum = a + per * tl.load(WSUM + row)
        inv_k = 1.0 / tl.maximum(kinf, 1).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        inb = cols < n_cols
        raw = tl.load(x_row + cols, mask=cols < n_read, other=float("-inf")).to(tl.float32)
        x = tl.where(raw > FMAX, FMAX, raw)
        p = tl.exp(x - m_safe) / total_safe
        if SMOOTH:
            p = tl.where(kinf > 0, tl.where(raw == float("inf"), inv_k, 0.0), p)
            wc = tl.full((BLOCK,), 1.0, tl.float32)
            if HAS_W:
                wc = tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
            dense = tl.where(raw == -float("inf"), 0.0, per * wc)
            d = p * rsum - dense
            d = tl.where(cols == idx, d - a, d)
        else:
            d = a * p
            d = tl.where(cols == idx, -rest * a, d)
        tl.store(dx_row + cols, _round_out(d, DX.dtype.element_ty), mask=inb)


# --- the softmax family over the last dimension -------------------------------------------


@triton.jit
def _row_stats(x_row, n_cols, BLOCK: tl.constexpr):
    """One pass over a row: the clamped max ``m``, ``δ = Σ exp(x − m)`` without one argmax
    term (that term is exactly 1, so ``S = 1 + δ`` and ``log S = log1p(δ)`` keeps the small
    part), and the count of ``+inf`` entries. ``m = -inf`` and ``δ = 0`` on all-``-inf`` rows;
    ``δ`` is NaN on NaN rows."""
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    d = 0.0
    kinf = 0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        raw = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        kinf += _sum((raw == float("inf")).to(tl.int32))
        x = tl.where(raw > FMAX, FMAX, raw)
        bm = _max(x)
        new = bm > m  # this block holds the new max: its first instance leaves the sum
        m_new = tl.maximum(m, bm)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        first = _min(tl.where(x == bm, cols, n_cols))
        e = tl.exp(x - m_safe)
        e = tl.where(cols == first, tl.where(new, 0.0, e), e)
        alpha = tl.exp(m - m_safe)
        old_max_term = tl.where(new, tl.where(m != -float("inf"), alpha, 0.0), 0.0)
        d = d * alpha + old_max_term + _sum(e)
        m = m_new
    return m, d, kinf


@triton.jit
def _softmax_forward_kernel(
    X, stride_x, Y, stride_y, M, D, K, n_cols, MODE: tl.constexpr, BLOCK: tl.constexpr,
):
    """``softmax`` (MODE 0), ``log_softmax`` (MODE 1) or ``logsumexp`` (MODE 2) of one row.

    Passes: **one read** for the row statistics (`_row_stats`); softmax and log_softmax then
    **read the row again and write the output** (logsumexp writes one value). Values:

    * softmax: ``exp(x − m) / (1 + δ)``; 0 on all-``-inf`` rows; uniform over the ``+inf``
      entries (an entry at ``finfo.max`` counts with them, as the torch path's bounded x);
    * log_softmax: ``(x − m) − log1p(δ)`` (the argmax entry keeps its exact tail ``−log1p(δ)``);
      ``-inf`` on all-``-inf`` rows; on ``+inf`` rows ``−log k`` at the k ``+inf`` entries and
      ``-inf`` elsewhere;
    * logsumexp: ``m + log1p(δ)``; ``±inf`` on ``±inf`` rows.

    NaN rows give NaN. ``M``, ``D``, ``K`` keep the statistics for the backward.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    m, d, kinf = _row_stats(x_row, n_cols, BLOCK)
    tl.store(M + row, m)
    tl.store(D + row, d)
    tl.store(K + row, kinf)
    pinf = kinf > 0
    dead = m == -float("inf")
    m_safe = tl.where(dead, 0.0, m)
    if MODE == 2:
        lse = tl.where(pinf, float("inf"), tl.where(dead, m, m + _log1p(d)))
        lse = tl.where(d != d, d, lse)
        tl.store(Y + row * stride_y, _round_out(lse, Y.dtype.element_ty))
    else:
        log_s = _log1p(d)
        total = 1.0 + d
        log_k = tl.log(tl.maximum(kinf, 1).to(tl.float32))
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            raw = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            x = tl.where(raw > FMAX, FMAX, raw)
            if MODE == 0:
                y = tl.where(dead, 0.0, tl.exp(x - m_safe) / total)
                y = tl.where(d != d, d, y)
            else:
                y = (x - m_safe) - log_s
                y = tl.where(pinf, tl.where(raw == float("inf"), -log_k, -float("inf")), y)
                y = tl.where(dead, -float("inf"), y)
                y = tl.where(raw != raw, float("nan"), tl.where(d != d, float("nan"), y))
            tl.store(Y + row * stride_y + cols, _round_out(y, Y.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _softmax_row_p(raw, m_safe, total, pinf, inv_k, dead):
    """``softmax`` of one block of a row from its statistics, in fp32: ``exp(x − m) / S``;
    uniform over the ``+inf`` entries on ``+inf`` rows; 0 on all-``-inf`` rows."""
    x = tl.where(raw > FMAX, FMAX, raw)
    p = tl.where(pinf, tl.where(raw == float("inf"), inv_k, 0.0), tl.exp(x - m_safe) / total)
    return tl.where(dead, 0.0, p)


@triton.jit
def _softmax_backward_kernel(
    X, stride_x, G, stride_g, M, D, K, DX, stride_dx, n_cols, LOG: tl.constexpr, BLOCK: tl.constexpr,
):
    """The backward of softmax (``p (g − Σ g p)``) or log_softmax (``g' − p Σ g'`` with
    ``g' = 0`` where the output is ``-inf``), ``p`` recomputed in fp32 from the input and the
    saved row statistics (not read off a rounded half-precision output): **two reads of x and
    g, one write of the gradient**. Masked entries and all-``-inf`` rows get 0, NaN rows NaN."""
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(M + row)
    d = tl.load(D + row)
    kinf = tl.load(K + row)
    pinf = kinf > 0
    dead = m == -float("inf")
    m_safe = tl.where(dead, 0.0, m)
    total = 1.0 + d
    inv_k = 1.0 / tl.maximum(kinf, 1).to(tl.float32)
    n_pinf = tl.where(pinf, n_cols, 0)  # a row flag as a width (no block & scalar-flag masks)
    offs = tl.arange(0, BLOCK)
    acc = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        ok = cols < n_cols
        raw = tl.load(X + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            ninf = (raw == float("-inf")) | ((raw != float("inf")) & (cols < n_pinf))
            acc += _sum(tl.where(dead, 0.0, tl.where(ninf, 0.0, g)))
        else:
            acc += _sum(g * _softmax_row_p(raw, m_safe, total, pinf, inv_k, dead))
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        ok = cols < n_cols
        raw = tl.load(X + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        p = _softmax_row_p(raw, m_safe, total, pinf, inv_k, dead)
        if LOG:
            ninf = (raw == float("-inf")) | ((raw != float("inf")) & (cols < n_pinf))
            dx = tl.where(dead, 0.0, tl.where(ninf, 0.0, g)) - p * acc
        else:
            dx = p * (g - acc)
        dx = tl.where(d != d, float("nan"), dx)  # NaN rows (δ is NaN there)
        tl.store(DX + row * stride_dx + cols, _round_out(dx, DX.dtype.element_ty), mask=ok)


@triton.jit
def _logsumexp_backward_kernel(
    X, stride_x, G, M, D, K, DX, stride_dx, n_cols, BLOCK: tl.constexpr,
):
    """``g · softmax(x)`` from the saved statistics: **one read of the row, one write of the
    gradient**. ``+inf`` rows: uniform over the ``+inf`` entries; all-``-inf`` rows: 0."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(G + row).to(tl.float32)
    m = tl.load(M + row)
    d = tl.load(D + row)
    kinf = tl.load(K + row)
    pinf = kinf > 0
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    g_s = g / (1.0 + d)
    inv_k = 1.0 / tl.maximum(kinf, 1).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        raw = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        x = tl.where(raw > FMAX, FMAX, raw)
        dx = tl.where(pinf, g * tl.where(raw == float("inf"), inv_k, 0.0), tl.exp(x - m_safe) * g_s)
        dx = tl.where(d != d, float("nan"), dx)  # NaN rows (δ is NaN there)
        tl.store(DX + row * stride_dx + cols, _round_out(dx, DX.dtype.element_ty), mask=cols < n_cols)


# --- sigmoid focal loss (elementwise) ------------------------------------------------------


@triton.jit
def _sigmoid_parts(x, t):
    """``σ(x)``, ``σ(−x)``, ``q = 1 − p_t`` (a lerp exact at both ends, from the nearer one)
    and ``BCE = (relu(x) − t·x) + log1p(exp(−|x|))`` (two non-negative parts)."""
    e = tl.exp(-tl.abs(x))
    big = 1.0 / (1.0 + e)
    small = e * big
    pos = x >= 0.0
    sp = tl.where(pos, big, small)
    sn = tl.where(pos, small, big)
    q = tl.where(t < 0.5, sp + t * (sn - sp), sn - (1.0 - t) * (sn - sp))
    ce = (tl.maximum(x, 0.0) - t * x) + _log1p(e)
    return sp, sn, q, ce


@triton.jit
def _pow01(q, gamma):
    """``q ** γ`` for ``q`` in ``[0, 1]``, ``γ > 0``: ``exp(γ log q)`` in float64, then rounded
    (float32 ``exp(γ log q)`` would lose ``γ |log q|`` ulp for tiny ``q``)."""
    q64 = q.to(tl.float64)
    return tl.where(q64 == 0.0, 0.0, tl.exp(gamma * tl.log(tl.where(q64 == 0.0, 1.0, q64)))).to(tl.float32)


@triton.jit
def _sigmoid_load(X, T, KEEP, offs, n, HAS_KEEP: tl.constexpr):
    """x and t in fp32 and the kept flag (True without ``KEEP``); 0 at entries not kept (the
    torch path's select: a NaN there is never read)."""
    ok = offs < n
    kept = ok
    if HAS_KEEP:
        kept = ok & (tl.load(KEEP + offs, mask=ok, other=0) != 0)
    x = tl.load(X + offs, mask=kept, other=0.0).to(tl.float32)
    t = tl.load(T + offs, mask=kept, other=0.0).to(tl.float32)
    return x, t, ok, kept


@triton.jit
def _sigmoid_focal_forward_kernel(X, T, KEEP, LOSS, n, alpha, gamma, HAS_ALPHA: tl.constexpr,
                                  FOCAL: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """``α_t · BCE(x, t) · (1 − p_t)^γ`` elementwise: **one read of x and t (and the mask), one
    write of the fp32 loss** (0 where not kept). ``γ = 0`` spells BCE as torch's
    ``binary_cross_entropy_with_logits`` does, ``(1 − t) x − log σ(x)``. NaN in, NaN out (the
    GPU's ``max``/``min`` drop a NaN operand, so it is selected back)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x, t, ok, kept = _sigmoid_load(X, T, KEEP, offs, n, HAS_KEEP)
    if FOCAL:
        _sp, _sn, q, ce = _sigmoid_parts(x, t)
        loss = ce * _pow01(q, gamma)
        a_t = t * (2.0 * alpha - 1.0) + (1.0 - alpha)
    else:
        log_sigmoid = tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x)))
        loss = (1.0 - t) * x - log_sigmoid
        a_t = alpha * t + (1.0 - alpha) * (1.0 - t)
    if HAS_ALPHA:
        loss = a_t * loss
    # x = ±inf: the limit, 0 where the target sits at that end (w = 0) or α_t = 0, else +inf
    # (the formulas meet inf − inf and 0·inf there), as the torch path
    w = tl.where(x > 0.0, 1.0 - t, t)
    zero = w == 0.0
    if HAS_ALPHA:
        zero = zero | (a_t == 0.0)
    loss = tl.where(tl.abs(x) == float("inf"), tl.where(zero, 0.0, float("inf")), loss)
    loss = tl.where((x != x) | (t != t), float("nan"), loss)
    tl.store(LOSS + offs, tl.where(kept, loss, 0.0), mask=ok)


@triton.jit
def _sigmoid_focal_backward_kernel(X, T, KEEP, G, stride_g, DX, n, scale, alpha, gamma,
                                   HAS_ALPHA: tl.constexpr, FOCAL: tl.constexpr,
                                   HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    """``d loss / d x`` elementwise: **one read of x, t (the mask) and the incoming gradient, one
    write** (0 where not kept).

    ``α_t [(σ(x) − t) + γ (ce / q) (1 − 2t) σ(x) σ(−x)] q^γ``, with ``σ(x) − t`` a lerp (no
    cancellation) and ``q`` clamped to the smallest normal number in the ratio (both ~0 there).
    ``stride_g = 0``: a reduced loss's scalar gradient, times ``scale`` (``1/n`` for the mean).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x, t, ok, kept = _sigmoid_load(X, T, KEEP, offs, n, HAS_KEEP)
    g = tl.load(G + offs * stride_g, mask=ok, other=0.0).to(tl.float32) * scale
    sp, sn, q, ce = _sigmoid_parts(x, t)
    d = tl.where(t < 0.5, sp + t * (-sn - sp), -sn - (1.0 - t) * (-sn - sp))
    if FOCAL:
        # ce / q at x = ±inf is NaN or inf; its term's limit there is 0 (σ(x)σ(−x) is 0)
        ratio = tl.where(tl.abs(x) == float("inf"), 0.0, ce / tl.maximum(q, 1.1754943508222875e-38))
        d = (d + gamma * ratio * (sp * sn * (1.0 - 2.0 * t))) * _pow01(q, gamma)
    if HAS_ALPHA:
        d = d * (t * (2.0 * alpha - 1.0) + (1.0 - alpha))
    d = tl.where((x != x) | (t != t), float("nan"), d * g)
    tl.store(DX + offs, _round_out(tl.where(kept, d, 0.0), DX.dtype.element_ty), mask=ok)
