"""The rules: each finds one hazardous spelling and, where a rewrite keeps the value wherever
the old code was finite, builds the replacement text.

A rule sees one ``ast`` node (a call or a binary operation) and the `Module`; it returns a
`Finding` or None. Names bound once in the same function are seen through (``p = softmax(x)``
then ``log(p)``), so the two-line spellings are found too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from stablelosses.lint._analysis import Call, Module, Scope, is_neg_inf

__all__ = ["RULES", "Finding", "Rule", "check_tree"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    summary: str
    page: str  # docs: the hazard page


# code | name | summary | the docs hazard page: one rule a line (a line indented by four spaces
# continues the one above); a table in text, where a list of calls repeats one shape 22 times
_TABLE = """
SL101 | sqrt-of-mse | square root of an MSE or a mean of squares | sqrt-at-zero
SL102 | log-of-softmax | log of softmax | focal-log-zero
SL103 | hand-softmax | hand-written softmax exp(x) / sum(exp(x)) | softmax-logsumexp
SL104 | log-of-sigmoid | log of sigmoid | sigmoid-focal-saturated
SL105 | bce-on-sigmoid | binary_cross_entropy of sigmoid outputs | sigmoid-focal-saturated
SL106 | focal-power | (1 - p) ** gamma on probabilities | focal-gamma-below-one
SL107 | divide-by-norm | division by a norm with no eps | zero-vector
SL108 | eps-hack | log(x + eps) / sqrt(x + eps) where an exact op exists | sqrt-at-zero
SL109 | masked-softmax | masked_fill(-inf) then softmax, no guard for masked rows | softmax-logsumexp
SL110 | kl-div-probabilities | F.kl_div given probabilities, not log-probabilities | kl-zero-targets
SL111 | masked-mean | masked mean as sum(x * mask) / mask.sum() | masked-mean-empty
SL112 | log-cosh | log(cosh(r)) | log-cosh-overflow
SL113 | exp-unshifted | exp of an unshifted logit: hand-written logsumexp | softmax-logsumexp
SL114 | exp-log-ratio | exp of a log-ratio with no guard before it (GRPO's 0 * inf) | finite-loss-nan-gradient
SL115 | log1p-exp | log1p(-exp(x)) / log(1 - exp(x)): log1mexp by hand | log1mexp
SL116 | exp-minus-one | exp(d) - d - 1 (the k3 KL estimator) by hand | log1mexp
SL117 | mask-multiply | x * mask after a value that can be inf or NaN | finite-loss-nan-gradient
SL118 | guard-after-op | where / nan_to_num after the op that made the inf or NaN | finite-loss-nan-gradient
SL119 | entropy-by-hand | exp(logp) * logp or p * log(p): 0 * -inf | masked-entropy
SL120 | kl-log-target-masked | F.kl_div(log_target=True) on masked (-inf) log-probs | kl-zero-targets
SL121 | row-mean-denominator | x.sum(-1) / mask.sum(-1): a per-sequence mean of an empty sequence
    | masked-mean-empty
SL122 | clamp-under-no-grad | x.clamp_() under torch.no_grad(): a straight-through gradient
    | finite-loss-nan-gradient
"""

RULES: dict[str, Rule] = {
    row[0]: Rule(*row)
    for row in (tuple(cell.strip() for cell in line.split(" | "))
                for line in _TABLE.replace("\n    |", " |").strip().splitlines())
}

SF = "stablelosses.functional"
TF = "torch.nn.functional"


@dataclass
class Finding:
    """One hazard at one place; ``fix`` is the replacement for the node's source span."""

    code: str
    node: ast.AST
    message: str
    fix: str | None = None
    no_fix: str | None = None  # why there is no automatic rewrite
    imports: set[tuple[str, str | None]] = field(default_factory=set)
    # ``name = value`` statements whose every use the rewrite replaces: removed with it
    drop: list[ast.stmt] = field(default_factory=list)

    @property
    def line(self) -> int:
        return self.node.lineno  # type: ignore[attr-defined]

    @property
    def col(self) -> int:
        return self.node.col_offset  # type: ignore[attr-defined]

    @property
    def end(self) -> tuple[int, int]:
        return self.node.end_lineno, self.node.end_col_offset  # type: ignore[attr-defined]


class _Names:
    """The names a replacement at ``at`` uses, and the imports it needs for them: a name counts
    only where it is bound to the module at that line (``B, T, F = x.shape`` hides torch's F)."""

    def __init__(self, m: Module, at: ast.AST) -> None:
        self.m = m
        self.at = at
        self.imports: set[tuple[str, str | None]] = set()

    def _module(self, module: str, asname: str) -> str | None:
        have = self.m.alias_for(module, self.at)
        if have:
            return have
        # a module-level import of ``asname`` reaches ``at`` only if no scope binds the name to
        # anything else
        for s in self.m.scopes:
            if s.bindings.get(asname) and (len(s.imports.get(asname, [])) != len(s.bindings[asname])
                                           or set(s.imports[asname]) != {module}):
                return None
        self.imports.add((module, asname))
        return asname

    def sf(self) -> str | None:
        return self._module(SF, "SF")

    def tf(self) -> str | None:
        have = self.m.alias_for(TF, self.at)
        if have:
            return have
        t = self.m.alias_for("torch", self.at)
        return f"{t}.nn.functional" if t else self._module(TF, "F")

    def torch(self) -> str | None:
        return self.m.alias_for("torch", self.at) or self._module("torch", "torch")


def _finding(code: str, node: ast.AST, message: str, names: _Names | None = None,
             fix: str | None = None, no_fix: str | None = None) -> Finding:
    if fix is None and no_fix is None:
        no_fix = "the rewrite needs a name that this file binds to something else"
    return Finding(code, node, message, fix, None if fix else no_fix,
                   set(names.imports) if (names and fix) else set())


# ------------------------------------------------------------------------------ helpers


def _is_int(node: ast.AST | None, value: int) -> bool:
    return (isinstance(node, ast.Constant) and type(node.value) in (int, float)
            and node.value == value)


def _squared(m: Module, node: ast.expr) -> ast.expr | None:
    """``x ** 2``, ``x.pow(2)``, ``torch.square(x)``, ``x * x`` -> ``x``."""
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow) and _is_int(node.right, 2):
            return node.left
        if isinstance(node.op, ast.Mult) and m.same(node.left, node.right):
            return node.left
    c = m.call(node, "pow", "square")
    if c is None:
        return None
    if c.op == "pow":
        return c.args[0] if len(c.args) == 2 and _is_int(c.args[1], 2) and not c.kwargs else None
    return c.args[0] if len(c.args) == 1 and not c.kwargs else None


@dataclass
class _Mse:
    """An MSE: the residual's two sides (or one squared tensor), the reduction, extra args."""

    a: ast.expr
    b: ast.expr | None
    reduction: ast.expr | None  # None: 'mean'
    mean_dims: bool  # a mean over some dims only: no rmse_loss spelling
    kind: str


def _mse(m: Module, node: ast.expr, at: ast.AST) -> _Mse | None:
    node = m.resolve(node, at) or node
    c = m.call(node, "mse_loss")
    if c is not None:
        if len(c.args) == 2 and set(c.kwargs) <= {"reduction"}:
            return _Mse(c.args[0], c.args[1], c.kwargs.get("reduction"), False, "an MSE")
        return None
    if isinstance(node, ast.Call) and node.args and len(node.args) == 2 and not node.keywords:
        ctor = m.resolve(node.func, at)
        if isinstance(node.func, ast.Call):
            ctor = node.func
        k = m.call(ctor, "MSELoss")
        if k is not None and not k.args and set(k.kwargs) <= {"reduction"}:
            return _Mse(node.args[0], node.args[1], k.kwargs.get("reduction"), False, "an MSE")
        return None
    c = m.call(node, "mean")
    if c is None or not c.args:
        return None
    sq = _squared(m, m.resolve(c.args[0], at) or c.args[0])
    if sq is None:
        return None
    dims = len(c.args) > 1 or bool(c.kwargs)
    if isinstance(sq, ast.BinOp) and isinstance(sq.op, ast.Sub):
        return _Mse(sq.left, sq.right, None, dims, "a mean of squares")
    return _Mse(sq, None, None, dims, "a mean of squares")


def _rmse_text(m: Module, sf: str, e: _Mse, eps: ast.expr | None = None) -> str | None:
    if e.mean_dims or e.b is None:
        return None
    args = [m.seg(e.a), m.seg(e.b)]
    if e.reduction is not None:
        args.append(f"reduction={m.seg(e.reduction)}")
    if eps is not None:
        args.append(f"eps={m.seg(eps)}")
    return f"{sf}.rmse_loss({', '.join(args)})"


_PROB_NAMES = re.compile(r"^(p|pt|p_t|prob|probs|probas|probabilities|pred_prob|p_hat)$", re.I)
_EPS_NAMES = re.compile(r"eps|epsilon|tiny|smooth", re.I)
_LOGITS = re.compile(r"(^|_)logits?(_per_[a-z]+)?$", re.I)
_NO_GRAD_CLASSES = re.compile(r"(FeatureExtractor|Processor|Tokenizer)(Fast)?$|Observer$")
_NO_GRAD_FILES = re.compile(r"(feature_extraction|(image_|video_)?processing|tokenization)_\w+\.py$")
_PASS_THROUGH = frozenset({"gather", "squeeze", "unsqueeze", "view", "reshape", "flatten", "detach",
                           "contiguous", "float", "to", "type_as", "clone"})


