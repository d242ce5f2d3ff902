"""Distillation losses against hand-computed values, the adapter, and the student's step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import build_model
from training.distill.feature_bank import FeatureBank
from training.distill.losses import (
    FeatureAdapter,
    FeatureLoss,
    Mixup,
    bank_targets,
    decoupled_kl,
    distillation_step,
    feature_loss_per_image,
    layer_shape,
    masked_feature_loss,
)
from training.features import FeatureHooks


def test_l2_cosine_and_kl_match_hand_computed_values():
    s = torch.tensor([[1.0, 2.0], [1.0, 0.0]])
    t = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    assert feature_loss_per_image(s, t, "l2").tolist() == [2.5, 1.0]
    cosine = feature_loss_per_image(s, torch.tensor([[2.0, 4.0], [0.0, 1.0]]), "cosine")
    assert cosine.tolist() == pytest.approx([0.0, 1.0], abs=1e-6)
    # two classes, T = 1: KL(p || q) with p = softmax(0, 0) = (1/2, 1/2), q = softmax(0, ln 3)
    kl = feature_loss_per_image(torch.tensor([[0.0, math.log(3)]]), torch.zeros(1, 2), "kl", 1.0)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl.item() == pytest.approx(expected, rel=1e-5)
    # the T^2 factor: the same logits scaled by T give T^2 times the T = 1 value
    scaled = feature_loss_per_image(torch.tensor([[0.0, 4 * math.log(3)]]), torch.zeros(1, 2),
                                    "kl", 4.0)
    assert scaled.item() == pytest.approx(16 * expected, rel=1e-5)


def test_standardized_kl_asks_for_the_teachers_relations_not_the_scale_of_its_logits():
    generator = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 10, generator=generator), torch.randn(6, 10, generator=generator)
    # a student whose logits are the teacher's shifted and shrunk (a small network's narrower
    # range) has nothing left to learn; plain KD still pulls it toward the teacher's scale
    shrunk = 0.2 * t - 3.0
    assert feature_loss_per_image(shrunk, t, "kl-standardized", 2.0).abs().max() < 1e-5
    assert feature_loss_per_image(shrunk, t, "kl", 2.0).min() > 1e-3
    # it is plain KL on the z-scored logits: per row mean 0 and sample deviation 1
    z_s = (s - s.mean(1, keepdim=True)) / s.std(1, keepdim=True)
    z_t = (t - t.mean(1, keepdim=True)) / t.std(1, keepdim=True)
    assert feature_loss_per_image(s, t, "kl-standardized", 2.0).tolist() == pytest.approx(
        feature_loss_per_image(z_s, z_t, "kl", 2.0).tolist(), rel=1e-4)


def test_dkd_splits_plain_kd_into_its_target_and_non_target_parts():
    # Zhao et al.'s identity: KL = TCKD + (1 - p_t[y]) * NCKD, at any temperature
    generator = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 4, generator=generator), 3 * torch.randn(5, 4, generator=generator)
    y = torch.tensor([0, 1, 2, 3, 1])
    temperature = 2.0
    tckd = decoupled_kl(s, t, y, temperature, beta=0.0)
    nckd = decoupled_kl(s, t, y, temperature, beta=1.0) - tckd
    p_target = torch.softmax(t / temperature, 1).gather(1, y[:, None]).squeeze(1)
    kl = feature_loss_per_image(s, t, "kl", temperature)
    assert (tckd + (1 - p_target) * nckd).tolist() == pytest.approx(kl.tolist(), rel=1e-4)
    # equal logits: nothing to learn; the default beta weighs NCKD by 8
    assert feature_loss_per_image(t, t, "dkd", temperature, y).abs().max().item() < 1e-5
    assert feature_loss_per_image(s, t, "dkd", temperature, y).tolist() == pytest.approx(
        (tckd + 8 * nckd).tolist(), rel=1e-4)
    with pytest.raises(ValueError, match="needs the images' labels"):
        feature_loss_per_image(s, t, "dkd")


def test_unfilled_targets_add_nothing_and_the_batch_size_divides():
    s, t = torch.tensor([[1.0], [3.0], [5.0]]), torch.zeros(3, 1)
    mask = torch.tensor([True, False, True])
    assert masked_feature_loss(s, t, mask, "l2").item() == pytest.approx((1 + 25) / 3)
    assert masked_feature_loss(s, t, torch.zeros(3, dtype=torch.bool), "l2").item() == 0.0
    with pytest.raises(ValueError, match="unknown feature loss"):
        FeatureLoss("huber")


@pytest.mark.parametrize(("student", "teacher", "kind"), [
    ((16,), (64,), nn.Linear), ((16, 7, 7), (64, 4, 4), nn.Sequential),
    ((16, 7, 7), (64,), nn.Sequential), ((10,), (10,), nn.Identity)])
def test_adapter_maps_the_student_shape_to_the_teachers(student, teacher, kind):
    adapter = FeatureAdapter(student, teacher)
    assert isinstance(adapter.body, kind)
    assert adapter(torch.randn(2, *student)).shape == (2, *teacher)


def test_adapter_refuses_a_vector_to_map():
    with pytest.raises(ValueError, match="cannot adapt"):
        FeatureAdapter((16,), (8, 4, 4))


def test_step_trains_student_and_adapter_on_filled_bank_entries_only():
    torch.manual_seed(0)
    student = build_model("cnn2", 1, 10, 4)
    x, y, ids = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3]), torch.tensor([5, 6, 7, 8])
    shape = layer_shape(student, "pool", x)
    bank = FeatureBank(torch.arange(10), (6,))
    bank.update(torch.tensor([5, 6]), torch.randn(2, 6), state=1)  # 7 and 8 unfilled
    adapter = FeatureAdapter(shape, (6,))
    with FeatureHooks(student, ["pool"]) as hooks:
        step = distillation_step(hooks, "pool", adapter, bank_targets(bank, torch.device("cpu")),
                                 FeatureLoss("l2"), ce_weight=0.5, feature_weight=2.0)
        losses = step(student, ids, x, y)
        losses["loss"].backward()
        feats = adapter(hooks["pool"])
    assert losses["loss"].item() == pytest.approx(
        0.5 * losses["loss_ce"].item() + 2.0 * losses["loss_feat"].item(), rel=1e-6)
    target, filled = bank.lookup(ids)
    per_image = (feats - target).pow(2).mean(1)
    assert losses["loss_feat"].item() == pytest.approx(per_image[filled].sum().item() / 4,
                                                       rel=1e-5)
    assert adapter.body.weight.grad is not None and adapter.body.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in student.parameters())


def test_mixup_shows_the_targets_the_mixed_images_the_student_sees_and_mixes_the_labels():
    torch.manual_seed(0)
    student = build_model("cnn2", 1, 10, 4)
    x, y = torch.randn(6, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4, 5])
    seen: list[torch.Tensor] = []

    def targets(_ids, images):  # what a live teacher is run on
        seen.append(images)
        return torch.zeros(len(images), 10), torch.ones(len(images), dtype=torch.bool)

    student.eval()  # the same output for the same images, twice
    with FeatureHooks(student, ["fc"]) as hooks:
        step = distillation_step(hooks, "fc", nn.Identity(), targets, FeatureLoss("kl", 1.0),
                                 ce_weight=1.0, feature_weight=0.0, mixup=Mixup(1.0, seed=3))
        losses = step(student, torch.arange(6), x, y)
        logits = hooks["fc"].detach()
    # the same draw again: the mixed batch, its partners and the weight of the mix
    mixed, perm, lam = Mixup(1.0, seed=3)(x)
    assert 0.0 < lam < 1.0 and sorted(perm.tolist()) == list(range(6))
    assert torch.equal(seen[0], mixed)
    assert torch.allclose(mixed, lam * x + (1 - lam) * x[perm])
    assert not torch.equal(mixed, x)
    with torch.no_grad():
        assert torch.allclose(logits, student(mixed), atol=1e-6)  # the student saw it too
    # CE weighs each mixed image's two labels by the mix
    ce = lam * nn.functional.cross_entropy(logits, y) \
        + (1 - lam) * nn.functional.cross_entropy(logits, y[perm])
    assert losses["loss_ce"].item() == pytest.approx(ce.item(), rel=1e-5)
    with pytest.raises(ValueError, match="alpha must be positive"):
        Mixup(0.0, seed=0)
