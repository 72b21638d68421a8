"""DivergenceMonitor: fires at the first finite step past `growth`, never on healthy runs."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stablelosses.debug import DivergenceError, DivergenceMonitor, DivergenceWarning


def seed_net(seed: int = 0, lr: float = 0.3):
    """The seed: BatchNorm2d(1) over 16 values, Conv2d(1, 1, [1, 16]), target 1, squared error, SGD."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 1, [1, 16]))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    return net, opt, torch.rand(1, 1, 1, 16)


def train_seed(net, opt, x, monitor=None, steps=12):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (net(x) - 1).square().sum()
        loss.backward()
        losses.append(loss.item())
        if monitor is not None:
            monitor.check(loss)
        opt.step()
    return losses


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("lr", [0.3, 0.5])
def test_seed_net_fires_before_the_first_non_finite_loss(seed, lr):
    unwatched = train_seed(*seed_net(seed, lr))
    first_bad = next(i for i, v in enumerate(unwatched) if not math.isfinite(v))  # it does blow up
    net, opt, x = seed_net(seed, lr)
    monitor = DivergenceMonitor(net, optimizer=opt)
    losses: list[float] = []
    with pytest.raises(DivergenceError) as info:
        for _ in range(12):
            opt.zero_grad()
            loss = (net(x) - 1).square().sum()
            loss.backward()
            losses.append(loss.item())
            monitor.check(loss)
            opt.step()
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.step == len(losses) - 1 < first_bad
    assert all(math.isfinite(v) for v in losses)
    assert losses == unwatched[: len(losses)]  # watching did not change the run
    assert err.growth > 1e3 and err.quantity in ("loss", "gradient norm")
    text = str(err)
    assert f"at step {err.step}" in text
    assert "net.0 (BatchNorm2d)" in text and "16 values per channel" in text
    assert (err.module_path, err.module_type) in (("net.0", "BatchNorm2d"), ("net.1", "Conv2d"))
    assert f"fastest-growing gradient: {err.module_path} ({err.module_type})" in text
    assert any("update-to-weight ratio" in p and f"lr {lr:g}" in p for p in err.precursors)