def _module_op(m: Module, node: ast.AST | None, at: ast.AST) -> str | None:
    """``nn.Sigmoid()(x)`` or ``act(x)`` with ``act = nn.Sigmoid()`` (``self.act`` too):
    ``'sigmoid'``; ``nn.Softmax(dim)``: ``'softmax'``."""
    if not isinstance(node, ast.Call) or len(node.args) != 1:
        return None
    ctor = node.func if isinstance(node.func, ast.Call) else m.resolve(node.func, at)
    if not isinstance(ctor, ast.Call):
        return None
    q = m.qualname(ctor.func) or ""
    return {"torch.nn.Sigmoid": "sigmoid", "torch.nn.Softmax": "softmax"}.get(q)


def _probability(m: Module, node: ast.expr, at: ast.AST, depth: int = 0) -> str | None:
    """``'softmax'``/``'sigmoid'``/``'exp'`` when ``node`` is a probability made by that op."""
    if depth > 6:
        return None
    node = m.resolve(node, at) or node
    c = m.call(node, "softmax", "sigmoid", "exp")
    if c is not None:
        return c.op
    mod = _module_op(m, node, at)
    if mod is not None:
        return mod
    if isinstance(node, ast.Subscript):
        return _probability(m, node.value, at, depth + 1)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _PASS_THROUGH and m.qualname(node.func.value) is None):
        return _probability(m, node.func.value, at, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        return _probability(m, node.left, at, depth + 1) or _probability(m, node.right, at, depth + 1)
    if isinstance(node, ast.Name) and _PROB_NAMES.match(node.id):
        return "name"
    return None


def _latest_kind(m: Module, node: ast.expr, at: ast.AST) -> str | None:
    """The op that made a name's latest value before ``at`` (``x = x.sigmoid()``), else the
    probability kind of the expression."""
    if isinstance(node, ast.Name):
        line = getattr(at, "lineno", 0)
        before = [(ln, v) for ln, v in m.scope(at).bindings.get(node.id, []) if ln <= line]
        if before:
            v = max(before, key=lambda b: b[0])[1]
            c = m.call(v, "softmax", "sigmoid")
            if c is not None:
                return c.op
    return _probability(m, node, at)


def _small_eps(m: Module, node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        return 0 < node.value <= 1e-3
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return bool(_EPS_NAMES.search(name))
    return False


def _plus_eps(m: Module, node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``x + eps`` or ``eps + x`` (eps a small constant or a name like ``eps``) -> (x, eps)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        if _small_eps(m, node.right):
            return node.left, node.right
        if _small_eps(m, node.left):
            return node.right, node.left
    c = m.call(node, "clamp")
    if c is not None and c.args:
        lo = c.arg(1, "min")
        if lo is not None and _small_eps(m, lo):
            return c.args[0], lo
    return None


def _shifted(m: Module, x: ast.expr, at: ast.AST) -> bool:
    """``x - x.max(...)`` (or minus a name like ``x_max``): the exponent is at most 0."""
    if isinstance(x, ast.Name):  # any binding of the name in this function that is a shift
        values = [v for _, v in m.scope(at).bindings.get(x.id, []) if v is not None]
        return any(_shifted(m, v, at) for v in values if not isinstance(v, ast.Name))
    if not (isinstance(x, ast.BinOp) and isinstance(x.op, ast.Sub)):
        return False
    r = x.right
    if isinstance(r, ast.Name) and "max" in r.id.lower():
        return True
    r = m.resolve(r, at) or r
    if isinstance(r, ast.Subscript):
        r = r.value
    if isinstance(r, ast.Attribute) and r.attr == "values":
        r = r.value
    if isinstance(r, ast.Call) and "max" in (m.seg(r.func).rsplit(".", 1)[-1]).lower():
        return True
    return m.call(r, "max") is not None


def _in_loss(m: Module, node: ast.AST, forward: bool = False) -> bool:
    """Inside a function named like a loss (or ``forward``), or a method of a class named like one."""
    p = m.parent(node)
    while p is not None:
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = p.name.lower()
            if "loss" in name or "criterion" in name or (forward and name == "forward"):
                return True
        if isinstance(p, ast.ClassDef):
            return "loss" in p.name.lower()
        p = m.parent(p)
    return False


def _no_grad(m: Module, node: ast.AST) -> bool:
    """Inside ``@torch.no_grad()``/``inference_mode``, a ``with`` of them, a preprocessing class
    (``*FeatureExtractor``, ``*Processor``, ``*Tokenizer``) or module (``processing_*.py``,
    ``feature_extraction_*.py``, ``tokenization_*.py``): no gradient flows there."""
    def grad_off(e: ast.expr) -> bool:
        q = m.qualname(e.func if isinstance(e, ast.Call) else e) or ""
        return q in ("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad")

    p = m.parent(node)
    while p is not None:
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(grad_off, p.decorator_list)):
            return True
        if isinstance(p, (ast.With, ast.AsyncWith)) and any(grad_off(i.context_expr) for i in p.items):
            return True
        if isinstance(p, ast.ClassDef) and _NO_GRAD_CLASSES.search(p.name):
            return True
        p = m.parent(p)
    return bool(_NO_GRAD_FILES.match(m.path.rsplit("/", 1)[-1]))


def _unneg(node: ast.expr) -> ast.expr:
    """``-x`` -> ``x``."""
    return node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else node


def _one_minus(node: ast.expr) -> ast.expr | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_int(node.left, 1):
        return node.right
    return None


def _dim(c: Call, index: int) -> ast.expr | None:
    return c.arg(index, "dim")


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# ------------------------------------------------------------------------------ rules on calls


def _sqrt(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "sqrt")
    if c is None or len(c.args) != 1 or c.kwargs:
        return None
    inner = m.resolve(c.args[0], node) or c.args[0]
    names = _Names(m, node)
    plus = _plus_eps(m, inner)
    if plus is not None:
        e = _mse(m, plus[0], node)
        if e is None or e.kind != "an MSE":  # sqrt(var + eps) in a norm layer is intended
            return None
        eps = m.resolve(plus[1], node) or plus[1]
        why = "a mean over some dims has no rmse_loss spelling"
        if m.call(inner, "clamp") is not None:
            # sqrt(max(m, eps)) is not sqrt(m + eps): 41% apart at m = eps
            sf, why = None, "a clamp is not an added eps; SF.rmse_loss(a, b) is exact without it"
        elif not (isinstance(eps, ast.Constant) and isinstance(eps.value, (int, float))):
            # rmse_loss takes a Python float; a tensor eps (a buffer) would raise
            sf, why = None, "the eps is not a number literal (a tensor eps is no float for eps=)"
        else:
            sf = names.sf()
        fix = _rmse_text(m, sf, e, eps) if sf else None
        return _finding("SL108", node, "sqrt(MSE + eps): the eps biases the value, and the square "
                        "inside the MSE overflows first", names, fix, why)
    if _no_grad(m, node):
        return None  # the hazard is in the gradient only
    e = _mse(m, inner, node)
    if e is not None and e.kind != "an MSE" and not _in_loss(m, node, forward=True):
        return None  # an RMS or a std of data: a gradient rarely flows (measured: lint.md)
    if e is None:
        if not _in_loss(m, node, forward=True):
            return None
        s = m.call(inner, "sum")
        sq = _squared(m, m.resolve(s.args[0], node) or s.args[0]) if s is not None and s.args else None
        # a distance sqrt(sum((a - b) ** 2)) is 0 wherever two points meet; a norm spelled out
        # is 0 only at the zero vector, and the division by it is SL107's
        if s is None or not (isinstance(sq, ast.BinOp) and isinstance(sq.op, ast.Sub)):
            return None
        e = _Mse(s.args[0], None, None, True, "a sum of squared differences")
    sf = names.sf()
    fix = (_rmse_text(m, sf, e) or f"{sf}.safe_sqrt({m.seg(c.args[0])})") if sf else None
    return _finding("SL101", node, f"sqrt of {e.kind}: its gradient is inf * 0 = NaN where the "
                    "residual is 0", names, fix)


_SELECT = frozenset({"gather", "squeeze", "unsqueeze", "view", "reshape", "flatten", "contiguous",
                     "clone", "take_along_dim", "index_select", "masked_select"})


def _select_from(m: Module, node: ast.expr, at: ast.AST, op: str, depth: int = 0
                 ) -> tuple[Call | None, Callable[[str], str | None]]:
    """``op(...)`` seen through selections (``gather``, ``squeeze``, indexing) and names bound
    once; the second value rebuilds the selection around a replacement of the call, since a log
    of selected entries is the selection of the logs."""
    node = m.resolve(node, at) or node
    c = m.call(node, op)
    if c is not None:
        return c, lambda text: text
    if depth > 6:
        return None, lambda text: None
    base: ast.expr | None = None
    if isinstance(node, ast.Subscript):
        base = node.value
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SELECT
          and m.qualname(node.func.value) is None):
        base = node.func.value
    if base is None:
        return None, lambda text: None
    c, inner = _select_from(m, base, at, op, depth + 1)
    whole, head = m.seg(node), m.seg(base)
    if c is None:
        return None, inner
    if not whole.startswith(head):  # a parenthesized base: no safe text splice
        return c, lambda text: None
    tail = whole[len(head):]
    return c, lambda text: (lambda t: t + tail if t is not None else None)(inner(text))


def _log(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "log")
    if c is None or len(c.args) != 1 or c.kwargs:
        return None
    arg = c.args[0]
    inner = m.resolve(arg, node) or arg
    names = _Names(m, node)
    sm, rebuild = _select_from(m, arg, node, "softmax")
    if sm is not None:
        dim = _dim(sm, 1)
        extra = set(sm.kwargs) - {"dim", "dtype"}
        if dim is None or len(sm.args) > 2 or extra:
            return _finding("SL102", node, "log of softmax: the softmax underflows to 0 and log 0 is "
                            "-inf (NaN gradient)", no_fix="the softmax's dim is not given")
        sf = names.sf()
        args = [m.seg(sm.args[0]), m.seg(dim)]
        if "dtype" in sm.kwargs:
            args.append(f"dtype={m.seg(sm.kwargs['dtype'])}")
        fix = rebuild(f"{sf}.log_softmax({', '.join(args)})") if sf else None
        return _finding("SL102", node, "log of softmax: the softmax underflows to 0 and log 0 is -inf "
                        "(NaN gradient)", names, fix, "a selection from the softmax is parenthesized")
    sig = m.call(inner, "sigmoid")
    neg = False
    if sig is None:
        om = _one_minus(inner)
        sig = m.call(m.resolve(om, node) if om is not None else None, "sigmoid")
        neg = sig is not None
    if sig is not None and len(sig.args) == 1 and not sig.kwargs:
        tf = names.tf()
        x = sig.args[0]
        xs = f"-{m.atom(x)}" if neg else m.seg(x)
        what = "log(1 - sigmoid(x))" if neg else "log of sigmoid"
        return _finding("SL104", node, f"{what}: the sigmoid rounds to 0 (or 1) and the log is -inf "
                        "(NaN gradient)", names, f"{tf}.logsigmoid({xs})" if tf else None)
    plus = _plus_eps(m, inner)
    if plus is not None and not _no_grad(m, node):  # without a gradient the eps only guards a score
        base = m.resolve(plus[0], node) or plus[0]
        kind = _probability(m, base, node)
        par = m.parent(node)
        if kind is None and isinstance(par, ast.BinOp) and isinstance(par.op, ast.Mult) and (
                m.same(_unneg(par.left), plus[0]) or m.same(_unneg(par.right), plus[0])):
            kind = "xlogx"  # p * log(p + eps): an entropy written with an eps
        if kind is None:
            return None
        exact = {"softmax": "SF.log_softmax(x, dim)", "sigmoid": "F.logsigmoid(x)",
                 "exp": "the exponent itself (log(exp(y)) = y)", "xlogx": "SF.xlogy(p, p) or SF.entropy"}.get(
            kind, "SF.log_softmax(logits, dim) or F.logsigmoid(logits) from the logits")
        return _finding("SL108", node, f"log(p + eps) hides a log 0 and biases every value; use {exact}",
                        no_fix="dropping the eps changes the value")
    s = m.call(inner, "sum")
    if s is not None and s.args:
        e = m.call(m.resolve(s.args[0], node) or s.args[0], "exp")
        if e is not None and len(e.args) == 1 and not e.kwargs and not _shifted(m, e.args[0], node):
            dim = _dim(s, 1)
            keep = s.arg(2, "keepdim")
            if set(s.kwargs) - {"dim", "keepdim"} or len(s.args) > 3:
                return None
            sf = names.sf()
            x = e.args[0]
            if dim is None:
                fix = f"{sf}.logsumexp({m.atom(x)}.reshape(-1), 0)" if keep is None else None
            else:
                args = [m.seg(x), m.seg(dim)] + ([f"keepdim={m.seg(keep)}"] if keep is not None else [])
                fix = f"{sf}.logsumexp({', '.join(args)})"
            return _finding("SL113", node, "log(sum(exp(x))): exp overflows above 88 in float32 "
                            "(inf, NaN gradient)", names, fix if sf else None,
                            "keepdim without dim")
    if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Div) and not _no_grad(m, node):
        kinds = {_latest_kind(m, inner.left, node), _latest_kind(m, inner.right, node)}
        if kinds & {"softmax", "sigmoid"}:
            return _finding("SL102", node, "log of a ratio of probabilities: either one underflows to 0 "
                            "and the log is -inf or +inf (NaN gradient); subtract SF.log_softmax / "
                            "F.logsigmoid of the logits instead",
                            no_fix="the logits behind both probabilities are needed")
    w = m.call(inner, "where")
    if w is not None and len(w.args) == 3 and not _no_grad(m, node):
        a, b = w.args[1], w.args[2]
        om = _one_minus(b) or _one_minus(a)
        p = a if _one_minus(b) is not None else b
        if om is not None and m.same(om, p) and _latest_kind(m, p, node) in ("sigmoid", "softmax"):
            return _finding("SL104", node, "log of where(t, p, 1 - p) on sigmoid outputs: p rounds to 0 "
                            "or 1 and the log is -inf (NaN gradient); F.logsigmoid(x) and F.logsigmoid(-x) "
                            "of the logits, or F.binary_cross_entropy_with_logits",
                            no_fix="the logits are rebound before the log")
    ch = m.call(inner, "cosh")
    if ch is not None and len(ch.args) == 1 and not ch.kwargs:
        r = m.resolve(ch.args[0], node) or ch.args[0]
        sf, t = names.sf(), names.torch()
        if isinstance(r, ast.BinOp) and isinstance(r.op, ast.Sub):
            fix = f'{sf}.log_cosh_loss({m.seg(r.left)}, {m.seg(r.right)}, reduction="none")'
        else:
            rtext = m.seg(ch.args[0])
            fix = f'{sf}.log_cosh_loss({rtext}, {t}.zeros_like({rtext}), reduction="none")'
        return _finding("SL112", node, "log(cosh(r)): cosh overflows for |r| > 89 in float32 (inf, "
                        "NaN gradient)", names, fix if sf and t else None)
    return None


