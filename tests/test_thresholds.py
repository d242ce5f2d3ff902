"""Calibrated activation thresholds (`training.sparsify.thresholds`): the hook, its export,
calibration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.loops import evaluate
from training.sparsify.term import SparsityTransform, activation_stats, sparsity_regularized
from training.sparsify.thresholds import (
    QUANTILES,
    calibrate_thresholds,
    candidate_thresholds,
    install_thresholds,
    raise_thresholds,
    thresholds_in_place,
    thresholds_toward,
)


def test_a_threshold_zeros_every_value_at_most_it_and_keeps_the_rest():
    layer = nn.Identity()
    model = nn.Sequential(layer)
    x = torch.tensor([[-2.0, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75]])
    with thresholds_in_place(model, {"0": 0.5}):
        assert model(x).tolist() == [[-2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.75]]
    assert torch.equal(model(x), x)
    with pytest.raises(KeyError, match="no layer"):
        install_thresholds(model, {"block9": 0.1})


def test_the_exported_program_keeps_the_thresholds(tmp_path):
    from models import build_model
    from training.features import export_program

    torch.manual_seed(0)
    model = build_model("lenet", 1, 10, None).eval()
    x = torch.randn(4, 1, 28, 28)
    plain = model(x)
    install_thresholds(model, {"block1": 0.3, "block2": 0.3})
    hooked = model(x)
    assert not torch.allclose(plain, hooked)
    export_program(model, 1, 28, tmp_path / "p.pt2")
    served, _embedding = torch.export.load(str(tmp_path / "p.pt2")).module()(x)
    assert torch.allclose(served, hooked, atol=1e-5)


def separable(n: int = 512):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return [(torch.arange(n), x, y)]


def small_net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), 0.02)
    (_, x, y), = separable()
    for _ in range(200):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def test_calibration_keeps_the_score_within_the_tolerance_and_leaves_no_hooks():
    model, batches, cpu = small_net(), separable(), torch.device("cpu")

    def score(net):
        return evaluate(net, batches, cpu)["accuracy"]

    candidates = candidate_thresholds(model, "1", batches, cpu)
    assert len(candidates) == len(QUANTILES) and candidates == sorted(candidates)
    results = {tolerance: calibrate_thresholds(model, ["1"], batches, cpu, score, tolerance)
               for tolerance in (0.0, 0.02, 1.0)}
    base = score(model)
    assert all(not m._forward_hooks for m in model.modules())  # no hook left behind
    for tolerance, (thresholds, before, after) in results.items():
        assert before == base and after >= base - tolerance - 1e-9
        with thresholds_in_place(model, thresholds):
            assert score(model) == pytest.approx(after)
    chosen = [results[t][0].get("1", 0.0) for t in (0.0, 0.02, 1.0)]
    assert chosen == sorted(chosen)  # a looser tolerance never picks a smaller threshold
    assert chosen[-1] == pytest.approx(candidates[-1])  # anything goes: the 0.9 quantile


def test_raised_thresholds_keep_the_larger_per_layer():
    assert raise_thresholds({"a": 0.2, "b": 0.5}, {"b": 0.3, "c": 0.1}) == \
        {"a": 0.2, "b": 0.5, "c": 0.1}
    assert raise_thresholds({}, {"a": 0.4}) == {"a": 0.4}


def test_training_with_thresholds_zeros_small_values_before_the_term_reads_them():
    """FATReLU fine-tuning: values at most t are zero in the forward pass, so the term and the
    task see the thresholded map and no gradient reaches the zeroed values."""
    model = nn.Sequential(nn.Identity())
    x = torch.tensor([[-0.75, -0.25, 0.0, 0.25, 0.5, 1.5]], requires_grad=True)

    def task(net, _ids, inputs, _y):
        out = net(inputs).sum()
        return {"loss": out, "loss_ce": out}

    with sparsity_regularized(task, model, {"0": 2.0}, SparsityTransform("abs"),
                              {"0": 0.5}) as step:
        losses = step(model, torch.arange(1), x, None)
    # kept: -0.75 and 1.5; S = mean |x| over the 6 values = 2.25 / 6; task = 0.75
    assert losses["sparsity_0"].item() == pytest.approx(2.25 / 6)
    assert losses["loss"].item() == pytest.approx(0.75 + 2.0 * 2.25 / 6)
    losses["loss"].backward()
    # d/dx of x + 2 |x| / 6 where kept, 0 where zeroed
    assert x.grad.tolist()[0] == pytest.approx([1 - 2 / 6, 0, 0, 0, 0, 1 + 2 / 6])
    assert not model[0]._forward_hooks  # nothing left behind


def test_a_floor_bounds_the_score_instead_of_the_tolerance():
    model, batches, cpu = small_net(), separable(), torch.device("cpu")

    def score(net):
        return evaluate(net, batches, cpu)["accuracy"]

    base = score(model)
    none, before, after = calibrate_thresholds(model, ["1"], batches, cpu, score, 1.0,
                                               floor=base + 0.01)
    assert none == {} and before == after == base  # nothing scores above the unthresholded
    top = candidate_thresholds(model, "1", batches, cpu)[-1]
    assert calibrate_thresholds(model, ["1"], batches, cpu, score, 0.0, floor=0.0)[0] == \
        {"1": pytest.approx(top)}  # the floor, not the tolerance 0, decides


def test_thresholds_toward_a_zero_target_step_by_step():
    """Layer "0" passes 0, 1, ..., 9 (one zero in ten); layer "1" shifts by -2.5 and applies
    ReLU (three zeros). Half the way from 0.1 to 0.7 is 0.4: the smallest t with 40% of the
    values at most t is 3, so "0" gets 40% zeros. "1" then sees 0 x 4, 4..9, so after its
    shift and ReLU 0 x 4, 1.5..6.5: 40% zeros, half the way to 0.7 is 0.55, reached first at
    t = 2.5 (60%). All the way, "0" needs t = 6 (0..6: 70%)."""
    model = nn.Sequential(nn.Identity(), nn.Sequential(ShiftBy(-2.5), nn.ReLU()))
    x = torch.arange(10.0).view(1, 10)
    batches = [(torch.arange(1), x, torch.zeros(1, dtype=torch.long))]
    cpu = torch.device("cpu")

    def zero_fractions(net, layers, data, device):
        return activation_stats(net, layers, data, device).zero_fraction

    assert zero_fractions(model, ["0", "1"], batches, cpu) == {"0": 0.1, "1": 0.3}
    half = thresholds_toward(model, ["0", "1"], batches, cpu, target=0.7, step=0.5)
    assert half == {"0": 3.0, "1": 2.5}
    with thresholds_in_place(model, half):
        assert zero_fractions(model, ["0", "1"], batches, cpu) == {"0": 0.4, "1": 0.6}
    full = thresholds_toward(model, ["0", "1"], batches, cpu, target=0.7, step=1.0)
    assert full["0"] == 6.0
    with thresholds_in_place(model, full):
        assert min(zero_fractions(model, ["0", "1"], batches, cpu).values()) >= 0.7
    assert thresholds_toward(model, ["0"], batches, cpu, target=0.05, step=1.0) == {}
    assert not any(m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="step must be in"):
        thresholds_toward(model, ["0"], batches, cpu, target=0.7, step=0.0)


class ShiftBy(nn.Module):
    """Adds a constant."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift
