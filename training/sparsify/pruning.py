"""Dead channels removed for good: a real, smaller network (Torch-Pruning's dependency graph).

A channel of a regularized layer that is zero everywhere on (nearly) every validation image
contributes nothing downstream on those images, so the convolution that produces it is cut
to fewer output channels, and every layer that reads it (the next convolution's input
channels, a linear layer's input features of a flattened map, a BatchNorm, a residual branch
coupled to it) is cut to match, by `torch_pruning.DependencyGraph`. On the images where the
channel is zero the pruned network computes exactly what the original did.

Latency is measured, not counted: `median_latency` times forward passes in eval mode.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence

import torch
import torch_pruning as tp
from torch import Tensor, nn


def producing_conv(model: nn.Module, layer: str) -> nn.Conv2d:
    """The convolution whose output channels are `layer`'s: `layer` itself, or the last
    `Conv2d` inside it."""
    module = dict(model.named_modules())[layer]
    if isinstance(module, nn.Conv2d):
        return module
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError(f"layer {layer!r} holds no convolution whose channels could be pruned")
    return convs[-1]


def prune_channels(model: nn.Module, channels: dict[str, Sequence[int]], example: Tensor
                   ) -> nn.Module:
    """A copy of `model` with `channels[layer]` (indices) removed from each layer's output and
    from everything that depends on them. A layer keeps at least one channel."""
    pruned = copy.deepcopy(model).eval()
    graph = tp.DependencyGraph().build_dependency(pruned, example_inputs=example)
    names = dict(model.named_modules())
    for layer, drop in channels.items():
        if layer not in names:
            raise KeyError(f"no layer {layer!r} in {type(model).__name__}")
        conv = producing_conv(pruned, layer)
        drop = sorted(set(int(i) for i in drop))[:max(conv.out_channels - 1, 0)]
        if drop:
            graph.get_pruning_group(conv, tp.prune_conv_out_channels, idxs=drop).prune()
    return pruned


def parameter_count(model: nn.Module) -> int:
    """Parameters of `model`."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def median_latency(models: dict[str, nn.Module], example: Tensor, repeats: int = 30,
                   warmup: int = 5) -> dict[str, float]:
    """Median seconds of one forward pass of each model on `example`, the models interleaved
    call by call (so machine noise hits them alike)."""
    for model in models.values():
        model.eval()
        for _ in range(warmup):
            model(example)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            started = time.perf_counter()
            model(example)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}
