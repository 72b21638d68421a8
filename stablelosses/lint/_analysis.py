"""What the rules need to know about a module: import aliases, calls by qualified name, the one
assignment of a local name, and source text of sub-expressions. Standard library only (``ast``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

__all__ = ["Call", "Module", "Scope"]

# conventional names that snippets use without importing them
_DEFAULT_ALIASES = {"torch": "torch", "F": "torch.nn.functional", "nn": "torch.nn"}

# op -> (qualified function names, method names on a tensor)
OPS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    k: (frozenset(f), frozenset(m))
    for k, (f, m) in {
        "sqrt": ({"torch.sqrt"}, {"sqrt"}),
        "log": ({"torch.log"}, {"log"}),
        "exp": ({"torch.exp"}, {"exp"}),
        "log1p": ({"torch.log1p", "torch.special.log1p"}, {"log1p"}),
        "expm1": ({"torch.expm1", "torch.special.expm1"}, {"expm1"}),
        "where": ({"torch.where"}, set()),
        "domain": ({"torch.log", "torch.sqrt", "torch.rsqrt", "torch.reciprocal", "torch.log2", "torch.log10",
                    "torch.acos", "torch.asin", "torch.atanh", "torch.exp", "torch.special.logit",
                    "torch.logit"},
                   {"log", "sqrt", "rsqrt", "reciprocal", "log2", "log10", "acos", "asin", "atanh", "exp",
                    "logit"}),
        "clamp_": (set(), {"clamp_", "clamp_min_", "clamp_max_", "clip_"}),
        "cosh": ({"torch.cosh"}, {"cosh"}),
        "sum": ({"torch.sum"}, {"sum"}),
        "mean": ({"torch.mean"}, {"mean"}),
        "pow": ({"torch.pow"}, {"pow"}),
        "square": ({"torch.square"}, {"square"}),
        "softmax": ({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax",
                     "stablelosses.functional.softmax", "stablelosses.softmax"}, {"softmax"}),
        "log_softmax": ({"torch.log_softmax", "torch.nn.functional.log_softmax",
                         "torch.special.log_softmax"}, {"log_softmax"}),
        "sigmoid": ({"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"}, {"sigmoid"}),
        "norm": ({"torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm"}, {"norm"}),
        "masked_fill": ({"torch.masked_fill"}, {"masked_fill"}),
        "max": ({"torch.max", "torch.amax"}, {"max", "amax"}),
        "clamp": ({"torch.clamp", "torch.clip", "torch.clamp_min"}, {"clamp", "clip", "clamp_min"}),
        "mse_loss": ({"torch.nn.functional.mse_loss"}, set()),
        "bce": ({"torch.nn.functional.binary_cross_entropy"}, set()),
        "kl_div": ({"torch.nn.functional.kl_div"}, set()),
        "nan_to_num": ({"torch.nan_to_num"}, {"nan_to_num"}),
        "MSELoss": ({"torch.nn.MSELoss", "torch.nn.modules.loss.MSELoss"}, set()),
        "KLDivLoss": ({"torch.nn.KLDivLoss"}, set()),
        "BCELoss": ({"torch.nn.BCELoss"}, set()),
    }.items()
}


_IMPURE = re.compile(r"(^|_)(dropout|rand|randn|randint|randperm|normal|bernoulli|multinomial|poisson|"
                     r"uniform|manual_seed|seed|empty|print|backward|step)($|_)|_$", re.I)
# tensor methods that compute a new tensor from the old ones and nothing else
_PURE_METHODS = frozenset({
    "softmax", "log_softmax", "sigmoid", "exp", "log", "sqrt", "abs", "neg", "float", "double", "half",
    "bfloat16", "to", "type_as", "view", "view_as", "reshape", "reshape_as", "flatten", "squeeze",
    "unsqueeze", "transpose", "permute", "t", "contiguous", "clone", "detach", "gather", "index_select",
    "masked_fill", "masked_select", "where", "sum", "mean", "max", "amax", "min", "amin", "pow",
    "square", "norm", "clamp", "clamp_min", "clamp_max", "clip", "add", "sub", "mul", "div",
    "expand", "expand_as", "repeat", "narrow", "select", "split", "chunk", "long", "int", "bool",
    "logsumexp", "cumsum", "matmul", "mm", "bmm", "log1p", "expm1", "tanh", "relu", "values",
    "logsigmoid", "item",
})


@dataclass
class Call:
    """A call seen as one op: ``args`` starts with the tensor a method is called on."""

    op: str
    node: ast.Call
    args: list[ast.expr]
    kwargs: dict[str, ast.expr]
    method: bool

    def arg(self, index: int, name: str) -> ast.expr | None:
        """The argument by position (counting the receiver of a method) or keyword."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if index < len(self.args) else None


