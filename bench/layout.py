"""The plain memory layout against channels_last for the served networks: batch 1 and 64.

`training.device.fast_layout` puts a network's 4-d weights in channels_last on the CPU and
CUDA (the activations follow them) for the served programs (`serving.classifier.load_program`).
This benchmark times, per network and in one process, the same weights in both layouts,
alternating call by call (order swapped every round, so the machine's drift hits both): a
forward pass without gradients at batch 1 and at batch 64 (the served batches); it reports the
medians, the median of the paired ratios (channels_last / plain: below 1 is faster) and the
largest difference between the two layouts' logits (float rounding). Untrained networks on
random 28-pixel gray images (the speed does not depend on the weights). Training stays in the
plain layout on the CPU (`training.device.place_model` says why). Pure PyTorch:

    python -m bench.layout                  # the CPU, 1 thread (as served): under a minute
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_networks, print_json, print_table  # noqa: E402
from models import build_model  # noqa: E402
from training.device import fast_layout, resolve_device  # noqa: E402

NETWORKS = (("lenet", None), ("lenet", 64), ("cnn3", None), ("resnet18", None))
MEASURES = ("forward_b1", "forward_b64")
CALLS = {"forward_b1": 20, "forward_b64": 3}


def forward(model: nn.Module, images: torch.Tensor) -> Callable[[], None]:
    def call() -> None:
        with torch.inference_mode():
            model(images)
    return call


def seconds(call: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Seconds per call, over `repeats` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def measure(name: str, width: int | None, rounds: int, device: torch.device) -> dict:
    """Both layouts of one network, interleaved: per measure the plain and channels_last
    medians (ms per image) and the median paired ratio; the logits' largest difference."""
    torch.manual_seed(0)
    plain = build_model(name, 1, 10, width).to(device)
    fast = fast_layout(copy.deepcopy(plain), device)
    generator = torch.Generator().manual_seed(0)
    images = {b: torch.randn(b, 1, 28, 28, generator=generator).to(device) for b in (1, 64)}
    plain.eval(), fast.eval()
    with torch.inference_mode():
        difference = (plain(images[64]) - fast(images[64])).abs().max().item()
    calls = {layout: {"forward_b1": forward(model, images[1]),
                      "forward_b64": forward(model, images[64])}
             for layout, model in (("plain", plain), ("channels_last", fast))}
    per_image = {"forward_b1": 1, "forward_b64": 64}
    times = {m: {"plain": [], "channels_last": []} for m in MEASURES}
    ratios = {m: [] for m in MEASURES}
    for layout in calls:  # warm-up: allocator, kernels, caches
        for measure_ in MEASURES:
            seconds(calls[layout][measure_], 2, device)
    for round_ in range(rounds):
        order = ("plain", "channels_last") if round_ % 2 == 0 else ("channels_last", "plain")
        for measure_ in MEASURES:
            measured = {layout: seconds(calls[layout][measure_], CALLS[measure_], device)
                        for layout in order}
            for layout, value in measured.items():
                times[measure_][layout].append(value * 1000 / per_image[measure_])
            ratios[measure_].append(measured["channels_last"] / measured["plain"])
    figures = {"max_logit_difference": difference}
    for measure_ in MEASURES:
        figures[measure_] = {"plain_ms_per_image": statistics.median(times[measure_]["plain"]),
                             "channels_last_ms_per_image": statistics.median(
                                 times[measure_]["channels_last"]),
                             "ratio": statistics.median(ratios[measure_])}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: its default)")
    parser.add_argument("--networks", nargs="+", default=None, metavar="MODEL[:WIDTH]",
                        help="default: lenet, lenet:64, cnn3, resnet18")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds must be at least 1, got {args.rounds}")
    networks = parse_networks(args.networks) if args.networks else NETWORKS
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    figures, rows = {}, []
    for name, width in networks:
        label = f"{name}:{width}" if width else name
        figures[label] = measure(name, width, args.rounds, device)
        rows.append((label, *(f"{figures[label][m]['plain_ms_per_image']:.4f} / "
                              f"{figures[label][m]['channels_last_ms_per_image']:.4f} "
                              f"({figures[label][m]['ratio']:.2f}x)" for m in MEASURES),
                     f"{figures[label]['max_logit_difference']:.1e}"))
        print(f"{label}: " + ", ".join(f"{m} {figures[label][m]['ratio']:.2f}x"
                                        for m in MEASURES), flush=True)
    print(f"\n{device}, {torch.get_num_threads()} threads, ms per image, plain / channels_last "
          f"(median paired ratio), {args.rounds} rounds")
    print_table(("network", *MEASURES, "largest logit difference"), rows)
    print_json({"benchmark": "layout", "device": str(device), "threads": torch.get_num_threads(),
                "rounds": args.rounds, "networks": figures})


if __name__ == "__main__":
    main()
