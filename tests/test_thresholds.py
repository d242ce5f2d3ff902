"""Calibrated activation thresholds (`training.thresholds`): the hook, its export, calibration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.loops import evaluate
from training.thresholds import (
    QUANTILES,
    calibrate_thresholds,
    candidate_thresholds,
    install_thresholds,
    thresholds_in_place,
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
    from tasks.training import export_program

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