@dataclass
class Scope:
    """One function (or the module): where each local name is bound."""

    node: ast.AST
    parent: Scope | None = None
    # name -> every binding: the assigned value, or None for a parameter, loop target, augmented
    # assignment, import, ... (anything the resolver must not see through)
    bindings: dict[str, list[tuple[int, ast.expr | None]]] = field(default_factory=dict)
    # name -> lines where ``name.masked_fill_(mask, -inf)`` runs as a statement
    inplace_neg_inf: dict[str, list[int]] = field(default_factory=dict)
    # name -> the module an import in this scope binds it to (one entry per import statement)
    imports: dict[str, list[str]] = field(default_factory=dict)
    # names changed in place in this scope: ``x[i] = v``, ``x.attr = v``, ``x.add_(...)``
    mutated: set[str] = field(default_factory=set)

    def bind(self, name: str, line: int, value: ast.expr | None) -> None:
        self.bindings.setdefault(name, []).append((line, value))


def is_neg_inf(node: ast.expr) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, ``-np.inf``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float":
        if len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
            return str(node.args[0].value).strip().lower() in ("-inf", "-infinity")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = node.operand
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "float":
            return (len(v.args) == 1 and isinstance(v.args[0], ast.Constant)
                    and str(v.args[0].value).strip().lower() in ("inf", "infinity", "+inf"))
        if isinstance(v, ast.Attribute) and v.attr == "inf":
            return True
    return False


def _note_mutated(target: ast.Attribute | ast.Subscript, scope: Scope) -> None:
    """``x.a[i].b = …`` mutates ``x``: the name under the attributes and subscripts."""
    base = target.value
    while isinstance(base, (ast.Attribute, ast.Subscript)):
        base = base.value
    if isinstance(base, ast.Name):
        scope.mutated.add(base.id)


