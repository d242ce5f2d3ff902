"""Images per second of a scoring pass at the device's `inference_batch` against 1024.

Every flow scores validation and test splits (and the sparsify flow's threshold calibrations)
without gradients, through `training.batches.eval_batches`, in batches of
`training.device.inference_batch`: 1024 on an accelerator, 256 on the CPU. This benchmark
times `training.loops.evaluate` over the 10,000 Fashion-MNIST test images at both batch sizes,
alternating pass by pass in one process (order swapped every round, so the machine's drift
hits both), and reports the median of the rounds' paired ratios with the two accuracies (the
same, up to float rounding: the batch size changes only the speed). Pure PyTorch:

    python -m bench.inference_batch                    # the CPU, its default threads: ~2 minutes
    python -m bench.inference_batch --device cuda --threads 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_networks, print_json, print_table  # noqa: E402
from models import build_model  # noqa: E402
from training.batches import Batches, Normalize  # noqa: E402
from training.datasets import channel_stats, load_fashion_mnist  # noqa: E402
from training.device import inference_batch, place_model, resolve_device  # noqa: E402
from training.loops import evaluate  # noqa: E402

BASELINE = 1024
NETWORKS = (("lenet", None), ("lenet", 64), ("cnn3", None), ("resnet18", None))


def timed_pass(model: torch.nn.Module, batches: Batches,
               device: torch.device) -> tuple[float, float]:
    """(images per second, accuracy) of one scoring pass."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    accuracy = evaluate(model, batches, device)["accuracy"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(batches.indices) / (time.perf_counter() - started), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/fashion-mnist")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--networks", nargs="+", default=None, metavar="MODEL[:WIDTH]",
                        help="default: lenet, lenet:64, cnn3, resnet18")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds must be at least 1, got {args.rounds}")
    networks = parse_networks(args.networks) if args.networks else NETWORKS
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    chosen = inference_batch(device)
    test = load_fashion_mnist(args.data, False)
    everything = torch.arange(len(test.labels))
    normalize = Normalize(*channel_stats(test.images))

    def batches(size: int) -> Batches:
        return Batches(test.images, test.labels, everything, size, normalize, device=device)

    rows, figures = [], {}
    for name, width in networks:
        torch.manual_seed(0)
        model = place_model(build_model(name, 1, 10, width), device)
        label = f"{name}:{width}" if width else name
        timed_pass(model, batches(chosen), device)  # warm-up: allocator, kernels, caches
        ratios, speeds, accuracies = [], {chosen: [], BASELINE: []}, {}
        for round_ in range(args.rounds):
            order = (chosen, BASELINE) if round_ % 2 == 0 else (BASELINE, chosen)
            measured = {}
            for size in order:
                measured[size], accuracies[size] = timed_pass(model, batches(size), device)
                speeds[size].append(measured[size])
            ratios.append(measured[chosen] / measured[BASELINE])
        ratio = statistics.median(ratios)
        rows.append((label, f"{statistics.median(speeds[chosen]):.0f}",
                     f"{statistics.median(speeds[BASELINE]):.0f}", f"{ratio:.2f}",
                     f"{accuracies[chosen]:.4f} / {accuracies[BASELINE]:.4f}"))
        figures[label] = {"speed_ratio": ratio, "images_per_second": statistics.median(
            speeds[chosen]), "baseline_images_per_second": statistics.median(speeds[BASELINE]),
            "accuracy_difference": accuracies[chosen] - accuracies[BASELINE]}
        print(f"{label}: {ratio:.2f}x", flush=True)
    print(f"\n{device}, {torch.get_num_threads()} threads, untrained networks (the speed does "
          f"not depend on the weights), {len(everything)} test images, {args.rounds} rounds")
    print_table(("network", f"images/s at {chosen}", f"at {BASELINE}", "ratio",
                 "accuracy (both)"), rows)
    print_json({"benchmark": "inference_batch", "device": str(device), "batch": chosen,
                "baseline_batch": BASELINE, "threads": torch.get_num_threads(),
                "networks": figures})


if __name__ == "__main__":
    main()