def _softmax_masked(m: Module, node: ast.Call) -> Finding | None:
    module = _module_op(m, node, node) == "softmax"
    c = None if module else m.call(node, "softmax", "log_softmax")
    if module:
        # ``self.softmax = nn.Softmax(dim=-1)`` then ``self.softmax(scores)``
        c = Call("softmax", node, list(node.args), {}, True)
        arg = node.args[0]
        if isinstance(arg, ast.Name) and _masked_by_neg_inf(m, arg, node):
            return _finding("SL109", node, "softmax (an nn.Softmax module) of masked_fill(mask, -inf): a "
                            "row with every entry masked is -inf - (-inf) = NaN (NaN gradient too)",
                            no_fix="the softmax is a module; call SF.softmax(scores, dim, mask=...) instead")
        return None
    if c is None or not c.args:
        return None
    log = c.op == "log_softmax"
    if c.method is False and (m.qualname(node.func) or "").startswith("stablelosses"):
        return None
    parent = m.parent(node)
    if m.call(parent, "nan_to_num") is not None:
        return None
    arg = c.args[0]
    inner = m.resolve(arg, node) or arg
    mf = m.call(inner, "masked_fill")
    msg = ("softmax of masked_fill(mask, -inf): a row with every entry masked is -inf - (-inf) = NaN "
           "(NaN gradient too)")
    if mf is None or len(mf.args) != 3 or mf.kwargs or not is_neg_inf(mf.args[2]):
        if isinstance(arg, ast.Name):
            lines = m.scope(node).inplace_neg_inf.get(arg.id, [])
            if any(ln < node.lineno for ln in lines):
                return _finding("SL109", node, msg, no_fix="the mask is applied in place "
                                f"({arg.id}.masked_fill_); pass mask= to SF.softmax by hand")
            # ``scores = scores.masked_fill(m, -inf)`` then ``softmax(scores)``: the name is bound
            # more than once, so the latest binding before the softmax decides
            before = [(ln, v) for ln, v in m.scope(node).bindings.get(arg.id, []) if ln < node.lineno]
            if before:
                last = max(before, key=lambda b: b[0])[1]
                lf = m.call(last, "masked_fill")
                fill = lf.arg(2, "value") if lf is not None else None
                if lf is not None and fill is not None and is_neg_inf(fill):
                    return _finding("SL109", node, msg, no_fix=f"`{arg.id}` is rebound by the masked_fill; "
                                    "pass mask= to SF.softmax on the unmasked scores by hand")
        return None
    dim = _dim(c, 1)
    if dim is None or len(c.args) > 2 or set(c.kwargs) - {"dim"}:
        return _finding("SL109", node, msg, no_fix="the softmax's dim is not given")
    names = _Names(m, node)
    sf = names.sf()
    mask = mf.args[1]
    keep = (mask.operand if isinstance(mask, ast.UnaryOp) and isinstance(mask.op, ast.Invert)
            else None)
    mask_text = m.seg(keep) if keep is not None else f"~{m.atom(mask)}"
    fn = "log_softmax" if log else "softmax"
    fix = f"{sf}.{fn}({m.seg(mf.args[0])}, {m.seg(dim)}, mask={mask_text})" if sf else None
    return _finding("SL109", node, msg, names, fix)


