"""Activation-sparsity regularization, pure PyTorch: transforms, per-layer weights, the penalty.

A network is trained with `task loss + sum_l lambda_l * S(map_l)`, where `map_l` is the output of
a named layer (read by a forward hook while the network predicts) and `S` its sparsity value:
the mean over the map's elements of `T(x) - T(0)`, averaged over the batch. `T` grows with |x|
and is smallest at 0, so `S` is 0 for an all-zero map and the mean (not the sum) makes maps of
different sizes comparable. The transforms (`SparsityTransform`):

| kind | T(x) | T(0) | gradient at 0 |
| --- | --- | --- | --- |
| `abs` | \\|x\\| | 0 | 0 (PyTorch's subgradient sign(0) = 0) |
| `power` | x^N, N even | 0 | 0 |
| `exp_abs` | c^\\|x\\|, c > 1 | 1 | 0 (the same subgradient) |
| `exp_power` | c^(x^N), c > 1, N even | 1 | 0 |
| `abs_power` | \\|x\\|^M, M whole >= 1 | 0 | 0 (M = 1: the subgradient) |

`hoyer` is not a transform of each value but a measure of the whole map: per image, the
Hoyer-square `(sum |x|)^2 / (n sum x^2)` over its n values (Hurley and Rickard's sparsity
measure, used for activations by Kurtz et al., ICML 2020), averaged over the batch. It lies in
(0, 1]: 1 when every value has the same magnitude, 1/n when one value carries the map, 0 for an
all-zero map. It does not change when the map is scaled, so it does not shrink every value as
`abs` does (which the next layer's weights or a BatchNorm can undo); it makes few values carry
the map and the rest small, which calibrated thresholds (`training.sparsify.thresholds`) then zero.

At exactly 0, |x| has no derivative; the code uses the subgradient 0 (what `torch.abs` gives),
so an activation that is already exactly zero (a ReLU's output below threshold) is left where
it is, and any value beside 0 is pulled toward it with the full slope. The exponentials are
computed as `exp(min(|x|^N * ln c, 80))`: beyond e^80 (far past any activation a trained
network has) the value is capped and its gradient is 0 rather than an overflow to infinity.

Layer weights: `lambda_l = lambda * (A_max / A_l) ** gamma` with `A_l` the map's area (height x
width; 1 for a vector), so a smaller map weighs more (`gamma = 0`: one lambda for all), or an
explicit list, one per layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from training.features import FeatureHooks
from training.loops import Step
from training.sparsify.thresholds import thresholds_in_place

TransformKind = Literal["abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer"]
TRANSFORMS: tuple[str, ...] = ("abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer")
MAX_EXPONENT = 80.0  # exp(80) ~ 5.5e34: below float32's limit, far above any activation's value
NEAR_ZERO = 1e-3  # what counts as "nearly zero" in the statistics


@dataclass(frozen=True)
class SparsityTransform:
    """One transform `T` of the table in the module docstring.

    Args:
        kind: `abs`, `power` (x^N), `exp_abs` (c^|x|), `exp_power` (c^(x^N)), `abs_power`
            (|x|^M), or `hoyer` (a measure of the whole map, not of each value:
            `map_sparsity`).
        n: the even power N of `power` and `exp_power`.
        m: the whole power M >= 1 of `abs_power`.
        c: the base c > 1 of the exponentials.
    """

    kind: TransformKind = "abs"
    n: int = 2
    m: int = 1
    c: float = math.e

    def __post_init__(self) -> None:
        if self.kind not in TRANSFORMS:
            raise ValueError(f"unknown sparsity transform {self.kind!r}: use one of "
                             f"{', '.join(TRANSFORMS)}")
        if self.kind in ("power", "exp_power") and (self.n < 2 or self.n % 2):
            raise ValueError(f"the power N of {self.kind!r} must be even and >= 2, got "
                             f"{self.n} (an odd power is not smallest at 0)")
        if self.kind in ("exp_abs", "exp_power") and not self.c > 1:
            raise ValueError(f"the base c of {self.kind!r} must be > 1, got {self.c} (c <= 1 "
                             "does not grow with |x|)")
        if self.kind == "abs_power" and (self.m < 1 or int(self.m) != self.m):
            raise ValueError(f"the power M of 'abs_power' must be a whole number >= 1, got "
                             f"{self.m}")

    @property
    def at_zero(self) -> float:
        """T(0), the transform's minimum."""
        return 1.0 if self.kind in ("exp_abs", "exp_power") else 0.0

    def __call__(self, x: Tensor) -> Tensor:
        """T applied to every value of `x` (in float32)."""
        if self.kind == "hoyer":
            raise ValueError("'hoyer' measures a whole map, not each value: use map_sparsity")
        x = x.float()
        if self.kind == "abs":
            return x.abs()
        if self.kind == "power":
            return x.pow(self.n)
        if self.kind == "abs_power":
            return x.abs().pow(int(self.m))
        grows = x.abs() if self.kind == "exp_abs" else x.pow(self.n)
        return torch.exp(torch.clamp(grows * math.log(self.c), max=MAX_EXPONENT))

    def describe(self) -> str:
        """A short name for tables and metric tags, e.g. `exp_power(c=2,N=2)`."""
        if self.kind in ("abs", "hoyer"):
            return self.kind
        if self.kind == "power":
            return f"power(N={self.n})"
        if self.kind == "abs_power":
            return f"abs_power(M={self.m})"
        if self.kind == "exp_abs":
            return f"exp_abs(c={self.c:g})"
        return f"exp_power(c={self.c:g},N={self.n})"


