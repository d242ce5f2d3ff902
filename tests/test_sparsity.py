"""The sparsity transforms against hand-computed values and gradients, the layer weights, the
penalty inside a training step and the activation statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.features import FeatureHooks
from training.loops import classification_step
from training.sparsify.term import (
    SparsityTransform,
    activation_memory,
    activation_stats,
    layer_lambdas,
    layer_shapes,
    map_area,
    map_sparsity,
    sparsity_step,
)

X = [-2.0, -0.5, 0.0, 1e-4, 1.5]


def values_and_grads(transform: SparsityTransform, xs=X):
    x = torch.tensor(xs, requires_grad=True)
    y = transform(x)
    y.sum().backward()
    return y.detach().tolist(), x.grad.tolist()


@pytest.mark.parametrize(("transform", "values", "grads"), [
    # |x|: slope sign(x), the subgradient 0 at exactly 0
    (SparsityTransform("abs"), [2.0, 0.5, 0.0, 1e-4, 1.5], [-1.0, -1.0, 0.0, 1.0, 1.0]),
    # x^2: 2x
    (SparsityTransform("power", n=2), [4.0, 0.25, 0.0, 1e-8, 2.25], [-4.0, -1.0, 0.0, 2e-4, 3.0]),
    # x^4: 4x^3
    (SparsityTransform("power", n=4), [16.0, 0.0625, 0.0, 1e-16, 5.0625],
     [-32.0, -0.5, 0.0, 4e-12, 13.5]),
    # |x|^3: 3 x |x|
    (SparsityTransform("abs_power", m=3), [8.0, 0.125, 0.0, 1e-12, 3.375],
     [12.0 * -1, -0.75, 0.0, 3e-8, 6.75]),
    # 2^|x|: ln2 2^|x| sign(x)
    (SparsityTransform("exp_abs", c=2.0), [4.0, 2**0.5, 1.0, 2**1e-4, 2**1.5],
     [-4 * math.log(2), -(2**0.5) * math.log(2), 0.0, 2**1e-4 * math.log(2),
      2**1.5 * math.log(2)]),
    # 3^(x^2): ln3 3^(x^2) 2x
    (SparsityTransform("exp_power", c=3.0, n=2), [81.0, 3**0.25, 1.0, 3**1e-8, 3**2.25],
     [81 * math.log(3) * -4, 3**0.25 * math.log(3) * -1, 0.0, math.log(3) * 2e-4 * 3**1e-8,
      3**2.25 * math.log(3) * 3]),
], ids=lambda v: v.describe() if isinstance(v, SparsityTransform) else "")
def test_each_transform_matches_hand_computed_values_and_gradients(transform, values, grads):
    got_values, got_grads = values_and_grads(transform)
    assert got_values == pytest.approx(values, rel=1e-5, abs=1e-12)
    assert got_grads == pytest.approx(grads, rel=1e-4, abs=1e-12)
    # smallest at 0, growing with |x| on both sides
    assert transform(torch.tensor(0.0)).item() == transform.at_zero
    ladder = torch.tensor([0.0, 0.1, 0.5, 1.0, 2.0])
    assert (transform(ladder).diff() > 0).all() and (transform(-ladder).diff() > 0).all()


def test_abs_power_1_is_abs_and_the_exponential_is_capped_not_infinite():
    x = torch.tensor([-1.0, 0.0, 3.0])
    assert torch.equal(SparsityTransform("abs_power", m=1)(x), SparsityTransform("abs")(x))
    big = torch.tensor([100.0], requires_grad=True)
    value = SparsityTransform("exp_power", c=2.0, n=2)(big)
    assert math.isfinite(value.item()) and value.item() == pytest.approx(math.exp(80), rel=1e-5)
    value.backward()
    assert big.grad.item() == 0.0  # capped: no gradient, no overflow


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "power", "n": 3}, "must be even"),
    ({"kind": "exp_power", "n": 1}, "must be even"),
    ({"kind": "exp_abs", "c": 1.0}, "must be > 1"),
    ({"kind": "exp_power", "c": 0.5}, "must be > 1"),
    ({"kind": "abs_power", "m": 0}, "whole number >= 1"),
    ({"kind": "abs_power", "m": 1.5}, "whole number >= 1"),
    ({"kind": "square"}, "unknown sparsity transform"),
])
def test_bad_transform_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparsityTransform(**kwargs)


def test_map_sparsity_is_zero_for_zeros_and_compares_maps_of_different_sizes():
    for transform in (SparsityTransform("abs"), SparsityTransform("exp_abs", c=2.0)):
        assert map_sparsity(torch.zeros(2, 3, 8, 8), transform).item() == 0.0
    small, large = torch.full((2, 4, 2, 2), 0.5), torch.full((2, 4, 16, 16), 0.5)
    abs_ = SparsityTransform("abs")
    assert map_sparsity(small, abs_).item() == map_sparsity(large, abs_).item() == 0.5
    half = torch.zeros(1, 1, 2, 2)
    half[0, 0, 0] = 2.0  # two of four values are 2: mean |x| = 1
    assert map_sparsity(half, abs_).item() == 1.0


def test_hoyer_measures_each_image_s_map_by_hand_and_ignores_its_scale():
    hoyer = SparsityTransform("hoyer")
    maps = torch.tensor([[1.0, -1.0, 1.0, -1.0],   # every value the same magnitude: 1
                         [2.0, 0.0, 0.0, 0.0]])    # one value carries the map: 1/4
    assert map_sparsity(maps.view(2, 1, 2, 2), hoyer).item() == pytest.approx(0.625)
    assert map_sparsity(3 * maps.view(2, 1, 2, 2), hoyer).item() == pytest.approx(0.625)
    assert map_sparsity(torch.zeros(2, 3, 4, 4), hoyer).item() == 0.0
    # (x1 + x2)^2 / (2 (x1^2 + x2^2)) at (1, 0.5): 0.9; its gradient
    # (2 S1 S2 - 2 S1^2 x) / (n S2^2) is -0.24 for the large value, +0.48 for the small one:
    # a descent step makes the large one larger and the small one smaller
    x = torch.tensor([[1.0, 0.5]], requires_grad=True)
    value = map_sparsity(x, hoyer)
    value.backward()
    assert value.item() == pytest.approx(0.9)
    assert x.grad.flatten().tolist() == pytest.approx([-0.24, 0.48])
    with pytest.raises(ValueError, match="whole map"):
        hoyer(x)


def test_smaller_maps_get_larger_lambdas_by_the_area_rule_or_an_explicit_list():
    areas = {"block1": map_area((16, 14, 14)), "block2": map_area((32, 7, 7)),
             "pool": map_area((1568,))}
    assert areas == {"block1": 196, "block2": 49, "pool": 1}
    lambdas = layer_lambdas(areas, 1e-3, gamma=0.5)
    assert lambdas == pytest.approx({"block1": 1e-3, "block2": 2e-3, "pool": 14e-3})
    assert layer_lambdas(areas, 1e-3) == pytest.approx(dict.fromkeys(areas, 1e-3))  # gamma 0
    assert layer_lambdas(areas, 0, explicit=[1, 2, 3]) == {"block1": 1, "block2": 2, "pool": 3}
    with pytest.raises(ValueError, match="2 lambdas for 3 layers"):
        layer_lambdas(areas, 0, explicit=[1, 2])
    with pytest.raises(ValueError, match="lambda must be >= 0"):
        layer_lambdas(areas, -1e-3)
    with pytest.raises(ValueError, match="lambdas must be >= 0"):
        layer_lambdas(areas, 0, explicit=[1, -2, 3])


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


def test_the_step_adds_the_weighted_penalty_and_a_layer_the_model_lacks_is_named():
    model = _net()
    x, y = torch.randn(5, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1])
    assert layer_shapes(model, ["1"], x) == {"1": (4, 6, 6)}
    with pytest.raises(KeyError, match="no layer"):
        layer_shapes(model, ["block9"], x)
    transform = SparsityTransform("abs")
    with FeatureHooks(model, ["1"]) as hooks:
        losses = sparsity_step(classification_step(), hooks, {"1": 0.5}, transform)(
            model, torch.arange(5), x, y)
        relu = torch.relu(model[0](x))
    ce = nn.functional.cross_entropy(model(x), y)
    assert losses["loss_ce"].item() == pytest.approx(ce.item())
    assert losses["sparsity_1"].item() == pytest.approx(relu.abs().mean().item())
    assert losses["loss"].item() == pytest.approx(ce.item() + 0.5 * relu.abs().mean().item())


@pytest.mark.parametrize("kind", ["abs", "hoyer"])
def test_training_with_the_penalty_raises_the_zero_fraction(kind):
    torch.manual_seed(1)
    x = torch.randn(64, 1, 6, 6)
    y = (x.mean((1, 2, 3)) > 0).long()
    batches = [(torch.arange(64), x, y)]
    fractions = {}
    for lam in (0.0, 2.0):
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with FeatureHooks(model, ["1"]) as hooks:
            step = sparsity_step(classification_step(), hooks, {"1": lam},
                                 SparsityTransform(kind))
            for _ in range(60):
                optimizer.zero_grad()
                step(model, *batches[0])["loss"].backward()
                optimizer.step()
        stats = activation_stats(model, ["1"], batches, torch.device("cpu"))
        fractions[lam] = stats.zero_fraction["1"]
        assert stats.images == 64
        assert stats.near_zero_fraction["1"] >= stats.zero_fraction["1"]
    assert fractions[2.0] > fractions[0.0] + 0.2


def test_dead_channels_are_those_zero_everywhere_on_nearly_every_image():
    model = _net()
    with torch.no_grad():
        model[0].bias[:2] = -100.0  # channels 0 and 1 never fire after the ReLU
    x = torch.rand(10, 1, 6, 6)
    stats = activation_stats(model, ["1"], [(torch.arange(10), x, None)], torch.device("cpu"))
    assert stats.dead_channels("1").tolist() == [0, 1]
    assert stats.dead_channel_fraction["1"][:2].tolist() == [1.0, 1.0]


def test_activation_memory_by_hand():
    # 16 channels of 14 x 14 = 3,136 values; 90% zeros: 313.6 nonzero
    memory = activation_memory((16, 14, 14), 0.9)
    assert memory["dense"] == 3136 * 4
    assert memory["bitmap"] == pytest.approx(392 + 313.6 * 4)
    assert memory["csr"] == pytest.approx(313.6 * 6 + 17 * 4)
    dense_only = activation_memory((10,), 0.0)  # a vector, nothing zero: the formats cost more
    assert dense_only["bitmap"] > dense_only["dense"] and dense_only["csr"] > dense_only["dense"]