def _masked_by_neg_inf(m: Module, arg: ast.Name, node: ast.AST) -> bool:
    """The latest binding of ``arg`` before ``node`` is a ``masked_fill(..., -inf)`` (or it is
    filled in place so)."""
    scope = m.scope(node)
    if any(ln < node.lineno for ln in scope.inplace_neg_inf.get(arg.id, [])):  # type: ignore[attr-defined]
        return True
    before = [(ln, v) for ln, v in scope.bindings.get(arg.id, []) if ln < node.lineno]  # type: ignore[attr-defined]
    if not before:
        return False
    lf = m.call(max(before, key=lambda b: b[0])[1], "masked_fill")
    fill = lf.arg(2, "value") if lf is not None else None
    return fill is not None and is_neg_inf(fill)


def _bce(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "bce")
    if c is None or not c.args:
        func = node.func if isinstance(node.func, ast.Call) else m.resolve(node.func, node)
        ctor = m.call(func, "BCELoss")
        if ctor is None or not node.args:
            return None
        first = m.resolve(node.args[0], node) or node.args[0]
        if m.call(first, "sigmoid") is None and _module_op(m, first, node) != "sigmoid":
            return None
        return _finding("SL105", node, "BCELoss on sigmoid outputs: the sigmoid saturates to 0 or 1 "
                        "and the loss is clamped at 100 with a zero gradient",
                        no_fix="use nn.BCEWithLogitsLoss on the logits (the module is built elsewhere)")
    first = m.resolve(c.args[0], node) or c.args[0]
    sig = m.call(first, "sigmoid")
    if sig is None and _module_op(m, first, node) == "sigmoid":
        return _finding("SL105", node, "binary_cross_entropy of sigmoid outputs: the sigmoid saturates "
                        "to 0 or 1, the log is clamped at -100 and the gradient vanishes",
                        no_fix="the sigmoid is a module; use F.binary_cross_entropy_with_logits on its input")
    if sig is None or len(sig.args) != 1 or sig.kwargs:
        return None
    names = _Names(m, node)
    tf = names.tf()
    rest = [m.seg(a) for a in c.args[1:]] + [f"{k}={m.seg(v)}" for k, v in c.kwargs.items()]
    fix = f"{tf}.binary_cross_entropy_with_logits({', '.join([m.seg(sig.args[0]), *rest])})" if tf else None
    return _finding("SL105", node, "binary_cross_entropy of sigmoid outputs: the sigmoid saturates "
                    "to 0 or 1, the log is clamped at -100 and the gradient vanishes", names, fix)


def _kl(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "kl_div")
    args = c.args if c is not None else None
    if c is None:
        ctor = m.call(m.resolve(node.func, node) if isinstance(node.func, ast.Name) else node.func,
                      "KLDivLoss")
        if ctor is None or not node.args:
            return None
        args = node.args
    assert args is not None
    if not args:
        return None
    kind = _probability(m, args[0], node)
    if kind not in ("softmax", "sigmoid"):
        return None
    return _finding("SL110", node, f"kl_div's input is a {kind} (probabilities); it expects "
                    "log-probabilities, so the value is not a KL divergence",
                    no_fix="passing SF.log_softmax(x, dim) changes the value (the old one was wrong)")


_TEMPERATURE = re.compile(r"^(t|tau|temp|temperature|_temperature|temperature_\w*|\w*_temp|\w*_tau)$", re.I)


def _scaled_similarity(m: Module, x: ast.expr, at: ast.AST) -> bool:
    """``sim / temperature`` (or ``* logit_scale``): the logits of a contrastive loss."""
    x = m.resolve(x, at) or x
    if isinstance(x, ast.BinOp) and isinstance(x.op, ast.Div):
        return bool(_TEMPERATURE.match(_leaf_name(x.right)))
    return False


def _exp_logits(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "exp")
    if c is None or len(c.args) != 1 or c.kwargs:
        return None
    x = c.args[0]
    if _scaled_similarity(m, x, node) and _in_loss(m, node, forward=True) and not _no_grad(m, node):
        return _finding("SL113", node, "exp of similarities / temperature (a contrastive loss by hand): "
                        "with a small temperature the exponent passes 88 and exp is inf (inf / inf = "
                        "NaN); use SF.info_nce_loss, or F.cross_entropy / SF.logsumexp on the logits",
                        no_fix="what the exp feeds decides the stable op")
    name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else ""
    if not _LOGITS.search(name):  # logits, cls_logits, logits_per_text; not logit_scale
        return None
    if not _in_loss(m, node):
        return None
    if isinstance(x, ast.Name):
        binds = m.scope(node).bindings.get(x.id, [])
        if any(isinstance(v, ast.BinOp) and isinstance(v.op, ast.Sub) for _, v in binds):
            return None  # shifted somewhere in this function (logits = logits - max)
    return _finding("SL113", node, "exp of unshifted logits overflows above 88 in float32 (inf, then "
                    "NaN); subtract the max, or use SF.softmax / SF.logsumexp / SF.cross_entropy",
                    no_fix="what the exp feeds decides the stable op")


# ------------------------------------------------------------------------------ rules on operators


def _division(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, ast.Div):
        return None
    return _hand_softmax(m, node) or _div_norm(m, node) or _masked_mean(m, node) or _mask_count(m, node)


def _mask_count(m: Module, node: ast.BinOp) -> Finding | None:
    """``loss / mask.sum()`` with the sum bound anywhere in the function (``n = mask.float().sum()``
    then ``loss = loss / n``), in a loss: the masked mean in its other spellings. A per-row count
    (``mask.sum(-1)``) is SL121's."""
    if not _in_loss(m, node, forward=True) and not _loss_name(m, node):
        return None
    right = _strip_casts(m, node.right)
    values: list[ast.expr] = [right]
    if isinstance(right, ast.Name):
        values = [v for _, v in m.scope(node).bindings.get(right.id, []) if v is not None]
        if not values or len(values) != len(m.scope(node).bindings.get(right.id, [])):
            return None
    bot = None
    for v in values:
        bot = m.call(_strip_casts(m, v), "sum")
        if bot is None or not bot.args or not _is_mask(m, bot.args[0]):
            return None
    assert bot is not None
    if bot.arg(1, "dim") is not None:
        return None  # SL121
    if m.call(m.resolve(node.left, node) or node.left, "sum") is None and not isinstance(node.left, ast.Name):
        return None
    return _finding("SL111", node, "masked mean: the sum over the mask is 0 for an empty mask (a batch "
                    "with no valid token) and the quotient 0 / 0 = NaN; SF.masked_mean, or "
                    "SF.safe_div(total, count)",
                    no_fix="the count is bound on another line; divide with SF.safe_div there")


def _hand_softmax(m: Module, node: ast.BinOp) -> Finding | None:
    num = m.call(m.resolve(node.left, node) or node.left, "exp")
    right = m.resolve(node.right, node) or node.right
    unsq = None
    if (isinstance(right, ast.Call) and isinstance(right.func, ast.Attribute)
            and right.func.attr == "unsqueeze" and len(right.args) == 1
            and m.call(right.func.value, "sum") is not None):
        unsq, right = right.args[0], right.func.value  # sum(d).unsqueeze(d): keepdim by hand
    s = m.call(right, "sum")
    if num is None or s is None or len(num.args) != 1 or not s.args:
        return None
    den = m.call(m.resolve(s.args[0], node) or s.args[0], "exp")
    if den is None or len(den.args) != 1 or not m.same(num.args[0], den.args[0]):
        return None
    x = num.args[0]
    if isinstance(x, ast.Name):  # ``sx = x - x.max(...)`` on the line before: see the shift
        shifted = m.resolve(x, node)
        if isinstance(shifted, ast.BinOp) and isinstance(shifted.op, ast.Sub):
            x = shifted
    msg = "hand-written softmax: exp overflows (inf / inf = NaN) and a row of -inf is 0 / 0"
    dim, keep = _dim(s, 1), s.arg(2, "keepdim")
    if dim is None:
        return None  # a sum over everything normalizes a kernel or a histogram, not logits
    if unsq is not None:
        if keep is not None or not m.same(unsq, dim):
            return _finding("SL103", node, msg, no_fix="the sum is unsqueezed at another dim")
        keep = ast.Constant(True)
    if not _is_true(keep) or isinstance(dim, (ast.Tuple, ast.List)):
        return _finding("SL103", node, msg, no_fix="the sum is not over one dim with keepdim=True")
    # exp(x - x.max(dim, keepdim=True)[0]): the same softmax, shift-invariant, but only for a
    # shift that is constant along the softmax's dim (a max over that dim, or over everything)
    if isinstance(x, ast.BinOp) and isinstance(x.op, ast.Sub):
        mx = x.right.value if isinstance(x.right, ast.Subscript) else x.right
        if isinstance(mx, ast.Attribute) and mx.attr == "values":
            mx = mx.value
        mc = m.call(mx, "max")
        if mc is None or not mc.args or not m.same(mc.args[0], x.left):
            return _finding("SL103", node, msg, no_fix="the exponent is shifted by something that is "
                            "not the max over the softmax's dim")
        mdim = mc.arg(1, "dim")
        if mdim is not None and not m.same(mdim, dim):
            return _finding("SL103", node, msg, no_fix="the max is over another dim than the sum "
                            "(the shift is not constant along the sum)")
        x = x.left
    names = _Names(m, node)
    sf = names.sf()
    return _finding("SL103", node, msg, names, f"{sf}.softmax({m.seg(x)}, {m.seg(dim)})" if sf else None)