def make_mlp(seed: int):
    torch.manual_seed(seed)
    data_x = torch.randn(512, 8)
    data_y = torch.sin(data_x @ torch.randn(8, 1)) + 0.1 * torch.randn(512, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, data_x, data_y


def train_mlp(seed: int, bad_step: int | None = None, bad_scale: float = 100.0, opt_cls=torch.optim.SGD):
    model, data_x, data_y = make_mlp(seed)
    opt = opt_cls(model.parameters(), lr=1e-2)
    monitor = DivergenceMonitor(model, optimizer=opt)
    losses = []
    for step in range(300):
        idx = torch.randint(0, 512, (32,))
        x, y = data_x[idx], data_y[idx]
        if step == bad_step:
            y = y * bad_scale  # one corrupted batch
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        monitor.check(loss)
        opt.step()
    return losses, monitor


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_healthy_mlp_300_steps_never_fires(opt_cls):
    losses, monitor = train_mlp(0, opt_cls=opt_cls)
    assert monitor.steps == 300
    assert losses[-1] < losses[0]  # it learned


@pytest.mark.parametrize("seed", range(3))
def test_one_bad_batch_whose_loss_grows_past_growth_fires_at_that_step(seed):
    # the contract: the loss grew by more than `growth` within `window` steps while still finite;
    # one step is enough (the next may already be inf)
    with pytest.raises(DivergenceError) as info:
        train_mlp(seed, bad_step=100)
    assert (info.value.step, info.value.quantity) == (100, "loss")


@pytest.mark.parametrize("seed", range(3))
def test_one_bad_batch_below_growth_does_not_fire(seed):
    losses, monitor = train_mlp(seed, bad_step=100, bad_scale=10.0)
    assert losses[100] > 10 * min(losses[95:100])  # a visible jump, well below `growth`
    assert monitor.steps == 300


@pytest.mark.parametrize("losses", [[1, 1, 1, 1, 1e4], [1, 1, 1, 1, 1e4, math.inf]], ids=["finite", "then-inf"])
def test_a_single_step_past_growth_fires(losses):
    err = feed_losses(losses, window=5)
    assert err is not None and (err.step, err.quantity) == (4, "loss")
    assert "within 4 steps (1 -> 1e+04), while still finite" in str(err).splitlines()[0]


def test_warn_mode_warns_once_and_continues():
    net, opt, x = seed_net()
    monitor = DivergenceMonitor(net, mode="warn")
    with pytest.warns(DivergenceWarning, match="at step 2") as record:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            train_seed(net, opt, x, monitor, steps=5)
    assert len([w for w in record if issubclass(w.category, DivergenceWarning)]) == 1
    assert monitor.steps == 5


def test_without_an_optimizer_there_is_no_ratio():
    net, opt, x = seed_net()
    monitor = DivergenceMonitor(net)
    with pytest.raises(DivergenceError) as info:
        train_seed(net, opt, x, monitor)
    assert not any("ratio" in p for p in info.value.precursors)
    assert any("BatchNorm2d" in p for p in info.value.precursors)


@pytest.mark.parametrize("bn_mode", ["eval", "large batch"])
def test_batchnorm_in_eval_or_on_32_values_is_no_precursor(bn_mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1))
    batch = 64 if bn_mode == "large batch" else 8
    if bn_mode == "eval":
        net[0].eval()
    x, y = torch.randn(batch, 4) * 10, torch.randn(batch, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1.0 if bn_mode == "eval" else 2.0)  # both diverge
    monitor = DivergenceMonitor(net)
    with pytest.raises(DivergenceError) as info:
        for _ in range(30):
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            loss.backward()
            monitor.check(loss)
            opt.step()
    assert not any("BatchNorm" in p for p in info.value.precursors)


def test_state_dict_round_trip_and_reset():
    net, opt, x = seed_net()
    monitor = DivergenceMonitor(net, optimizer=opt)
    train_seed(net, opt, x, monitor, steps=2)  # 0.83 -> 74: one step short of firing (1.1e7)
    state = pickle.loads(pickle.dumps(monitor.state_dict()))
    assert state["steps"] == 2 and len(state["values"]["loss"]) == 2
    fresh = DivergenceMonitor(net, optimizer=opt, window=2, growth=10.0, mode="warn")
    fresh.load_state_dict(state)
    assert (fresh.window, fresh.growth, fresh.mode, fresh.steps) == (5, 1e3, "raise", 2)
    with pytest.raises(DivergenceError, match="at step 2"):
        train_seed(net, opt, x, fresh, steps=1)
    # reset forgets the window: the same step no longer has a baseline to grow from
    net, opt, x = seed_net()
    monitor = DivergenceMonitor(net)
    train_seed(net, opt, x, monitor, steps=2)
    monitor.reset()
    assert monitor.steps == 0
    train_seed(net, opt, x, monitor, steps=1)


def test_gradient_norm_of_huge_finite_gradients_does_not_overflow():
    net = nn.Linear(4, 1)
    monitor = DivergenceMonitor(net)
    net.weight.grad = torch.full((1, 4), 1e30)  # float32 ‖g‖² overflows; ‖g‖ = 2e30 does not
    net.bias.grad = None  # a missing gradient counts as 0
    monitor.check(torch.tensor(3.0))
    (norm,) = monitor.state_dict()["values"]["gradient norm"]
    expected = torch.linalg.vector_norm(torch.full((4,), 1e30, dtype=torch.float64)).item()
    assert norm == pytest.approx(expected, rel=1e-6)


