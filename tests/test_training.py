"""The pure training code: batches, augmentation, schedule, loops, divergence guard."""

import math

import pytest
import torch

import models
from training.batches import Batches, Normalize, random_shift_flip, shift_flip, warp
from training.loops import (
    NonFiniteLossError,
    classification_step,
    cosine_lr,
    evaluate,
    train_epoch,
    weight_average,
)

CPU = torch.device("cpu")


def test_normalize_by_hand():
    out = Normalize([0.5], [0.25])(torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1))
    assert out.flatten().tolist() == pytest.approx([-2.0, 2.0])


def test_batches_cover_each_index_once_and_reshuffle_per_pass():
    images = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1)
    batches = Batches(images, torch.arange(10), torch.arange(2, 9), 3, Normalize([0], [1]),
                      shuffle=True, seed=1)
    first = torch.cat([ids for ids, _, _ in batches])
    second = torch.cat([ids for ids, _, _ in batches])
    assert sorted(first.tolist()) == list(range(2, 9)) and len(batches) == 3
    assert first.tolist() != second.tolist()
    for ids, x, y in batches:
        assert torch.equal(y, ids) and torch.allclose(x.flatten() * 255, ids.float())


def test_shift_flip_moves_pixels_within_the_padding():
    x = torch.zeros(64, 1, 5, 5)
    x[:, :, 2, 2] = 1.0
    out = random_shift_flip(x, 1, torch.Generator().manual_seed(0))
    rows, cols = out[:, 0].nonzero()[:, 1], out[:, 0].nonzero()[:, 2]
    assert out.sum() == 64  # a centre pixel never leaves a 1-pixel shift
    assert set(rows.tolist()) == {1, 2, 3} and set(cols.tolist()) == {1, 2, 3}
    same = random_shift_flip(x, 1, torch.Generator().manual_seed(0))
    assert torch.equal(out, same)


def test_a_shift_below_a_pixel_interpolates_and_keeps_the_ink():
    x = torch.zeros(256, 1, 8, 8)
    x[:, :, 3:5, 3:5] = 200.0  # a 2 x 2 blob in the middle: no shift below 1 pixel loses it
    out = random_shift_flip(x, 0.5, torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and torch.allclose(out.sum((1, 2, 3)), x.sum((1, 2, 3)))
    assert (out[..., 3:5, 3:5] < 200).any() and (out[..., :2, :].abs() < 1e-4).all()
    half = shift_flip(x[:1], torch.zeros(1, dtype=torch.bool), torch.tensor([[0, 0.5, 0, 1]]))
    # out(c) = x(c + 0.5): the blob (columns 3-4) spreads over columns 2-4, half at the edges
    assert torch.allclose(half[0, 0, 3, 1:6], torch.tensor([0.0, 100.0, 200.0, 100.0, 0.0]))
    assert torch.equal(out, random_shift_flip(x, 0.5, torch.Generator().manual_seed(0)))


def test_the_warp_turns_and_zooms_about_the_centre():
    x = torch.arange(16.0).view(1, 1, 4, 4)
    turned = warp(x, torch.tensor([[0.0, 0.0, math.pi / 2, 1.0]]))
    assert torch.allclose(turned, torch.rot90(x, 1, (2, 3)), atol=1e-4)  # centres onto centres
    zoomed = warp(torch.ones(1, 1, 8, 8), torch.tensor([[0.0, 0.0, 0.0, 0.5]]))
    assert zoomed[0, 0, 2:6, 2:6].eq(1).all() and zoomed[0, 0, 0].abs().max() < 1e-6  # shrunk
    images = torch.full((64, 1, 8, 8), 255, dtype=torch.uint8)
    (_, batch, _), = Batches(images, torch.zeros(64, dtype=torch.long), torch.arange(64), 64,
                             Normalize([0.0], [1.0]), shuffle=True, seed=0, augment=0.8)
    corners = batch[:, 0, [0, 0, -1, -1], [0, -1, 0, -1]]  # 0.91 pixels: warped, not shifted
    assert (corners < 0.999).any(1).float().mean() > 0.9  # nearly all turned or moved
    assert ((batch > 0.01) & (batch < 0.99)).any()  # partly covered pixels: interpolated


def test_batches_without_flips_shift_alike_and_never_mirror():
    images = torch.zeros(32, 1, 8, 8, dtype=torch.uint8)
    images[:, :, 3:5, 1] = 255  # a bar at the left: a mirror puts it on the right half
    made = {flip: Batches(images, torch.zeros(32, dtype=torch.long), torch.arange(32), 32,
                          Normalize([0.0], [1.0]), shuffle=True, seed=3, augment=1.0,
                          flip=flip) for flip in (True, False)}
    (_, flipped, _), = made[True]
    (_, kept, _), = made[False]
    assert (kept[..., 4:] == 0).all()  # a 1-pixel shift at most: never on the right half
    assert (flipped[..., 4:] > 0).flatten(1).any(1).sum() > 8  # about half mirrored
    unflipped = (flipped[..., 4:] == 0).flatten(1).all(1)
    assert torch.equal(flipped[unflipped], kept[unflipped])  # the same shifts either way


def test_cosine_lr_by_hand():
    assert cosine_lr(0.1, 0, 100) == pytest.approx(0.1)
    assert cosine_lr(0.1, 50, 100) == pytest.approx(0.05)
    assert cosine_lr(0.1, 100, 100) == pytest.approx(0.0)
    assert cosine_lr(0.1, 0, 100, warmup_steps=10) == pytest.approx(0.01)
    assert cosine_lr(0.1, 55, 100, warmup_steps=10) == pytest.approx(
        0.05 * (1 + math.cos(math.pi * 0.5)))


def _toy(n=64):
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) % 2
    images = (labels.view(n, 1, 1, 1) * 200 + torch.randint(0, 50, (n, 1, 8, 8), generator=g))
    return images.to(torch.uint8), labels