def _hand_norm(m: Module, node: ast.BinOp) -> bool:
    """``x / torch.sqrt(torch.sum(x ** 2, dim)...)``: a 2-norm written out."""
    r = m.resolve(node.right, node) or node.right
    while (isinstance(r, ast.Call) and isinstance(r.func, ast.Attribute)
           and r.func.attr in ("unsqueeze", "view", "reshape", "expand_as")
           and m.qualname(r.func.value) is None):
        r = r.func.value
    sq = m.call(r, "sqrt")
    if sq is None or len(sq.args) != 1:
        return False
    inner = sq.args[0]
    while (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
           and inner.func.attr in ("unsqueeze", "view", "reshape")):
        inner = inner.func.value
    s = m.call(inner, "sum")
    return s is not None and bool(s.args) and m.same(_squared(m, s.args[0]), node.left)


def _div_norm(m: Module, node: ast.BinOp) -> Finding | None:
    if _hand_norm(m, node):
        return _finding("SL107", node, "division by a norm written out (sqrt of a sum of squares): a zero "
                        "vector gives 0 / 0 = NaN (NaN gradient)",
                        no_fix="use SF.normalize(x, dim=d) (the same value, 0 at the zero vector)")
    n = m.call(m.resolve(node.right, node) or node.right, "norm")
    if n is None or not n.args or not m.same(n.args[0], node.left):
        return None
    q = m.qualname(n.node.func) or ""
    p_name = "ord" if q.startswith("torch.linalg") else "p"
    p = n.arg(1, p_name)
    dim = _dim(n, 2)
    keep = n.arg(3, "keepdim")
    msg = "division by a norm: a zero vector gives 0 / 0 = NaN (NaN gradient)"
    if set(n.kwargs) - {p_name, "dim", "keepdim"} or len(n.args) > 4:
        return _finding("SL107", node, msg, no_fix="the norm takes more than p, dim and keepdim "
                        "(a dtype= would be lost)")
    two = p is None or _is_int(p, 2) or (isinstance(p, ast.Constant) and p.value == "fro")
    if q == "torch.linalg.norm" and p is None and dim is None:
        two = False  # a matrix norm
    if not two or dim is None or not _is_true(keep) or isinstance(dim, (ast.Tuple, ast.List)):
        return _finding("SL107", node, msg, no_fix="not a 2-norm over one dim with keepdim=True")
    names = _Names(m, node)
    sf = names.sf()
    return _finding("SL107", node, msg, names,
                    f"{sf}.normalize({m.seg(node.left)}, dim={m.seg(dim)})" if sf else None)


def _masked_mean(m: Module, node: ast.BinOp) -> Finding | None:
    top = m.call(m.resolve(node.left, node) or node.left, "sum")
    bot = m.call(m.resolve(node.right, node) or node.right, "sum")
    if top is None or bot is None or not top.args or not bot.args:
        return None
    prod = m.resolve(top.args[0], node) or top.args[0]
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return None
    mask = bot.args[0]
    if not (m.same(mask, prod.left) or m.same(mask, prod.right)):
        return None
    if [ast.dump(a) for a in top.args[1:]] != [ast.dump(a) for a in bot.args[1:]]:
        return None
    if {k: ast.dump(v) for k, v in top.kwargs.items()} != {k: ast.dump(v) for k, v in bot.kwargs.items()}:
        return None
    names = _Names(m, node)
    msg = ("masked mean sum(x * mask) / mask.sum(): an empty mask gives 0 / 0 = NaN; "
           "SF.masked_mean(x, mask.bool()) for a 0/1 mask")
    if not _torch_values(m, node, [top, bot]):
        return _finding("SL111", node, msg, no_fix="the operands may be NumPy arrays (this file uses "
                        "NumPy, or no torch): a torch call would change the result's type")
    sf = names.sf()
    return _finding("SL111", node, msg, names,
                    f"{sf}.safe_div({m.seg(node.left)}, {m.seg(node.right)})" if sf else None)


def _torch_values(m: Module, node: ast.AST, calls: list[Call]) -> bool:
    """Evidence that the sums are over tensors: ``torch.sum``, or a file that imports torch
    and not NumPy, and no ``np.`` call in the operands."""
    for c in calls:
        for n in ast.walk(c.node):
            q = m.qualname(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
            if q is not None and q.split(".")[0] in ("numpy", "jax", "cupy", "pandas"):
                return False
    if all(not c.method for c in calls):
        return True
    mods = {t.split(".")[0] for t in m.aliases.values()}
    if mods & {"numpy", "jax", "cupy", "pandas", "tensorflow"}:
        return False
    return "torch" in mods


def _focal_power_call(m: Module, node: ast.Call) -> Finding | None:
    """``(1 - p).pow(gamma)``, ``torch.pow(1 - p, gamma)``."""
    c = m.call(node, "pow")
    if c is None or len(c.args) != 2 or c.kwargs:
        return None
    return _focal_power_of(m, node, c.args[0], c.args[1])


def _focal_weight_base(m: Module, base: ast.expr, at: ast.AST) -> ast.expr | None:
    """``pt = (1 - p) * t + p * (1 - t)`` (mmdetection's sigmoid focal weight): a sum of products
    one of which holds ``1 - p`` for a probability ``p``; returns ``p``."""
    if isinstance(base, ast.Name):  # pt bound with names that are bound again (target = target.float())
        for _, v in m.scope(at).bindings.get(base.id, []):
            p = _focal_weight_base(m, v, at) if isinstance(v, ast.BinOp) else None
            if p is not None:
                return p
        return None
    if not (isinstance(base, ast.BinOp) and isinstance(base.op, ast.Add)):
        return None
    for side in (base.left, base.right):
        if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult):
            for f in (side.left, side.right):
                p = _one_minus(f)
                if p is not None and _probability(m, p, at) in ("sigmoid", "softmax"):
                    return p
    return None


def _focal_power(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, ast.Pow):
        return None
    return _focal_power_of(m, node, node.left, node.right)


def _focal_power_of(m: Module, node: ast.AST, base: ast.expr, exponent: ast.expr) -> Finding | None:
    rb = m.resolve(base, node) or base
    if isinstance(exponent, ast.UnaryOp) and isinstance(exponent.op, ast.USub) and not _no_grad(m, node):
        e = m.call(rb, "exp")
        if e is not None and e.args and _LOGP.search(_leaf_name(_strip_casts(m, e.args[0]))):
            return _finding("SL114", node, "exp(logp) ** -a is exp(-a * logp): for a sequence log-prob "
                            "of a few hundred the power overflows to inf (and exp(logp) underflows to 0 "
                            "first: 0 ** -a = inf, NaN gradient); compute it as torch.exp(-a * logp)",
                            no_fix="the power is written on the probability, not on the log-prob")
    p = _one_minus(rb)
    if p is None:
        p = _focal_weight_base(m, rb, node)
    if p is None:
        return None
    g = m.resolve(exponent, node) or exponent
    if isinstance(g, ast.Constant) and isinstance(g.value, (int, float)) and g.value >= 1:
        return None  # a polynomial: its slope is finite at p = 1
    if _no_grad(m, node):
        return None  # the hazard is in the gradient only
    kind = _probability(m, p, node)
    if kind is None:
        return None
    return _finding("SL106", node, "(1 - p) ** gamma: for gamma < 1 its slope at p = 1 is inf (NaN "
                    "gradient), and log p of the same p is -inf at p = 0; use SF.focal_loss / "
                    "SF.sigmoid_focal_loss on the logits",
                    no_fix="the whole loss must become one call; its pieces cannot be rewritten alone")


# ------------------------------------------------------------------------------ post-training (2026)

_LOGP = re.compile(r"log_?p|logprob|log_prob|lprob|log_\w*pi$|log_\w*prob|logits_to_logp", re.I)
_LOG_RATIO = re.compile(r"log_?ratios?|logratio|log_?rho|log_importance|log_is_weights?|log_ratio_\w+",
                        re.I)
_MASK = re.compile(r"(^|_)(mask|masks|attention_mask|completion_mask|loss_mask|response_mask|padding_mask|"
                   r"action_mask|valid)$|_mask$|^mask", re.I)