def test_bad_arguments():
    net = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model must be an nn.Module, got list"):
        DivergenceMonitor([net])
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        DivergenceMonitor(net, window=0)
    with pytest.raises(ValueError, match="growth must be a number > 1, got 1.0"):
        DivergenceMonitor(net, growth=1.0)
    with pytest.raises(ValueError, match="mode must be 'raise' or 'warn', got 'log'"):
        DivergenceMonitor(net, mode="log")
    with pytest.raises(ValueError, match=r"loss must be a one-element tensor, got \[2\]"):
        DivergenceMonitor(net).check(torch.ones(2))


def test_error_pickles_with_its_attributes():
    net, opt, x = seed_net()
    with pytest.raises(DivergenceError) as info:
        train_seed(net, opt, x, DivergenceMonitor(net))
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.step, copy.module_type, str(copy)) == (info.value.step, "BatchNorm2d", str(info.value))


def test_close_removes_the_batchnorm_hooks():
    net, _, x = seed_net()
    monitor = DivergenceMonitor(net)
    assert len(net[0]._forward_hooks) == 1
    monitor.close()
    assert len(net[0]._forward_hooks) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_syncs_once_on_cuda():
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).cuda()
    monitor = DivergenceMonitor(net)
    loss = net(torch.randn(16, 8, device="cuda")).square().mean()
    loss.backward()
    monitor.check(loss)  # warm up (first calls may allocate)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            monitor.check(loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in record if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def feed_losses(losses, **kwargs):
    """Check a sequence of losses with a constant gradient; the error if the monitor fired, else None."""
    net = nn.Linear(1, 1)
    monitor = DivergenceMonitor(net, **kwargs)
    for v in losses:
        net.weight.grad, net.bias.grad = torch.ones(1, 1), torch.ones(1)
        try:
            monitor.check(torch.tensor(v, dtype=torch.float64))
        except DivergenceError as err:
            return err
    return None


def test_a_loss_that_improves_through_zero_into_negative_values_does_not_fire():
    # a negative log-likelihood or an ELBO: |loss| grows 1e5x from its smallest, the loss only falls
    assert feed_losses([1.0, 0.1, 1e-3, 1e-4, -0.5, -3.0, -10.0, -30.0, -31.0, -40.0]) is None


def test_a_tiny_loss_that_jumps_to_6_and_recovers_does_not_fire():
    assert feed_losses([1e-4] * 5 + [6.0, 5.0, 1e-3, 1e-4, 1e-4]) is None


@pytest.mark.parametrize("losses", [
    [1.0, 0.9, 0.8, 2e3, 1e6, 1e10],  # grows x1e3+ to large values
    [1e-4, 1e-4, 1e-4, 1e10, 1e10],  # from near zero to 1e10
    [-5.0, -6.0, -7.0, 1e4, 1e8],  # a negative loss that shoots up
], ids=["from-1", "from-1e-4", "from-negative"])
def test_a_diverging_loss_still_fires(losses):
    err = feed_losses(losses)
    assert err is not None and err.quantity == "loss" and err.growth > 1e3
    assert err.step <= len(losses) - 1  # fired on a finite loss, at most the last


def test_the_headline_quotes_only_numbers_its_history_line_shows():
    err = feed_losses([1.0, 5.0, 5e3, 5e4], window=2)  # the reference, 1, is 3 steps back
    assert err is not None
    headline, loss_line = str(err).splitlines()[:2]
    quoted = headline.split("(")[1].split(")")[0].split(" -> ")
    shown = loss_line.split(":", 1)[1].strip().split(" -> ")
    assert set(quoted) <= set(shown), (headline, loss_line)


def _seed_run_warnings(seed: int, loss_floor: float = 1.0, lr: float = 0.1, steps: int = 30):
    """The seed net's losses over ``steps`` steps and the steps a 'warn' monitor fired at."""
    net, opt, x = seed_net(seed, lr)
    monitor = DivergenceMonitor(net, optimizer=opt, mode="warn", loss_floor=loss_floor)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", DivergenceWarning)
        losses, fired = [], []
        for step in range(steps):
            opt.zero_grad()
            loss = (net(x) - 1).square().sum()
            loss.backward()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                break  # diverged: the rest is NaN arithmetic (slow on denormals), nothing to judge
            if monitor.check(loss):
                fired.append(step)
            opt.step()
    assert len([w for w in record if issubclass(w.category, DivergenceWarning)]) == len(fired)
    return losses, fired


@pytest.mark.parametrize("seed", [119, 167])
def test_seed_runs_whose_tiny_loss_jumps_and_recovers_do_not_fire(seed):
    # of 200 seed runs (lr 0.1, 30 steps) these two never diverge, but their
    # loss rises from ~1e-4 to ~6 and falls back; judged against the window's minimum alone
    # (loss_floor ~ 0, the 0.2 behaviour) they fired
    losses, fired = _seed_run_warnings(seed)
    assert all(map(math.isfinite, losses)) and fired == []
    assert max(losses) > 1 and min(losses[: losses.index(max(losses))]) < 1e-2  # the jump is there
    assert _seed_run_warnings(seed, loss_floor=1e-30)[1] != []  # the old judgement fires on it


def test_200_seed_runs_no_false_alarm_every_divergence_caught():
    # benchmarks/divergence_seeds.py's experiment: 123 of the 200 runs diverge (a non-finite loss
    # within 30 steps); the monitor must fire on a finite loss before it in each of them, and
    # never on the other 77
    diverged = caught = false_alarms = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 17-parameter net: threads only add overhead
    try:
        runs = [_seed_run_warnings(seed) for seed in range(200)]
    finally:
        torch.set_num_threads(threads)
    for losses, fired in runs:
        first_bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        if first_bad is None:
            false_alarms += bool(fired)
            continue
        diverged += 1
        caught += bool(fired) and fired[0] < first_bad
    assert (diverged, caught, false_alarms) == (123, 123, 0)


def test_every_headline_quotes_numbers_its_history_lines_show():
    # random loss and gradient-norm sequences, both modes, every window: whichever quantity
    # fires, the reference and the value in the headline appear in that quantity's history line
    import random

    checked = 0
    for trial in range(300):
        rnd = random.Random(trial)
        net = nn.Linear(1, 1)
        mode = rnd.choice(["raise", "warn"])
        monitor = DivergenceMonitor(net, window=rnd.randint(1, 6), mode=mode)
        for _ in range(rnd.randint(3, 15)):
            net.weight.grad = torch.full((1, 1), 10 ** rnd.uniform(-3, 6))
            net.bias.grad = torch.zeros(1)
            loss = torch.tensor(rnd.choice([1, -1]) * 10 ** rnd.uniform(-5, 8), dtype=torch.float64)
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always", DivergenceWarning)
                try:
                    monitor.check(loss)
                    messages = [str(w.message) for w in record if issubclass(w.category, DivergenceWarning)]
                except DivergenceError as err:
                    messages = [str(err)]
            for text in messages:
                headline, *lines = text.splitlines()
                quantity = "loss" if " the loss " in headline else "gradient norm"
                quoted = headline.split("(")[1].split(")")[0].split(" -> ")
                history = next(line for line in lines if line.strip().startswith(quantity + ":"))
                assert set(quoted) <= set(history.split(":", 1)[1].strip().split(" -> ")), text
                checked += 1
            if messages and mode == "raise":
                break
    assert checked > 100


def test_contract_positional_order_and_a_wrong_optimizer():
    # DivergenceMonitor(model, window=5, growth=1e3, mode='raise'): positional as the contract
    net = nn.Linear(2, 2)
    m = DivergenceMonitor(net, 7, 50.0, "warn")
    assert (m.window, m.growth, m.mode, m.optimizer) == (7, 50.0, "warn", None)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        DivergenceMonitor(net, optimizer=10)
    with pytest.raises(TypeError):
        DivergenceMonitor(net, 5, 1e3, "raise", torch.optim.SGD(net.parameters(), lr=0.1))