def test_train_epoch_learns_a_separable_toy_problem():
    torch.manual_seed(0)
    images, labels = _toy()
    model = models.build_model("cnn2", 1, 2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = Batches(images, labels, torch.arange(64), 16, Normalize([0.5], [0.4]), shuffle=True)
    before = evaluate(model, batches, CPU)
    for _ in range(5):
        metrics = train_epoch(model, opt, batches, classification_step(), CPU)
    after = evaluate(model, batches, CPU)
    assert set(metrics) == {"loss", "loss_ce"} and metrics["loss"] == metrics["loss_ce"]
    assert after["accuracy"] == 1.0 and after["loss"] < before["loss"]


def test_a_progress_bar_is_drawn_on_a_terminal_only(monkeypatch):
    """In a log file or CI (stderr not a TTY) an epoch writes nothing; on a terminal its bar."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    images, labels = _toy()
    model = models.build_model("cnn2", 1, 2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = Batches(images, labels, torch.arange(64), 16, Normalize([0.5], [0.4]))
    written = {}
    for kind, stream in (("log", io.StringIO()), ("terminal", Terminal())):
        monkeypatch.setattr(sys, "stderr", stream)
        train_epoch(model, opt, batches, classification_step(), CPU, progress="train epoch 1")
        written[kind] = stream.getvalue()
    assert written["log"] == ""
    assert "train epoch 1:" in written["terminal"] and "/4 [" in written["terminal"]


def test_non_finite_loss_stops_training():
    torch.manual_seed(0)
    images, labels = _toy()
    model = models.build_model("cnn2", 1, 2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e30)
    batches = Batches(images, labels, torch.arange(64), 8, Normalize([0.5], [0.4]))
    with pytest.raises(NonFiniteLossError, match="loss is"):
        for _ in range(3):
            train_epoch(model, opt, batches, classification_step(), CPU)


def test_weight_average_blends_weights_and_buffers_by_hand():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    def set_all(value):  # a "step": every weight and statistic set to `value`
        with torch.no_grad():
            for tensor in [*model.parameters(), model[1].running_mean]:
                tensor.fill_(value)

    start = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    averaged = weight_average(model, 0.75, start)  # continues from `start`
    for value in (4.0, 8.0):
        set_all(value)
        averaged.update_parameters(model)
    expected = 0.75 * (0.25 * 4.0) + 0.25 * 8.0  # 0.75 * (0.75 * 0 + 0.25 * 4) + 0.25 * 8
    assert torch.allclose(averaged.module[0].weight, torch.full((2, 2), expected))
    assert torch.allclose(averaged.module[1].running_mean, torch.full((2,), expected))
    fresh = weight_average(model, 0.75)  # no state: the first update copies the model
    fresh.update_parameters(model)
    assert torch.equal(fresh.module[0].weight, model[0].weight)
    set_all(16.0)
    fresh.update_parameters(model)
    assert torch.allclose(fresh.module[0].weight, torch.full((2, 2), 0.75 * 8.0 + 0.25 * 16.0))
    with pytest.raises(ValueError, match="average decay"):
        weight_average(model, 1.0)