_CASTS = frozenset({"float", "double", "half", "bfloat16", "to", "type_as", "detach", "contiguous"})
_POS_INF = re.compile(r"^-?(float\(['\"][+-]?inf(inity)?['\"]\)|(math|torch|np|numpy)\.inf)$", re.I)


def _text_of(m: Module, node: ast.AST) -> str:
    return m.seg(node) if hasattr(node, "lineno") else ast.unparse(node)


def _strip_casts(m: Module, node: ast.expr) -> ast.expr:
    """``x.float()``, ``x.to(dtype)``, ``x.detach()`` -> ``x``."""
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS
           and m.qualname(node.func.value) is None):
        node = node.func.value
    return node


def _leaf_name(node: ast.AST) -> str:
    while isinstance(node, (ast.Subscript, ast.Call)):
        node = node.value if isinstance(node, ast.Subscript) else node.func
        if isinstance(node, ast.Attribute) and node.attr in _CASTS | _PASS_THROUGH:
            node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_mask(m: Module, node: ast.expr) -> bool:
    node = _strip_casts(m, node)
    if isinstance(node, ast.Subscript):
        node = node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(name) and bool(_MASK.search(name))


def _lineage(m: Module, node: ast.expr, at: ast.AST, depth: int = 3) -> Iterator[ast.AST]:
    """Every sub-expression of ``node``, and of every value bound to a name in it in the same
    function (all bindings, not only a single one), ``depth`` names deep."""
    seen: set[str] = set()
    todo: list[tuple[ast.AST, int]] = [(node, 0)]
    scope = m.scope(at)
    while todo:
        n, d = todo.pop()
        for sub in ast.walk(n):
            yield sub
            if isinstance(sub, ast.Name) and d < depth and sub.id not in seen:
                seen.add(sub.id)
                for _, v in scope.bindings.get(sub.id, []):
                    if v is not None:
                        todo.append((v, d + 1))


def _guarded(m: Module, node: ast.expr, at: ast.AST) -> bool:
    """The value is clamped (or selected by a where / masked_fill) before it is used: in the
    expression itself or in any binding of the name."""
    node = _strip_casts(m, node)
    vals: list[ast.expr] = [node]
    if isinstance(node, ast.Name):
        vals += [v for _, v in m.scope(at).bindings.get(node.id, []) if v is not None]
    for v in vals:
        v = _strip_casts(m, v)
        if m.call(v, "clamp", "where", "masked_fill") is not None:
            return True
        if isinstance(v, ast.Call) and "clamp" in _text_of(m, v.func).rsplit(".", 1)[-1]:
            return True
    return False


def _log_ratio(m: Module, x: ast.expr, at: ast.AST, depth: int = 0) -> bool:
    """``logp - old_logp`` (not ``logp - logp.detach()``), or a name like ``log_ratio``."""
    x = _strip_casts(m, x)
    if isinstance(x, (ast.Name, ast.Attribute)) and _LOG_RATIO.search(_leaf_name(x)):
        return True
    if isinstance(x, ast.Name):  # any binding of it in the function is a log-ratio
        if depth > 3:
            return False
        vals = [v for _, v in m.scope(at).bindings.get(x.id, []) if v is not None]
        return any(_log_ratio(m, v, at, depth + 1) for v in vals if not isinstance(v, ast.Name))
    r = x
    if not (isinstance(r, ast.BinOp) and isinstance(r.op, ast.Sub)):
        return False
    a, b = _strip_casts(m, r.left), _strip_casts(m, r.right)
    if m.same(a, b):
        return False  # logp - logp.detach(): exp of 0, the value 1 with logp's gradient
    return bool(_LOGP.search(_leaf_name(a))) and bool(_LOGP.search(_leaf_name(b)))


def _exp_log_ratio(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "exp")
    if c is None or len(c.args) != 1 or c.kwargs:
        return None
    x = c.args[0]
    if not _log_ratio(m, x, node) or _guarded(m, x, node) or _no_grad(m, node):
        return None
    # exp(d) - d - 1 is SL116's; there the exp is one term of the estimator
    p = m.parent(node)
    if isinstance(p, ast.BinOp) and isinstance(p.op, ast.Sub) and _k3(m, _top_sum(m, p)) is not None:
        return None
    return _finding("SL114", node, "exp of a log-ratio with no clamp before it: a masked or stale token "
                    "with a log-ratio above 88 (float32) is inf, and the min / where / * mask that "
                    "drops it still sends 0 * inf = NaN into the gradient (a finite loss, a NaN "
                    "gradient); clamp the log-ratio first, or use SF.policy_loss",
                    no_fix="a clamp changes the value where it binds; SF.policy_loss never "
                    "exponentiates a masked position")


_LN2 = "0.6931471805599453"


def _log1mexp(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "log1p", "log")
    if c is None or len(c.args) != 1 or c.kwargs:
        return None
    arg = m.resolve(c.args[0], node) or c.args[0]
    e = None
    if c.op == "log1p" and isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
        e = m.call(arg.operand, "exp")
    elif c.op == "log" and _one_minus(arg) is not None:
        e = m.call(m.resolve(_one_minus(arg), node), "exp")
    if e is None or len(e.args) != 1 or e.kwargs:
        return None
    x = e.args[0]
    if _guarded(m, x, node):
        return None  # log1p(-exp(x.clamp(max=-log 2))): the exact branch of a log1mexp
    names = _Names(m, node)
    t = names.torch()
    fix = None
    if t and m.pure(x):
        xa = m.atom(x)
        # log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2; each branch sees its own half only
        # (a clamp), so the one not selected is finite with gradient 0, not 0 * inf, and SL118
        # sees the guard
        fix = (f"{t}.where({xa} > -{_LN2}, {t}.log(-{t}.expm1({xa}.clamp(min=-{_LN2}))), "
               f"{t}.log1p(-{t}.exp({xa}.clamp(max=-{_LN2}))))")
    return _finding("SL115", node, "log(1 - exp(x)) for a log-probability x: as x -> 0- exp(x) rounds "
                    "to 1, the value is -inf and the gradient inf (ORPO's log-odds at a sure token); "
                    "log1mexp: log(-expm1(x)) above -log 2, log1p(-exp(x)) below", names, fix,
                    "the exponent is evaluated three times in log1mexp and it calls something that "
                    "may change state")


def _terms(m: Module, node: ast.expr) -> list[tuple[int, ast.expr]]:
    """``a - b + c`` -> [(1, a), (-1, b), (1, c)] (the left-associative chain only)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return [*_terms(m, node.left), (-1 if isinstance(node.op, ast.Sub) else 1, node.right)]
    return [(1, node)]


def _top_sum(m: Module, node: ast.BinOp) -> ast.BinOp:
    p = m.parent(node)
    while isinstance(p, ast.BinOp) and isinstance(p.op, (ast.Add, ast.Sub)):
        node, p = p, m.parent(p)
    return node


def _k3(m: Module, node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``exp(d) - d - 1`` in any order of its three terms -> (exp's argument, the other d)."""
    terms = _terms(m, node)
    if len(terms) != 3:
        return None
    exps = [(s, t) for s, t in terms if s == 1 and m.call(t, "exp") is not None]
    ones = [(s, t) for s, t in terms if s == -1 and _is_int(t, 1)]
    if len(exps) != 1 or len(ones) != 1:
        return None
    rest = [(s, t) for s, t in terms if not _is_int(t, 1) and t is not exps[0][1]]
    if len(rest) != 1:
        return None
    e = m.call(exps[0][1], "exp")
    assert e is not None
    if len(e.args) != 1 or e.kwargs:
        return None
    d, (sign, other) = e.args[0], rest[0]
    if sign == -1 and m.same(_strip_casts(m, d), _strip_casts(m, other)):
        return d, other
    # exp(-x) - 1 + x: the same with d = -x
    if sign == 1 and isinstance(d, ast.UnaryOp) and isinstance(d.op, ast.USub) and m.same(d.operand, other):
        return d, d
    return None


def _exp_minus_one(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, (ast.Sub, ast.Add)) or _top_sum(m, node) is not node:
        return None
    k = _k3(m, node)
    if k is None:
        return None
    d, other = k
    names = _Names(m, node)
    t = names.torch()
    if other is d:  # exp(-x) - 1 + x
        fix = f"{t}.expm1({m.seg(d)}) + {m.atom(d.operand)}" if t else None  # type: ignore[attr-defined]
    else:
        fix = f"{t}.expm1({m.seg(d)}) - {m.atom(other)}" if t else None
    return _finding("SL116", node, "exp(d) - d - 1 cancels: for |d| below about 1e-4 in float32 the "
                    "value is rounding noise (the k3 KL estimator is then 0 or negative); "
                    "expm1(d) - d has a relative error near 2 eps / |d| instead of 2 eps / d**2 "
                    "(SF.kl_penalty(estimator='k3') for the exact value)", names, fix)