def map_sparsity(feature: Tensor, transform: SparsityTransform) -> Tensor:
    """S(map): the mean over the map's elements of `T(x) - T(0)`, averaged over the batch
    (0 for an all-zero map, comparable across map sizes); `hoyer`: `hoyer_square`."""
    if transform.kind == "hoyer":
        return hoyer_square(feature)
    return (transform(feature) - transform.at_zero).mean()


def hoyer_square(feature: Tensor, eps: float = 1e-12) -> Tensor:
    """Per image (the first dimension), `(sum |x|)^2 / (n sum x^2)` over its n values,
    averaged over the batch: in (0, 1], 0 for an all-zero map, unchanged by scaling."""
    x = feature.float().flatten(1)
    return (x.abs().sum(1).pow(2) / (x.pow(2).sum(1) * x.shape[1] + eps)).mean()


def map_area(shape: Sequence[int]) -> int:
    """A map's area from one image's feature shape: height x width for (C, H, W), 1 for a
    vector (C,)."""
    return int(math.prod(shape[1:])) if len(shape) >= 2 else 1


def layer_lambdas(areas: dict[str, int], lam: float, gamma: float = 0.0,
                  explicit: Sequence[float] | None = None) -> dict[str, float]:
    """lambda_l per layer: `explicit` (one per layer, in `areas`' order) when given, else
    `lam * (A_max / A_l) ** gamma`, so a smaller map gets a larger weight for gamma > 0."""
    if explicit is not None:
        if len(explicit) != len(areas):
            raise ValueError(f"{len(explicit)} lambdas for {len(areas)} layers "
                             f"({', '.join(areas)}): give one per layer")
        if any(value < 0 for value in explicit):
            raise ValueError(f"lambdas must be >= 0, got {list(explicit)}")
        return dict(zip(areas, (float(v) for v in explicit), strict=True))
    if lam < 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    largest = max(areas.values())
    return {name: lam * (largest / area) ** gamma for name, area in areas.items()}


