"""Measured computation time of a cascade's parts, on the device that serves it.

Each part (a plain module's block, each sub-network of a super-network module, each exit head,
each predictor) is timed alone on the feature map it really receives, at batch 1 and at the
serving batch size: the median of `repeats` timed calls after `warmup` untimed ones (CUDA is
synchronized around each call). FLOPs (PyTorch's `FlopCounterMode`, multiply-adds counted
twice) are reported beside, at batch 1; the cascade's decisions use the measured times.

A table knows the device it was measured on (`device_name`); `check_device` refuses one from
another device, since times do not carry over between machines.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from models.cascade import CascadeNet


def device_name(device: torch.device, threads: int | None = None) -> str:
    """What the times depend on: the processor (or GPU) and, on a CPU, the thread count
    (`threads`, or PyTorch's current setting)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return "mps: Apple GPU"
    processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info
                     if line.startswith("model name")]
        processor = names[0] if names else processor
    except OSError:
        pass
    return f"cpu: {processor}, {threads or torch.get_num_threads()} threads"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def median_ms(call: Callable[[], object], device: torch.device, repeats: int = 30,
              warmup: int = 5) -> float:
    """The median wall time of `call()` in milliseconds."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def flops(module: nn.Module, x: Tensor) -> int:
    """FLOPs of one call of `module` on `x` (PyTorch's counter)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(x)
    return int(counter.get_total_flops())


def _parts(net: CascadeNet, x: Tensor) -> list[tuple[str, nn.Module, Tensor]]:
    """Every timed part with the input it receives: `k.block` or `k.sub{s}`, `k.predictor`,
    `k.exit`."""
    parts = []
    x = net.fit_input(x)
    for k in range(net.modules_count):
        module = net.blocks[k]
        if net.is_super(k):
            parts.append((f"{k}.predictor", module.predictor, x))
            for s, subnet in enumerate(module.subnets):
                parts.append((f"{k}.sub{s}", subnet, x))
            x = module.subnets[-1](x)
        else:
            parts.append((f"{k}.block", module, x))
            x = module(x)
        parts.append((f"{k}.exit", net.exits[k], x))
    return parts


@torch.no_grad()
def latency_table(net: CascadeNet, image_shape: tuple[int, int, int], device: torch.device,
                  batch_sizes: tuple[int, ...] = (1, 256), repeats: int = 30) -> dict:
    """Every part's median time (ms per call) at each batch size and its FLOPs per image:
    `{"device": ..., "batch_sizes": [...], "parts": {name: {"ms": {batch: ms}, "flops": n}}}`.
    """
    was_training = net.training
    net.eval()
    parts: dict[str, dict] = {}
    for batch in batch_sizes:
        x = torch.rand(batch, *image_shape, device=device)
        for name, module, inputs in _parts(net, x):
            entry = parts.setdefault(name, {"ms": {}, "flops": None})
            entry["ms"][str(batch)] = median_ms(lambda m=module, i=inputs: m(i), device, repeats)
            if batch == 1:
                entry["flops"] = flops(module, inputs)
    net.train(was_training)
    return {"device": device_name(device), "batch_sizes": list(batch_sizes), "parts": parts}


def check_device(table: dict, device: torch.device) -> None:
    """Refuses a table measured on another device."""
    here = device_name(device)
    if table.get("device") != here:
        raise ValueError(f"latency_table was measured on {table.get('device')!r}, not on this "
                         f"device ({here!r}): measure it here")


def part_costs(table: dict, batch: int = 1, key: str = "ms") -> dict[str, float]:
    """Each part's cost per image: milliseconds at `batch` (divided by the batch), or FLOPs."""
    if key == "flops":
        return {name: float(entry["flops"]) for name, entry in table["parts"].items()}
    return {name: entry["ms"][str(batch)] / batch for name, entry in table["parts"].items()}


def path_costs(net: CascadeNet, costs: dict[str, float], path: tuple[int, ...],
               routed: bool | None = None) -> list[float]:
    """The cumulative cost of reaching and scoring each exit along `path` (one sub-network
    index per module): the blocks run, every exit head passed, and the predictor of each
    super-network module that routes (`routed` None: those without a fixed choice; False:
    none, the sub-networks given from outside)."""
    total, out = 0.0, []
    for k, s in enumerate(path):
        if net.is_super(k):
            routes = int(net.blocks[k].fixed) < 0 if routed is None else routed
            total += costs[f"{k}.sub{s}"] + (costs[f"{k}.predictor"] if routes else 0.0)
        else:
            total += costs[f"{k}.block"]
        total += costs[f"{k}.exit"]
        out.append(total)
    return out


def full_network_cost(net: CascadeNet, costs: dict[str, float]) -> float:
    """The cost of the full network, what `CascadeNet.forward` runs: every block (each
    super-network module's most expensive sub-network) and the last exit head only (no
    predictor, no earlier exit head)."""
    path = tuple(net.most_expensive(k) for k in range(net.modules_count))
    passed = sum(costs[f"{k}.exit"] for k in range(net.modules_count - 1))
    return path_costs(net, costs, path, routed=False)[-1] - passed


@torch.no_grad()
def interleaved_ms_per_image(calls: dict[str, Callable[[Tensor], object]], images: Tensor,
                             batch: int, repeats: int = 3) -> dict[str, float]:
    """Milliseconds per image of each call over `images` in batches of `batch`: the passes of
    the calls alternate (so a busy machine slows them alike), the median of `repeats` counts."""
    device = images.device
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            _sync(device)
            started = time.perf_counter()
            for first in range(0, len(images), batch):
                call(images[first:first + batch])
            _sync(device)
            times[name].append((time.perf_counter() - started) * 1e3 / max(len(images), 1))
    return {name: statistics.median(values) for name, values in times.items()}