def _nonfinite_source(m: Module, node: ast.expr, at: ast.AST) -> str | None:
    """The op in ``node``'s lineage that can make an inf or NaN from finite inputs: an unguarded
    exp of a log-ratio or of a name like logits, a log or sqrt of a non-constant, a division."""
    for sub in _lineage(m, node, at):
        c = m.call(sub, "exp")
        if c is not None and c.args and (_log_ratio(m, c.args[0], at) and not _guarded(m, c.args[0], at)):
            return "exp of a log-ratio"
        c = m.call(sub, "log")
        if c is not None and c.args and not _guarded(m, c.args[0], at) and not _plus_eps(m, c.args[0]):
            if m.call(c.args[0], "softmax", "sigmoid") is not None or _probability(m, c.args[0], at):
                return "log of a probability"
    return None


def _mask_multiply(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, ast.Mult) or _no_grad(m, node):
        return None
    for x, mask in ((node.left, node.right), (node.right, node.left)):
        if not _is_mask(m, mask) or _is_mask(m, x):
            continue
        why = _nonfinite_source(m, x, node)
        if why is None:
            continue
        return _finding("SL117", node, f"x * mask after an op that can be inf ({why}): at a masked "
                        "position inf * 0 = NaN in the value, and the gradient is NaN even where the "
                        "value is masked; select with torch.where(mask, x, 0) and keep the masked "
                        "inputs finite before the op (SF.policy_loss, SF.masked_mean)",
                        no_fix="torch.where fixes the value only: the op before it must not see the "
                        "masked inputs either")
    return None


_SAFE_ONE = frozenset({"log", "sqrt", "rsqrt", "reciprocal", "log2", "log10"})


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _guard_after(m: Module, node: ast.Call) -> Finding | None:
    w = m.call(node, "where")
    if w is not None and len(w.args) == 3 and not w.kwargs:
        cond = w.args[0]
        for i in (1, 2):
            br = w.args[i]
            f = _where_branch(m, node, cond, br, i)
            if f is not None:
                return f
        return None
    n = m.call(node, "nan_to_num")
    if n is None or not n.args:
        return None
    inner = n.args[0]
    for sub in _lineage(m, inner, node, depth=1):
        c = m.call(sub, "domain")
        if (c is not None and c.args and not isinstance(c.args[0], ast.Constant)) or (
                isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div)):
            # a statistic repaired by nan_to_num carries no gradient; only a loss or a forward does
            if _no_grad(m, node) or not _in_loss(m, node, forward=True):
                return None
            return _finding("SL118", node, "nan_to_num after the op that made the inf or NaN: the "
                            "value is repaired, but the gradient at those positions is still 0 * inf = "
                            "NaN; keep the op's input in its domain instead (SF.safe_div, SF.safe_sqrt, "
                            "SF.xlogy, a double torch.where)",
                            no_fix="the input that the op must not see is not known here")
    return None


def _count(m: Module, x: ast.expr, at: ast.AST) -> bool:
    """``x`` counts elements of a comparison (``(a > t).sum()``, ``torch.sum(a > t, -1).float()``):
    it carries no gradient, so a NaN gradient cannot start there."""
    vals: list[ast.expr] = [x]
    if isinstance(x, ast.Name):
        vals = [v for _, v in m.scope(at).bindings.get(x.id, []) if v is not None]
        if not vals:
            return False
    for v in vals:
        c = m.call(_strip_casts(m, v), "sum")
        if c is None or not c.args or not isinstance(_strip_casts(m, c.args[0]), ast.Compare):
            return False
    return True


def _tested_zero(m: Module, name: str, at: ast.AST) -> bool:
    """An ``if name == 0`` in the function before ``at`` (its body returns or raises)."""
    fn = m.scope(at).node
    for n in ast.walk(fn):
        if (isinstance(n, ast.If) and n.lineno < getattr(at, "lineno", 0) and isinstance(n.test, ast.Compare)
                and isinstance(n.test.left, ast.Name) and n.test.left.id == name
                and len(n.test.ops) == 1 and isinstance(n.test.ops[0], ast.Eq)
                and _is_int(n.test.comparators[0], 0)
                and any(isinstance(b, (ast.Return, ast.Raise)) for b in n.body)):
            return True
    return False


def _through_exp(m: Module, x: ast.expr) -> ast.expr:
    """``-torch.expm1(v)``, ``torch.exp(v)`` -> ``v`` (else ``x``): a clamp of ``v`` bounds the
    op's input too (log1mexp's ``log(-expm1(x.clamp(min=-log 2)))``)."""
    c = m.call(_unneg(x), "expm1", "exp")
    return c.args[0] if c is not None and len(c.args) == 1 and not c.kwargs else x


def _where_branch(m: Module, node: ast.Call, cond: ast.expr, br: ast.expr, i: int) -> Finding | None:
    """``torch.where(cond, op(x), other)`` where ``cond`` tests ``x``: the guard after the op."""
    c = m.call(br, "domain")
    div = isinstance(br, ast.BinOp) and isinstance(br.op, ast.Div)
    if div:
        x: ast.expr | None = br.right  # type: ignore[attr-defined]
    elif c is not None and len(c.args) == 1 and not c.kwargs:
        x = c.args[0]
    else:
        return None
    if (x is None or isinstance(x, ast.Constant) or _guarded(m, _through_exp(m, x), node)
            or _plus_eps(m, x) is not None):
        return None
    if not (_names_in(x) & _names_in(cond)) or _no_grad(m, node) or _count(m, x, node):
        return None
    if isinstance(x, ast.Name) and _tested_zero(m, x.id, node):
        return None  # ``if beta == 0: return ...`` before: the divisor is not 0 here
    op = "division" if div else _text_of(m, c.node.func).rsplit(".", 1)[-1]  # type: ignore[union-attr]
    names = _Names(m, node)
    t = names.torch()
    fix = None
    simple = isinstance(x, (ast.Name, ast.Attribute, ast.Subscript)) and m.pure(cond) and m.pure(x)
    if t and simple and (div or op in _SAFE_ONE):
        safe = (f"{t}.where({m.seg(cond)}, {m.seg(x)}, 1)" if i == 1
                else f"{t}.where({m.seg(cond)}, 1, {m.seg(x)})")
        if div:
            new_br = f"{m.atom(br.left)} / {safe}"  # type: ignore[attr-defined]
        elif c is not None and c.method:
            new_br = f"{safe}.{op}()"
        else:
            new_br = f"{_text_of(m, c.node.func)}({safe})"  # type: ignore[union-attr]
        parts = [m.seg(a) for a in node.args]
        parts[i] = new_br
        fix = f"{_text_of(m, node.func)}({', '.join(parts)})"
    return _finding("SL118", node, f"torch.where after the {op} it guards: the branch that is not "
                    "selected is still computed, and its gradient 0 * inf = NaN reaches the input; "
                    "give the op a safe input there too (the double where)", names, fix,
                    "the guarded input is not a plain name, or the condition calls something")


def _entropy_by_hand(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, ast.Mult) or _no_grad(m, node):
        return None
    p = m.parent(node)
    if isinstance(p, ast.Attribute) and p.attr in ("nansum", "nanmean"):
        return None  # the NaN of 0 * -inf is dropped by the sum on purpose (no gradient use)
    for a, b in ((node.left, node.right), (node.right, node.left)):
        a, b = _strip_casts(m, _unneg(a)), _strip_casts(m, _unneg(b))
        ra, rb = m.resolve(a, node) or a, m.resolve(b, node) or b
        e = m.call(ra, "exp")
        if e is not None and len(e.args) == 1 and (m.same(e.args[0], b) or m.same(e.args[0], rb)):
            kind, p_text = "exp(logp) * logp", None
            if m.pure(b):
                p_text = f"{m.atom(b)}.exp()"
        else:
            lg = m.call(rb, "log")
            if lg is None or len(lg.args) != 1 or not (m.same(lg.args[0], a) or m.same(lg.args[0], ra)):
                continue
            if _probability(m, a, node) is None:
                continue
            kind, p_text = "p * log(p)", (m.seg(a) if m.pure(a) else None)
        names = _Names(m, node)
        sf = names.sf()
        fix = f"{sf}.xlogy({p_text}, {p_text})" if sf and p_text else None
        return _finding("SL119", node, f"{kind}: where p is 0 (a masked or -inf logit, an underflow) "
                        "this is 0 * -inf = NaN in the value and the gradient; SF.xlogy(p, p) is 0 "
                        "there with gradient 0 (SF.entropy(logits, dim) for the whole entropy)",
                        names, fix, "the probability is made by a call that may change state")
    return None