class Module:
    """A parsed module: aliases, scopes, parents, and the resolver the rules use."""

    def __init__(self, source: str, tree: ast.Module | None = None, path: str = "") -> None:
        self.source = source
        self.path = path.replace("\\", "/")
        self.tree = tree if tree is not None else ast.parse(source)
        self.aliases: dict[str, str] = {}
        self.parents: dict[int, ast.AST] = {}
        self.scope_of: dict[int, Scope] = {}
        # ``self.NAME = value`` in a class's methods ((class node id, attribute) -> values)
        self.self_attrs: dict[tuple[int, str], list[ast.expr]] = {}
        self._lines: list[bytes] | None = None
        self.scopes: list[Scope] = []
        # (use, value) for every name seen through since the last reset (see `resolve`)
        self.crossed: list[tuple[ast.expr, ast.expr]] = []
        self._collect()

    # ---------------------------------------------------------------- collection

    def _collect(self) -> None:
        module_scope = Scope(self.tree)
        self.scope_of[id(self.tree)] = module_scope
        self.scopes = [module_scope]
        stack: list[tuple[ast.AST, Scope]] = [(self.tree, module_scope)]
        while stack:
            node, scope = stack.pop()
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    inner = Scope(child, scope)
                    self.scopes.append(inner)
                    a = child.args
                    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                        if arg is not None:
                            inner.bind(arg.arg, child.lineno, None)
                    if not isinstance(child, ast.Lambda):
                        scope.bind(child.name, child.lineno, None)
                elif isinstance(child, ast.ClassDef):
                    scope.bind(child.name, child.lineno, None)
                self._note(child, scope)
                self.scope_of[id(child)] = inner
                stack.append((child, inner))

    def _import(self, scope: Scope, name: str, target: str, line: int) -> None:
        self.aliases[name] = target
        scope.imports.setdefault(name, []).append(target)
        scope.bind(name, line, None)

    def _note(self, node: ast.AST, scope: Scope) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    self._import(scope, a.asname, a.name, node.lineno)
                else:
                    top = a.name.split(".")[0]
                    self._import(scope, top, top, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module and not node.level:
                    self._import(scope, a.asname or a.name, f"{node.module}.{a.name}", node.lineno)
                else:  # a relative import binds a name that is none of torch's
                    scope.bind(a.asname or a.name, node.lineno, None)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    scope.bind(t.id, node.lineno, node.value if len(node.targets) == 1 else None)
                elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id == "self"):
                    cls = self._class_of(node)
                    self.self_attrs.setdefault((id(cls), t.attr), []).append(node.value)
                elif isinstance(t, (ast.Attribute, ast.Subscript)):
                    _note_mutated(t, scope)
                else:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            scope.bind(n.id, node.lineno, None)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            t = node.target
            if isinstance(t, (ast.Attribute, ast.Subscript)):
                _note_mutated(t, scope)
            if isinstance(t, ast.Name):
                value = node.value if isinstance(node, ast.AnnAssign) else None
                scope.bind(t.id, node.lineno, value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            for n in ast.walk(node.target):
                if isinstance(n, ast.Name):
                    scope.bind(n.id, getattr(node, "lineno", 0), None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    for n in ast.walk(item.optional_vars):
                        if isinstance(n, ast.Name):
                            scope.bind(n.id, node.lineno, None)
        elif isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            scope.bind(node.target.id, node.lineno, None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            if attr.endswith("_") and not attr.startswith("_") and isinstance(node.func.value, ast.Name):
                scope.mutated.add(node.func.value.id)  # x.add_(...), x.clamp_(...)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if (isinstance(f, ast.Attribute) and f.attr == "masked_fill_" and isinstance(f.value, ast.Name)
                    and len(node.value.args) == 2 and is_neg_inf(node.value.args[1])):
                scope.inplace_neg_inf.setdefault(f.value.id, []).append(node.lineno)

    # ---------------------------------------------------------------- queries

    def _class_of(self, node: ast.AST) -> ast.ClassDef | None:
        p = self.parents.get(id(node))
        while p is not None and not isinstance(p, ast.ClassDef):
            p = self.parents.get(id(p))
        return p

    def name_target(self, name: str, at: ast.AST | None) -> str | None:
        """The module ``name`` is bound to at ``at``: the innermost scope that binds ``name``
        decides, and only an import (every binding of it there) makes it a module; a name no
        scope binds is read by convention (``torch``, ``F``, ``nn`` in a snippet)."""
        s: Scope | None = self.scope_of.get(id(at), self.scopes[0]) if at is not None else self.scopes[0]
        while s is not None:
            if s.bindings.get(name):
                targets = s.imports.get(name, [])
                if len(targets) == len(s.bindings[name]) and len(set(targets)) == 1:
                    return targets[0]
                return None
            s = s.parent
        if any(sc.bindings.get(name) for sc in self.scopes):
            return None  # bound elsewhere (an import inside another function): not here
        return _DEFAULT_ALIASES.get(name)

    def qualname(self, node: ast.expr) -> str | None:
        """``F.softmax`` -> ``'torch.nn.functional.softmax'`` (None for a non-module value),
        with ``F`` looked up in the scopes around ``node``."""
        if isinstance(node, ast.Name):
            return self.name_target(node.id, node)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def call(self, node: ast.AST | None, *ops: str) -> Call | None:
        """``node`` as a call of one of ``ops`` (function or tensor-method spelling), else None."""
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        q = self.qualname(f)
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        for op in ops:
            funcs, methods = OPS[op]
            if q in funcs:
                return Call(op, node, list(node.args), kwargs, False)
            if (isinstance(f, ast.Attribute) and f.attr in methods and self.qualname(f.value) is None):
                return Call(op, node, [f.value, *node.args], kwargs, True)
        return None

    def scope(self, node: ast.AST) -> Scope:
        return self.scope_of[id(node)]

    def resolve(self, node: ast.expr | None, at: ast.AST | None = None) -> ast.expr | None:
        """See through a local name bound exactly once, before its use, to a value whose own
        names are bound at most once in that scope (so the value still holds where it is used).
        Also ``self.attr`` assigned exactly once in the methods of the same class. Anything else
        is returned as is. Every name seen through is noted in `crossed` (a rewrite that pastes
        the value there evaluates it again)."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            cls = self._class_of(node)
            values = self.self_attrs.get((id(cls), node.attr), []) if cls is not None else []
            if len(values) == 1:
                self.crossed.append((node, values[0]))
                return values[0]
            return node
        if not isinstance(node, ast.Name):
            return node
        scope: Scope | None = self.scope(at if at is not None else node)
        # a name the function never binds is read from the enclosing scopes (a module-level
        # ``criterion = nn.MSELoss()``); there it must be bound once, and the use is later
        while scope is not None and not scope.bindings.get(node.id) and scope.parent is not None:
            scope = scope.parent
        assert scope is not None
        binds = scope.bindings.get(node.id, [])
        if len(binds) != 1:
            return node
        line, value = binds[0]
        local = scope is self.scope(at if at is not None else node)
        if value is None or (local and line >= node.lineno):
            return node
        for n in ast.walk(value):
            if isinstance(n, ast.Name) and len(scope.bindings.get(n.id, [])) > 1:
                return node
        self.crossed.append((node, value))
        return value

    def pure(self, value: ast.expr) -> bool:
        """Evaluating ``value`` again gives the same tensor and changes nothing: only names,
        constants, operators, indexing and torch's (or a tensor's) deterministic out-of-place
        calls; no module call (``self.body(x)``), no dropout or sampling, no ``x.add_``."""
        for n in ast.walk(value):
            if isinstance(n, (ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr, ast.Lambda)):
                return False
            if not isinstance(n, ast.Call):
                continue
            q = self.qualname(n.func)
            if q is not None:
                leaf = q.rsplit(".", 1)[-1]
                torchy = q.startswith(("torch.", "stablelosses.", "math."))
                if not torchy or _IMPURE.search(leaf) or leaf[0].isupper():
                    return False
            elif isinstance(n.func, ast.Attribute):
                if n.func.attr not in _PURE_METHODS:
                    return False
            else:
                return False
        return True

    def stable_names(self, value: ast.expr, at: ast.AST) -> bool:
        """No name in ``value`` is changed in place in the scope of ``at``."""
        scope = self.scope(at)
        return not any(isinstance(n, ast.Name) and n.id in scope.mutated for n in ast.walk(value))

    def reads(self, name: str, scope: Scope) -> list[ast.Name]:
        """Every read (or ``del``) of ``name`` that reaches its binding in ``scope``: in the scope
        itself and in the functions nested in it that do not bind ``name`` (a closure)."""
        out = []
        for n in ast.walk(scope.node):
            if not (isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Store)):
                continue
            s = self.scope_of.get(id(n))
            while s is not None and s is not scope and not s.bindings.get(name):
                s = s.parent
            if s is scope:
                out.append(n)
        return out

    def seg(self, node: ast.AST) -> str:
        """The node's source text (ast's columns are UTF-8 byte offsets)."""
        if self._lines is None:
            self._lines = [ln.encode("utf-8") for ln in self.source.splitlines(keepends=True)]
        lines = self._lines
        l0, c0 = node.lineno, node.col_offset  # type: ignore[attr-defined]
        l1, c1 = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
        if l1 is None or c1 is None or l1 > len(lines):  # pragma: no cover - no positions
            return ast.unparse(node)
        if l0 == l1:
            return lines[l0 - 1][c0:c1].decode("utf-8")
        parts = [lines[l0 - 1][c0:], *lines[l0:l1 - 1], lines[l1 - 1][:c1]]
        return b"".join(parts).decode("utf-8")

    def atom(self, node: ast.AST) -> str:
        """Source text, parenthesized unless it is a name, attribute, call, subscript or constant."""
        text = self.seg(node)
        simple = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
        return text if isinstance(node, simple) else f"({text})"

    def same(self, a: ast.AST | None, b: ast.AST | None) -> bool:
        return a is not None and b is not None and ast.dump(a) == ast.dump(b)

    def alias_for(self, module: str, at: ast.AST | None = None) -> str | None:
        """A name bound to ``module`` at ``at`` (``F`` for torch.nn.functional), else None."""
        for name, target in self.aliases.items():
            if target == module and self.name_target(name, at) == module:
                return name
        return None

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self.parents.get(id(node))
