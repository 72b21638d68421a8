"""The NaN doctor callbacks with the real frameworks, on CPU, tiny models built from configs:
a diverging run is stopped with the report, a step with NaN gradients is skipped and counted,
and a healthy run is untouched (the same losses as without the callback)."""

from __future__ import annotations

import gc
import logging
import math
import weakref

import pytest
import torch
from torch import nn

from stablelosses.debug import SkippedStepsError
from stablelosses.integrations._doctor import NaNDoctor

LOGGER = "stablelosses.integrations"

# Lightning 2.6 calls torch's deprecated LeafSpec (torch >= 2.10 warns): theirs, not ours
pytestmark = pytest.mark.filterwarnings(
    "ignore:`isinstance.treespec, LeafSpec.` is deprecated:FutureWarning")


# ------------------------------------------------------------------------------ the shared core


def _plain_run(lr: float, steps: int, doctor: NaNDoctor | None, nan_at: int = -1):
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    x, y = torch.randn(32, 4) * 3, torch.randn(32, 1)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    if doctor is not None:
        doctor.start(net, opt)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y) * (math.nan if step == nan_at else 1.0)
        loss.backward()
        losses.append(loss.item())
        if doctor is not None:
            doctor.record_loss(loss)
            if doctor.before_step([opt]):
                break
        opt.step()
    return losses, net


def test_doctor_skips_nan_steps_and_stops_divergence(caplog):
    ref_losses, ref_net = _plain_run(0.01, 6, None)
    doc = NaNDoctor()
    losses, net = _plain_run(0.01, 6, doc)
    assert losses == ref_losses and doc.skipped_steps == 0 and doc.report is None
    assert torch.equal(net.weight, ref_net.weight)

    doc = NaNDoctor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        losses, net = _plain_run(0.01, 6, doc, nan_at=2)
    assert doc.skipped_steps == 1 and math.isnan(losses[2])
    assert torch.isfinite(net.weight).all()
    assert "optimizer step skipped: NaN/Inf gradients (1 in a row, 1 in all)" in caplog.text

    doc = NaNDoctor()
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        losses, net = _plain_run(0.5, 50, doc)
    assert doc.stopped and len(losses) < 50 and all(map(math.isfinite, losses))
    assert doc.error.quantity in ("loss", "gradient norm")
    assert "stopping the run" in caplog.text and doc.report in caplog.text


def test_doctor_raises_after_max_consecutive_skips():
    with pytest.raises(SkippedStepsError, match="2 optimizer steps skipped in a row"):
        doc = NaNDoctor(max_consecutive=2, divergence=False)
        torch.manual_seed(0)
        net = nn.Linear(2, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        doc.start(net, opt)
        for _ in range(3):
            (net(torch.ones(1, 2)) * math.inf).sum().backward()
            doc.before_step([opt])
    with pytest.raises(ValueError, match="max_consecutive must be >= 1"):
        NaNDoctor(max_consecutive=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 0}, "window must be an int >= 1, got 0"),
    ({"growth": 1.0}, "growth must be a number > 1, got 1.0"),
    ({"loss_floor": 0.0}, "loss_floor must be a finite number > 0, got 0.0"),
])
def test_doctor_checks_the_monitors_arguments_at_construction(kwargs, message):
    # not at the first on_train_start, after the trainer's setup
    with pytest.raises(ValueError, match=message):
        NaNDoctor(**kwargs)
    NaNDoctor(divergence=False, **kwargs)  # no monitor: nothing to check


def _fit_once(doc: NaNDoctor) -> list[weakref.ref]:
    """One short Adam fit with a NaN step under ``doc``; weak references to its model and optimizer."""
    net = nn.Linear(2, 1)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    doc.start(net, opt)
    for scale in (1.0, math.nan, 1.0):
        opt.zero_grad()
        (net(torch.ones(1, 2)) * scale).sum().backward()
        doc.record_loss(torch.ones(()))
        if not doc.before_step([opt]) and scale == 1.0:
            opt.step()
    assert opt.state  # Adam state exists
    doc.close()
    return [weakref.ref(opt), weakref.ref(net)]


def test_doctor_lets_go_of_model_and_optimizer_at_the_end_of_a_fit():
    # one doctor for two fits: a fit's optimizer (parameters, Adam state) must not outlive it
    # (a helper function: the fit's locals go with its frame; the doctor is all that remains)
    doc = NaNDoctor()
    refs = _fit_once(doc)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert doc.skipped_steps == 1
    refs = _fit_once(doc)  # the second fit: a fresh guard, and the count goes on
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert doc.skipped_steps == 2


# ------------------------------------------------------------------------------ Lightning


def _lightning():
    return pytest.importorskip("lightning.pytorch")


def _fit_lightning(lr: float, steps: int, callback=None, nan_at: int = -1):
    pl = _lightning()

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.global_step == nan_at:
                loss = loss * math.nan
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    torch.manual_seed(0)
    x, y = torch.randn(32, 4) * 3, torch.randn(32, 1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model = Regression()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback] if callback is not None else [])
    trainer.fit(model, data)
    return model, trainer