def _kl_log_target(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "kl_div")
    if c is None or not _is_true(c.kwargs.get("log_target")) or len(c.args) < 2:
        return None
    fn = m.scope(node).node
    if not isinstance(fn, ast.Module) and any(
            isinstance(n, (ast.Name, ast.arg)) and re.search(r"support_mask|top_?k|vocab_mask",
                                                           n.id if isinstance(n, ast.Name) else n.arg, re.I)
            for n in ast.walk(fn)):
        return _finding("SL120", node, "F.kl_div(log_target=True) in a function that masks the vocabulary "
                        "(a support or top-k mask): where input and target are both -inf the term is "
                        "0 * NaN = NaN; SF.kl_div, or SF.distillation_loss(mask=...)",
                        no_fix="the masked positions must be dropped, not rewritten")
    for a in c.args[:2]:
        for sub in _lineage(m, a, node):
            fill = m.call(sub, "masked_fill")
            if (fill is not None and len(fill.args) == 3 and is_neg_inf(fill.args[2])) or (
                    isinstance(sub, (ast.UnaryOp, ast.Call, ast.Attribute)) and is_neg_inf(sub)):
                return _finding("SL120", node, "F.kl_div(log_target=True) on masked log-probs: where "
                                "input and target are both -inf the term is exp(-inf) * (-inf - (-inf)) = "
                                "0 * NaN = NaN; SF.kl_div, or SF.distillation_loss(mask=...)",
                                no_fix="the masked positions must be dropped, not rewritten")
    return None


def _row_mean(m: Module, node: ast.BinOp) -> Finding | None:
    if not isinstance(node.op, ast.Div):
        return None
    bot = m.call(m.resolve(node.right, node) or node.right, "sum")
    if bot is None or not bot.args or bot.arg(1, "dim") is None:
        return None
    if not _is_mask(m, bot.args[0]):
        return None
    top = m.call(m.resolve(node.left, node) or node.left, "sum")
    if top is None or not top.args or top.arg(1, "dim") is None:
        return None
    if _in_loss(m, node, forward=True) is False and not _loss_name(m, node):
        return None
    names = _Names(m, node)
    msg = ("a per-sequence mean x.sum(-1) / mask.sum(-1): an all-padding sequence (an empty "
           "completion, a truncated row) is 0 / 0 = NaN for its row and, through the mean over rows, "
           "for the loss; SF.safe_div gives 0 with gradient 0 there")
    if not _torch_values(m, node, [top, bot]):
        return _finding("SL121", node, msg, no_fix="the operands may be NumPy arrays")
    sf = names.sf()
    return _finding("SL121", node, msg, names,
                    f"{sf}.safe_div({m.seg(node.left)}, {m.seg(node.right)})" if sf else None)


def _loss_name(m: Module, node: ast.AST) -> bool:
    """The statement assigns to a name like ``loss`` / ``kl``."""
    p = m.parent(node)
    while p is not None and not isinstance(p, ast.stmt):
        p = m.parent(p)
    if isinstance(p, ast.Assign):
        return any(isinstance(t, ast.Name) and re.search(r"loss|kl|entropy", t.id, re.I) for t in p.targets)
    return isinstance(p, ast.Return)


def _clamp_no_grad(m: Module, node: ast.Call) -> Finding | None:
    c = m.call(node, "clamp_")
    if c is None or not c.method or not isinstance(c.args[0], ast.Name):
        return None
    stmt = m.parent(node)
    if not isinstance(stmt, ast.Expr):
        return None
    w = m.parent(stmt)
    if not isinstance(w, ast.With):
        return None
    ctx = [i.context_expr.func if isinstance(i.context_expr, ast.Call) else i.context_expr for i in w.items]
    if not any(m.qualname(e) in ("torch.no_grad", "torch.autograd.no_grad") for e in ctx):
        return None
    name = c.args[0].id
    end = w.end_lineno or w.lineno
    scope = m.scope(node)
    used_after = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                     and n.lineno > end and m.scope_of.get(id(n)) is scope for n in ast.walk(scope.node))
    if not used_after or isinstance(scope.node, ast.Module):
        return None
    return _finding("SL122", node, f"{name}.{c.node.func.attr}() under torch.no_grad(): the forward "  # type: ignore[attr-defined]
                    "uses the clamped value but the graph does not know it, so the gradient is the "
                    "unclamped one (straight-through), and a value at the bound gets the gradient "
                    "of a point it is not at (torch's gaussian_nll_loss does this on purpose)",
                    no_fix=f"{name} = {name}.clamp(...) outside no_grad changes the gradient; keep "
                    "the straight-through one only if it is meant")


_CALL_RULES: list[Callable[[Module, ast.Call], Finding | None]] = [
    _sqrt, _log1mexp, _log, _focal_power_call, _softmax_masked, _bce, _kl_log_target, _kl, _exp_log_ratio,
    _exp_logits, _guard_after, _clamp_no_grad]
_BINOP_RULES: list[Callable[[Module, ast.BinOp], Finding | None]] = [
    _division, _row_mean, _focal_power, _exp_minus_one, _entropy_by_hand, _mask_multiply]


def _empty_branch(m: Module, node: ast.AST) -> bool:
    """In the body of ``if x.numel() == 0:`` (or ``if not x.numel():``): an empty tensor has no
    value to overflow or divide."""
    child, p = node, m.parent(node)
    while p is not None:
        if isinstance(p, ast.If) and child in p.body:
            t = p.test
            if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
                t = t.operand
            elif (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
                  and _is_int(t.comparators[0], 0)):
                t = t.left
            if isinstance(t, ast.Call) and isinstance(t.func, ast.Attribute) and t.func.attr == "numel":
                return True
        child, p = p, m.parent(p)
    return False


def _through_names(m: Module, f: Finding) -> None:
    """A rewrite that saw through ``p = value`` pastes (part of) ``value`` where ``p`` was used:
    it keeps the meaning only if ``value`` gives the same tensor when evaluated again (no module
    call, no dropout, no sampling) and nothing changed ``p`` or the names in ``value`` in place.
    Otherwise the finding stays, without its rewrite. Where the rewrite no longer reads ``p``
    and every other read of ``p`` was inside the rewritten expression, the binding in the same
    function goes with it (no dead ``mse = ...`` line); a module-level binding stays (another
    module may import it)."""
    drop: list[ast.stmt] = []
    pending: list[tuple[str, ast.expr, ast.stmt]] = []
    fix_reads = _fix_reads(f.fix)
    for use, value in m.crossed:
        parent = m.parent(use)
        if isinstance(parent, ast.Call) and parent.func is use:
            continue  # ``crit = nn.MSELoss()`` then ``crit(a, b)``: the callee is not pasted
        name = use.id if isinstance(use, ast.Name) else None
        mutated = name is not None and name in m.scope(use).mutated
        if not m.pure(value) or not m.stable_names(value, use) or mutated:
            what = m.seg(use)
            f.fix, f.imports, f.drop = None, set(), []
            f.no_fix = (f"the rewrite would evaluate `{what}`'s value again (or miss an in-place change "
                        f"of it); rewrite the line that makes `{what}` by hand")
            return
        stmt = m.parent(value)
        if (name is not None and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
                and isinstance(m.parent(stmt), (ast.FunctionDef, ast.AsyncFunctionDef))
                and m.scope(stmt) is m.scope(use) and fix_reads is not None and name not in fix_reads
                and not _declared_elsewhere(m.scope(use), name)):
            pending.append((name, use, stmt))
    # a binding goes when every read of its name is inside the rewrite or inside a binding that
    # goes (``sx = x - x.max()``, ``ex = sx.exp()``, ``ex / ex.sum()``: both lines go)
    changed = True
    while changed:
        changed = False
        for name, use, stmt in pending:
            if stmt in drop:
                continue
            inside = {id(n) for root in [f.node, *drop] for n in ast.walk(root)}
            reads = m.reads(name, m.scope(use))
            if reads and all(id(n) in inside for n in reads):
                drop.append(stmt)
                changed = True
    f.drop = drop


def _fix_reads(fix: str | None) -> set[str] | None:
    """The names the replacement text reads; None when it does not parse (then nothing goes)."""
    try:
        tree = ast.parse(fix or "", mode="eval")
    except SyntaxError:
        return None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _declared_elsewhere(scope: Scope, name: str) -> bool:
    """``global name`` / ``nonlocal name`` in the function or one nested in it, or a call of
    ``locals``/``vars``/``eval``/``exec``: the binding may be read where the resolver cannot see."""
    for n in ast.walk(scope.node):
        if isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in (
                "locals", "vars", "eval", "exec"):
            return True
    return False


def check_tree(m: Module) -> Iterator[Finding]:
    """Every finding in the module, in source order; a report-only SL113 inside another finding
    is dropped (the outer one names the stable op)."""
    found: list[Finding] = []
    for node in ast.walk(m.tree):
        rules: list = _CALL_RULES if isinstance(node, ast.Call) else (
            _BINOP_RULES if isinstance(node, ast.BinOp) else [])
        for rule in rules:
            m.crossed = []
            try:
                f = rule(m, node)
            except RecursionError:  # generated code nested thousands deep: not a loss to lint
                f = None
            if f is not None:
                if f.fix:
                    _through_names(m, f)
                found.append(f)
                break
    spans = [(f.line, f.col, *f.end) for f in found if f.code != "SL113" or f.fix]

    def inside(f: Finding) -> bool:
        a = (f.line, f.col)
        b = f.end
        return any((s[0], s[1]) <= a and b <= (s[2], s[3]) and (s[0], s[1], s[2], s[3]) != (*a, *b)
                   for s in spans)

    kept = [f for f in found if not (f.code == "SL113" and f.fix is None and inside(f))
            and not _empty_branch(m, f.node)]
    kept.sort(key=lambda f: (f.line, f.col, f.code))
    yield from kept
