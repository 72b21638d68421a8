"""Vocabulary-parallel linear losses (``process_group=`` / a ``Shard(0)`` DTensor).

The multi-process tests run ``tests/scripts/dist_linear.py`` with 2 and 4 gloo processes on
CPU (and 3 for torch's split (2, 2, 0) of 4 classes): loss and gradients equal the one-process
call (float64 1e-12 relative, float32 a few ulp) on every rank, bit-identical across ranks, with
z-loss, softcap, label smoothing, class weights (replicated and sharded), ignore_index, mask,
focal, +inf logits (the limit, also against cross_entropy on the materialized logits) and a
finfo.max logit, a fully masked shard, an all-masked batch, uneven shards (given and default
``vocab_start``), empty shards and the DTensor form; the forward makes 2 all-reduces and the
backward 1, with no host read; a layout that does not cover the vocabulary once raises
ValueError. The argument checks need no process group.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import stablelosses.functional as SF
from stablelosses.functional._linear_parallel import is_dtensor

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def _run(world: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "dist_linear.py"), str(world)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_two_ranks_equal_one_process():
    out = _run(2)
    assert "all cases passed on 2 ranks" in out
    assert out.count(": ok") == 27  # every case ran, the DTensor ones included
    assert "+inf logits on both shards smoothing weight: ok" in out and "+inf logit focal weight: ok" in out
    assert "finfo.max logit, no +inf, smoothing weight: ok" in out
    assert "dtensor none sharded-weight: ok" in out
    assert "uneven shards, default vocab_start: ok" in out
    assert "empty last shard, default vocab_start: ok" in out
    assert "collectives: ok (forward {'all_reduce': 2}, forward and backward {'all_reduce': 3}" in out
    assert "layout with a overlap raises ValueError: ok" in out and "layout with a gap raises ValueError: ok" in out
    assert "bfloat16 under autocast gives float32, as one process: ok" in out
    assert "an int32 target raises RuntimeError, as one process: ok" in out
    assert "under torch.compile the eager loss and gradients: ok" in out
    assert "two heads on one group, shard sizes agreeing on one rank only: ok" in out


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("ranks, cases", [
    (3, 2),  # torch's even split of four classes over three ranks: [2, 2, 0], an empty shard
    (4, 3),  # uneven shards
])
def test_more_ranks(ranks, cases):
    out = _run(ranks)
    assert f"all cases passed on {ranks} ranks" in out
    assert out.count(": ok") == cases


def test_vocab_start_needs_a_sharded_weight():
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="linear_cross_entropy: vocab_start= is for a sharded linear_weight"):
        SF.linear_cross_entropy(x, w, t, vocab_start=2)
    with pytest.raises(ValueError, match="linear_focal_loss: vocab_start= is for a sharded linear_weight"):
        SF.linear_focal_loss(x, w, t, vocab_start=2)


def test_plain_tensors_are_not_dtensors():
    assert not is_dtensor(torch.zeros(2))
    assert not is_dtensor(torch.nn.Parameter(torch.zeros(2)))
    assert not is_dtensor(None)


def test_scalar_arguments_are_checked_before_any_collective():
    # no process group exists here: the checks must fire before one is used
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    group = object()
    with pytest.raises(ValueError, match="linear_cross_entropy: reduction"):
        SF.linear_cross_entropy(x, w, t, reduction="avg", process_group=group)
    with pytest.raises(ValueError, match="linear_cross_entropy: z_loss must be >= 0"):
        SF.linear_cross_entropy(x, w, t, z_loss=-1.0, process_group=group)
    with pytest.raises(RuntimeError, match="label_smoothing must be between"):
        SF.linear_cross_entropy(x, w, t, label_smoothing=2.0, process_group=group)


def test_torch_func_and_forward_mode_raise_clearly_before_any_collective():
    # the sharded form has no unfused fallback: a clear error (torch.func gave torch's own
    # "must override the setup_context staticmethod" from inside the combine)
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])

    def f(x):
        return SF.linear_cross_entropy(x, w, t, process_group=object())

    with pytest.raises(NotImplementedError, match="torch.func transforms are not supported with a sharded"):
        torch.func.grad(f)(x)
    with pytest.raises(NotImplementedError, match="forward-mode AD and torch.func"):
        torch.func.jvp(f, (x,), (torch.ones_like(x),))
