"""One graph serves every shape (docs/design.md, "Composable"): ``torch.export`` with dynamic dimensions and
``torch.compile(dynamic=True)`` on the calls where a size or a float argument was once read as a
Python number, which fixed it in the graph.

- ``cross_entropy(label_smoothing=...)``: the smoothing sum's power-of-two scale came from the
  class count's bits (the class count was fixed);
- ``policy_loss``: ``float(B)`` / ``float(B * T)`` (the batch was fixed; for ``'dr_grpo'``
  silently: the program divided by the example's ``B·T``);
- the linear losses with the default ``chunk_size``: the rows per chunk came from the
  vocabulary's bits (the vocabulary was fixed);
- ``safe_div`` under ``torch.compile(dynamic=True)``: ``math.isfinite`` of the symbolic ``fill``
  broke the graph;
- ``ctc_loss``: torch's kernel has an output of data-dependent shape (it now runs as one opaque
  op while tracing).
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import stablelosses.functional as SF

pytestmark = pytest.mark.slow


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _exported_matches_eager(fn, example, other, dynamic_shapes):
    program = torch.export.export(_Call(fn), example, dynamic_shapes=(dynamic_shapes,))  # forward(*args)
    torch.testing.assert_close(program.module()(*other), fn(*other), rtol=1e-6, atol=1e-6)


def _classes(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)


def test_cross_entropy_with_smoothing_exports_a_dynamic_class_count():
    n, c = Dim("n"), Dim("c")
    _exported_matches_eager(lambda x, t: SF.cross_entropy(x, t, label_smoothing=0.1),
                            _classes(4, 5, 0), _classes(7, 9, 1), ({0: n, 1: c}, {0: n}))


def _policy_inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(b, t, generator=g) * 3, -torch.rand(b, t, generator=g) * 3,
            torch.randn(b, generator=g), torch.rand(b, t, generator=g) > 0.3)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_policy_loss_exports_a_dynamic_batch_and_length(loss_type):
    b, t = Dim("b"), Dim("t")
    _exported_matches_eager(lambda *a: SF.policy_loss(*a, loss_type=loss_type), _policy_inputs(4, 3, 0),
                            _policy_inputs(7, 6, 1), ({0: b, 1: t}, {0: b, 1: t}, {0: b}, {0: b, 1: t}))


def _linear_inputs(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(v, 8, generator=g), torch.randint(0, v, (n,), generator=g)


def test_linear_cross_entropy_exports_a_dynamic_vocabulary():
    n, v = Dim("n"), Dim("v")
    _exported_matches_eager(SF.linear_cross_entropy, _linear_inputs(4, 5, 0), _linear_inputs(7, 9, 1),
                            ({0: n}, {0: v}, {0: n}))


def test_safe_div_compiles_with_dynamic_shapes_and_a_default_fill():
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: SF.safe_div(a, b), fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 5), (7, 3)]:
        a = torch.randn(shape, generator=g, requires_grad=True)
        b = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) > 0.3)
        got, want = f(a, b), SF.safe_div(a, b)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), a)[0], torch.autograd.grad(want.sum(), a)[0])


def _ctc_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, n, 5, generator=g).log_softmax(2), torch.randint(1, 5, (n, 3), generator=g),
            torch.full((n,), 8), torch.full((n,), 3))


def test_ctc_loss_exports_a_dynamic_batch():
    """torch's own F.ctc_loss cannot be exported (an output of data-dependent shape)."""
    n = Dim("n")
    _exported_matches_eager(SF.ctc_loss, _ctc_inputs(3, 0), _ctc_inputs(5, 1), ({1: n}, {0: n}, {0: n}, {0: n}))