def layer_shapes(model: nn.Module, layers: Sequence[str], example: Tensor
                 ) -> dict[str, tuple[int, ...]]:
    """One image's feature shape at each of `layers` (an eval pass on `example[:1]`); a name the
    model does not have raises `KeyError` listing the names it has."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), FeatureHooks(model, list(layers), detach=True) as hooks:
        model(example[:1])
    model.train(was_training)
    return {name: tuple(hooks[name].shape[1:]) for name in layers}


def sparsity_step(task_step: Step, hooks: FeatureHooks, lambdas: dict[str, float],
                  transform: SparsityTransform) -> Step:
    """`task_step` with `sum_l lambda_l * S(map_l)` added to its `loss`, as `loss_sparsity`
    (the weighted sum) and `sparsity_<layer>` (each unweighted S, for the metrics)."""

    def step(model: nn.Module, ids: Tensor, x: Tensor, y) -> dict[str, Tensor]:
        losses = task_step(model, ids, x, y)
        per_layer = {name: map_sparsity(hooks[name], transform) for name in lambdas}
        penalty = sum(lambdas[name] * value for name, value in per_layer.items())
        return losses | {"loss": losses["loss"] + penalty,
                         "loss_sparsity": torch.as_tensor(penalty, dtype=torch.float32)} | {
            f"sparsity_{name.replace('.', '_')}": value.detach()
            for name, value in per_layer.items()}

    return step


@dataclass
class ActivationStats:
    """Per layer: the fraction of exact zeros, of |x| < 1e-3, and per channel the fraction of
    images on which the channel is zero everywhere (what pruning looks at)."""

    zero_fraction: dict[str, float]
    near_zero_fraction: dict[str, float]
    dead_channel_fraction: dict[str, Tensor]  # (channels,) per layer
    images: int
    shapes: dict[str, tuple[int, ...]]  # one image's map per layer

    def dead_channels(self, layer: str, threshold: float = 0.99) -> Tensor:
        """Indices of `layer`'s channels that are all zero on at least `threshold` of the
        images."""
        return (self.dead_channel_fraction[layer] >= threshold).nonzero().flatten()


@torch.no_grad()
def activation_stats(model: nn.Module, layers: Sequence[str], batches, device: torch.device
                     ) -> ActivationStats:
    """`ActivationStats` of `layers` over `batches` (`(ids, x, y)` or `(ids, x, target)`), in
    eval mode."""
    model.eval()
    zeros = dict.fromkeys(layers, 0.0)
    near = dict.fromkeys(layers, 0.0)
    values = dict.fromkeys(layers, 0)
    dead: dict[str, Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    images = 0
    with FeatureHooks(model, list(layers), detach=True) as hooks:
        for _, x, _ in batches:
            model(x.to(device))
            images += len(x)
            for name in layers:
                feature = hooks[name].float()
                shapes[name] = tuple(feature.shape[1:])
                zeros[name] += (feature == 0).sum().item()
                near[name] += (feature.abs() < NEAR_ZERO).sum().item()
                values[name] += feature.numel()
                if feature.dim() >= 2:
                    silent = (feature.flatten(2) == 0).all(2) if feature.dim() > 2 \
                        else feature == 0
                    count = silent.sum(0).double().cpu()
                    dead[name] = dead.get(name, torch.zeros_like(count)) + count
    return ActivationStats(
        zero_fraction={name: zeros[name] / max(values[name], 1) for name in layers},
        near_zero_fraction={name: near[name] / max(values[name], 1) for name in layers},
        dead_channel_fraction={name: count / max(images, 1) for name, count in dead.items()},
        images=images, shapes=shapes)


@contextmanager
def sparsity_regularized(task_step: Step, model: nn.Module, lambdas: dict[str, float],
                         transform: SparsityTransform,
                         thresholds: dict[str, float] | None = None) -> Iterator[Step]:
    """`sparsity_step` over hooks on `model`'s layers `lambdas`, for the `with` block (the hooks
    are removed after it). `thresholds` (layer -> t, `training.sparsify.thresholds`): those layers'
    values up to t are zeroed while the network trains (FATReLU fine-tuning), before the term
    reads them."""
    with thresholds_in_place(model, thresholds or {}), \
            FeatureHooks(model, list(lambdas)) as hooks:
        yield sparsity_step(task_step, hooks, lambdas, transform)


@dataclass(frozen=True)
class SparsityTerm:
    """The sparsity term of a training round (`training.rounds.Round.sparsity`): each
    regularized layer's lambda, the transform, and the activation thresholds in place while
    the network trains (layer -> t; none by default)."""

    lambdas: dict[str, float]
    transform: SparsityTransform
    thresholds: dict[str, float] = field(default_factory=dict)

    def regularized(self, step: Step, model: nn.Module):
        """`sparsity_regularized` of `step` on `model` with this term."""
        return sparsity_regularized(step, model, self.lambdas, self.transform,
                                    self.thresholds)


def activation_memory(shape: Sequence[int], zero_fraction: float, value_bytes: int = 4
                      ) -> dict[str, float]:
    """Bytes one image's map of `shape` takes, on average, stored three ways:

    - `dense`: every value (`value_bytes` each);
    - `bitmap`: one bit per value saying whether it is nonzero, then the nonzero values;
    - `csr`: the map as a (channels, height x width) matrix in compressed sparse rows: the
      nonzero values, a column index each (2 bytes while a row has at most 65,536 values, else
      4) and channels + 1 row offsets of 4 bytes.
    """
    values = math.prod(shape)
    nonzero = (1.0 - zero_fraction) * values
    rows = shape[0] if len(shape) > 1 else 1
    columns = values // rows
    index_bytes = 2 if columns <= 1 << 16 else 4
    return {"dense": float(values * value_bytes),
            "bitmap": math.ceil(values / 8) + nonzero * value_bytes,
            "csr": nonzero * (value_bytes + index_bytes) + (rows + 1) * 4}
