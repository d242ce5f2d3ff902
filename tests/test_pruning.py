"""Dead channels pruned into a real, smaller network that computes the same outputs."""

from __future__ import annotations

import pytest
import torch

import models
from training.sparsify.pruning import (
    median_latency,
    parameter_count,
    producing_conv,
    prune_channels,
)


def _lenet_with_dead_channels():
    torch.manual_seed(0)
    model = models.build_model("lenet", 1, 10).eval()
    with torch.no_grad():
        model.block1[0].bias[[0, 3]] = -1e3  # never above 0: zero after the ReLU
        model.block2[0].bias[[1, 2, 5]] = -1e3
    return model


def test_pruned_lenet_is_smaller_and_computes_the_same():
    model = _lenet_with_dead_channels()
    x = torch.randn(8, 1, 28, 28)
    pruned = prune_channels(model, {"block1": [0, 3], "block2": [1, 2, 5]}, x[:1])
    assert pruned.block1[0].out_channels == 14 and pruned.block2[0].in_channels == 14
    assert pruned.block2[0].out_channels == 29 and pruned.fc.in_features == 29 * 49
    assert parameter_count(pruned) < parameter_count(model)
    assert model.block1[0].out_channels == 16  # the original is untouched
    torch.testing.assert_close(pruned(x), model(x), rtol=1e-5, atol=1e-5)
    small = torch.randn(4, 1, 8, 8)  # still upsamples small inputs
    torch.testing.assert_close(pruned(small), model(small), rtol=1e-5, atol=1e-5)


def test_a_residual_stage_prunes_with_its_coupled_layers_and_layers_keep_one_channel():
    torch.manual_seed(0)
    model = models.build_model("resnet8", 1, 10, width=4).eval()
    x = torch.randn(2, 1, 28, 28)
    pruned = prune_channels(model, {"stage1": [0, 1]}, x[:1])
    assert pruned(x).shape == (2, 10)
    assert parameter_count(pruned) < parameter_count(model)
    lenet = models.build_model("lenet", 1, 10).eval()
    alone = prune_channels(lenet, {"block1": list(range(16))}, x[:1])
    assert alone.block1[0].out_channels == 1
    assert producing_conv(lenet, "block2") is lenet.block2[0]
    with pytest.raises(KeyError, match="no layer"):
        prune_channels(lenet, {"block9": [0]}, x[:1])


def test_latency_is_measured_for_every_model():
    model = _lenet_with_dead_channels()
    x = torch.randn(1, 1, 28, 28)
    pruned = prune_channels(model, {"block1": list(range(8))}, x)
    latency = median_latency({"original": model, "pruned": pruned}, x, repeats=5, warmup=1)
    assert set(latency) == {"original", "pruned"} and all(v > 0 for v in latency.values())