def test_lightning_healthy_run_is_untouched():
    _lightning()
    from stablelosses.integrations.lightning import NaNDoctorCallback

    ref, _ = _fit_lightning(0.01, 8)
    cb = NaNDoctorCallback()
    model, trainer = _fit_lightning(0.01, 8, cb)
    assert len(model.losses) == 8 and model.losses == ref.losses
    assert torch.equal(model.net.weight, ref.net.weight)
    assert cb.skipped_steps == 0 and cb.report is None and trainer.global_step == 8


def test_lightning_diverging_run_is_stopped_with_the_report(caplog):
    _lightning()
    from stablelosses.integrations.lightning import NaNDoctorCallback

    cb = NaNDoctorCallback()
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        model, trainer = _fit_lightning(0.5, 100, cb)
    assert cb.report is not None and "DivergenceMonitor" in cb.report
    assert cb.report in caplog.text
    assert trainer.global_step < 20 and all(map(math.isfinite, model.losses))
    assert torch.isfinite(model.net.weight).all()


def test_lightning_nan_gradients_are_skipped_and_counted(caplog):
    _lightning()
    from stablelosses.integrations.lightning import NaNDoctorCallback

    cb = NaNDoctorCallback()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model, trainer = _fit_lightning(0.01, 6, cb, nan_at=2)
    assert cb.skipped_steps == 1 and "optimizer step skipped" in caplog.text
    assert torch.isfinite(model.net.weight).all() and cb.report is None
    bare, _ = _fit_lightning(0.01, 6, None, nan_at=2)
    assert not torch.isfinite(bare.net.weight).all()  # without the callback the NaN is applied


def test_lightning_callback_state_survives_a_checkpoint(tmp_path):
    """The counters and the window go into Lightning's checkpoint and come back on resume (the
    callback had ``state_dict`` but no ``load_state_dict``: a resumed fit started from zero)."""
    _lightning()
    from stablelosses.integrations.lightning import NaNDoctorCallback

    cb = NaNDoctorCallback(max_consecutive=3)
    _, trainer = _fit_lightning(0.01, 4, cb, nan_at=3)  # the last step of the fit is skipped
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    assert cb.skipped_steps == 1
    # a checkpoint written mid-fit: a guard with two skips in a row (five in all)
    mid = {"guards": [{"consecutive_skips": 2, "total_skips": 5, "steps": 9, "max_consecutive": 3}],
           "monitor": None, "closed_skips": 0}

    resumed = NaNDoctorCallback(max_consecutive=3)
    resumed.load_state_dict(torch.load(path, weights_only=False)["callbacks"][resumed.state_key])
    assert resumed.skipped_steps == 1
    resumed.load_state_dict(mid)
    assert resumed.skipped_steps == 5
    # one more skip in a row reaches max_consecutive: the restored run raises at once
    from stablelosses.debug import SkippedStepsError

    with pytest.raises(SkippedStepsError):
        _fit_lightning(0.01, 2, resumed, nan_at=0)


def _lightning_refs(cb) -> list[weakref.ref]:
    model, trainer = _fit_lightning(0.01, 3, cb, nan_at=1)
    return [weakref.ref(trainer.optimizers[0]), weakref.ref(model)]


def test_lightning_callback_does_not_keep_the_fits_optimizer_alive():
    _lightning()
    from stablelosses.integrations.lightning import NaNDoctorCallback

    cb = NaNDoctorCallback()
    refs = _lightning_refs(cb)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert cb.skipped_steps == 1  # the count outlives the fit
    refs = _lightning_refs(cb)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert cb.skipped_steps == 2


# ------------------------------------------------------------------------------ Transformers


def _train_hf(tmp_path, lr: float, steps: int, callback=None, nan_sample: int = -1):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=1,
                                  problem_type="regression", hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (64, 8), generator=g)
    labels = torch.randn(64, generator=g) * 3
    if nan_sample >= 0:
        labels[nan_sample] = math.nan  # one batch of the epoch holds it
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(64)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=lr,
        lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, optim="sgd", max_grad_norm=0.0,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[callback] if callback is not None else [])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, trainer, losses


def test_transformers_healthy_run_is_untouched(tmp_path):
    pytest.importorskip("transformers")
    from stablelosses.integrations.transformers import NaNDoctorCallback

    ref_model, _, ref = _train_hf(tmp_path, 1e-3, 6)
    cb = NaNDoctorCallback()
    model, trainer, losses = _train_hf(tmp_path, 1e-3, 6, cb)
    assert len(losses) == 6 and losses == ref
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert cb.skipped_steps == 0 and cb.report is None and trainer.state.global_step == 6


def test_transformers_diverging_run_is_stopped_with_the_report(tmp_path, caplog):
    pytest.importorskip("transformers")
    from stablelosses.integrations.transformers import NaNDoctorCallback

    cb = NaNDoctorCallback()
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        model, trainer, losses = _train_hf(tmp_path, 3.0, 60, cb)
    assert cb.report is not None and "DivergenceMonitor" in cb.report
    assert cb.report in caplog.text
    assert trainer.state.global_step < 60
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_nan_gradients_are_skipped_and_counted(tmp_path, caplog):
    pytest.importorskip("transformers")
    from stablelosses.integrations.transformers import NaNDoctorCallback

    cb = NaNDoctorCallback()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model, trainer, losses = _train_hf(tmp_path, 1e-3, 8, cb, nan_sample=5)  # one epoch
    assert cb.skipped_steps == 1 and "optimizer step skipped" in caplog.text
    assert trainer.state.global_step == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
