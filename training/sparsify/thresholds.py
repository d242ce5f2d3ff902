"""Calibrated activation thresholds: a layer's values at or below t become exact zeros.

A sparsity term makes many activations small without making them zero (ReLU gives exact zeros
only below its kink). A forced activation threshold (Kurtz et al., "Inducing and Exploiting
Activation Sparsity for Fast Neural Network Inference", ICML 2020: FATReLU) zeros every value
of the map whose magnitude is at most t. `calibrate_thresholds` picks, layer after layer, the
largest t among quantiles of the layer's nonzero magnitudes that keeps the score within a
tolerance of the network without thresholds; `install_thresholds` adds them as forward hooks,
which `torch.export` traces into the exported program (the served network zeros alike).
`thresholds_toward` sets them by their zeros instead: the threshold that gives a layer a
chosen share of exact zeros (a step of the way there, for a gradual schedule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from training.features import FeatureHooks

QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SAMPLE = 1 << 20  # magnitudes kept per layer to take the quantiles from
EXACT = 1 << 26  # magnitudes a zero target is set from (64M: lenet's maps on 6,000 images)


def zero_at_most(threshold: float) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    """A forward hook that replaces the module's output x by x where |x| > threshold, else 0."""
    def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> Tensor:
        return output * (output.abs() > threshold)
    return hook


def install_thresholds(model: nn.Module, thresholds: dict[str, float]) -> list[RemovableHandle]:
    """Hooks on `model`'s modules named in `thresholds` (module name -> t); their handles."""
    modules = dict(model.named_modules())
    missing = sorted(set(thresholds) - set(modules))
    if missing:
        raise KeyError(f"no layer {missing} in {type(model).__name__}")
    return [modules[name].register_forward_hook(zero_at_most(t))
            for name, t in thresholds.items()]


@contextmanager
def thresholds_in_place(model: nn.Module, thresholds: dict[str, float]) -> Iterator[nn.Module]:
    """`install_thresholds` for the `with` block only (the hooks are removed after it)."""
    handles = install_thresholds(model, thresholds)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def raise_thresholds(current: dict[str, float], added: dict[str, float]) -> dict[str, float]:
    """Thresholds calibrated on top of `current` (with those in place) merged into them: per
    layer the larger, which is what the two hooks one after the other do."""
    return {name: max(current.get(name, 0.0), added.get(name, 0.0))
            for name in [*current, *(n for n in added if n not in current)]}


@torch.no_grad()
def sampled_magnitudes(model: nn.Module, layer: str, batches: Iterable, device: torch.device,
                       nonzero: bool = False, sample: int = SAMPLE) -> Tensor:
    """|x| of `layer`'s output over `batches` (only the nonzero ones when `nonzero`): all of
    them, or a seeded random sample of `sample` when there are more."""
    model.eval()
    kept: list[Tensor] = []
    generator = torch.Generator().manual_seed(0)
    with FeatureHooks(model, [layer], detach=True) as hooks:
        for _, x, _ in batches:
            model(x.to(device))
            values = hooks[layer].abs().flatten().float().cpu()
            if nonzero:
                values = values[values > 0]
            if len(values) > sample // 8:
                values = values[torch.randperm(len(values), generator=generator)[:sample // 8]]
            kept.append(values)
    values = torch.cat(kept) if kept else torch.zeros(0)
    if len(values) > sample:
        values = values[torch.randperm(len(values), generator=generator)[:sample]]
    return values


def candidate_thresholds(model: nn.Module, layer: str, batches: Iterable, device: torch.device,
                         quantiles: Sequence[float] = QUANTILES) -> list[float]:
    """Quantiles of the nonzero magnitudes of `layer`'s output over `batches`, ascending."""
    values = sampled_magnitudes(model, layer, batches, device, nonzero=True)
    if len(values) == 0:
        return []
    return sorted(set(torch.quantile(values, torch.tensor(quantiles)).tolist()))


def calibrate_thresholds(model: nn.Module, layers: Sequence[str], batches: Iterable,
                         device: torch.device, score: Callable[[nn.Module], float],
                         tolerance: float, floor: float | None = None
                         ) -> tuple[dict[str, float], float, float]:
    """Per layer, in order, the largest candidate threshold (`candidate_thresholds`, taken with
    the earlier layers' thresholds in place) whose network still scores at least the
    unthresholded score minus `tolerance` (bisection: the score falls as t grows), or at least
    `floor` where given (a budget set once for several calibrations, so that their costs do
    not add up).

    Returns the thresholds (a layer where none is affordable is left out), the score without
    and the score with them. `model` is left without the hooks it added."""
    base = score(model)
    floor = base - tolerance if floor is None else floor
    chosen: dict[str, float] = {}
    final = base
    for layer in layers:
        with thresholds_in_place(model, chosen):
            candidates = candidate_thresholds(model, layer, batches, device)
        low, high, best = 0, len(candidates) - 1, None
        while low <= high:
            middle = (low + high) // 2
            with thresholds_in_place(model, chosen | {layer: candidates[middle]}):
                value = score(model)
            if value >= floor:
                best, low = (candidates[middle], value), middle + 1
            else:
                high = middle - 1
        if best is not None:
            chosen[layer], final = best
    return chosen, base, final


def threshold_toward(model: nn.Module, layer: str, batches: Iterable, device: torch.device,
                     target: float, step: float) -> float:
    """The smallest magnitude t at which `layer`'s output over `batches` has at least a share
    of its values at most t (its exact zeros included) `step` of the way from its share of
    exact zeros now to `target`: 0 when it has that many zeros already. One pass, from every
    value up to EXACT of them (a sample of a map of more: its share of zeros may then miss the
    target by the sample's error, about 1e-3 at 1M)."""
    values = sampled_magnitudes(model, layer, batches, device, sample=EXACT)
    now = int((values == 0).sum()) / len(values) if len(values) else 1.0
    if now >= target:
        return 0.0
    share = now + step * (target - now)
    rank = min(max(math.ceil(share * len(values) - 1e-9), 1), len(values))
    return values.kthvalue(rank).values.item()


def thresholds_toward(model: nn.Module, layers: Sequence[str], batches: Iterable,
                      device: torch.device, target: float, step: float) -> dict[str, float]:
    """Per layer, in order (the earlier layers' new thresholds in place), the threshold that
    takes its share of exact zeros `step` of the way from where it is (thresholds `model`
    already has in place included) to `target` (`threshold_toward`): step 1 reaches the
    target. A layer already at or past the target is left out. `model` is left without the
    hooks it added."""
    if not 0.0 < step <= 1.0:
        raise ValueError(f"step must be in (0, 1], got {step}")
    chosen: dict[str, float] = {}
    for layer in layers:
        with thresholds_in_place(model, chosen):
            threshold = threshold_toward(model, layer, batches, device, target, step)
        if threshold > 0:
            chosen[layer] = threshold
    return chosen
