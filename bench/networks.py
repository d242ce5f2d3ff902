"""Networks that earn their size: test accuracy per parameter count, through the flows' recipe.

Each network trains on the same 20,000 Fashion-MNIST training images with the recipe every
flow uses (`training.recipe.train_round`: SGD with Nesterov momentum 0.9, weight decay 5e-4,
batch 128, learning rate 0.05 on one cosine over the run, pad-and-crop and flip augmentation
0.5, gradient clipping at 5) and is tested on the 10,000 test images. Pure training code (no
Prefect, MLflow or DVC), so it runs where only PyTorch is installed:

    python bench/networks.py --data data/fashion-mnist --device cuda
    python bench/networks.py --models lenet cnn3 --epochs 10 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model, list_models  # noqa: E402
from training.batches import Batches, Normalize  # noqa: E402
from training.datasets import (  # noqa: E402
    assign_splits,
    channel_stats,
    load_fashion_mnist,
    split_positions,
)
from training.device import place_model, resolve_device  # noqa: E402
from training.loops import classification_step, evaluate  # noqa: E402
from training.recipe import sgd, train_round  # noqa: E402

# The flows' defaults (tasks/configs/sections.py, StepSection), for what this benchmark does
# not vary.
LR, MOMENTUM, WEIGHT_DECAY, BATCH, AUGMENT, GRAD_CLIP = 0.05, 0.9, 5e-4, 128, 0.5, 5.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/fashion-mnist")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", nargs="+", default=["lenet", "cnn3", "resnet18", "resnet20"],
                        choices=list_models())
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-limit", type=int, default=20000)
    args = parser.parse_args()
    device = resolve_device(args.device)
    train, test = load_fashion_mnist(args.data, True), load_fashion_mnist(args.data, False)
    # the flows' training split (split seed 0, 10% validation) and --train-limit
    train_ids = split_positions(assign_splits(train.keys, 0.1, 0.0, 0,
                                              train_limit=args.train_limit), "train")
    normalize = Normalize(*channel_stats(train.images[train_ids]))
    test_batches = Batches(test.images, test.labels, torch.arange(len(test.labels)), 2048,
                           normalize, device=device)
    rows = []
    for name in args.models:
        accuracies, seconds = [], []
        for seed in args.seeds:
            torch.manual_seed(seed)
            model = build_model(name, 1, 10)
            parameters = sum(p.numel() for p in model.parameters())
            model = place_model(model, device)
            optimizer = sgd(model.parameters(), LR, MOMENTUM, WEIGHT_DECAY)
            started = time.perf_counter()
            train_round(model, optimizer, lambda epoch, seed=seed: Batches(
                train.images, train.labels, train_ids, BATCH, normalize, shuffle=True,
                seed=seed * 1000 + epoch, augment=AUGMENT, drop_last=True, device=device),
                classification_step(), device, range(args.epochs), LR, (0, args.epochs),
                grad_clip=GRAD_CLIP)
            seconds.append(time.perf_counter() - started)
            accuracies.append(evaluate(model, test_batches, device)["accuracy"])
            print(f"{name} seed {seed}: {accuracies[-1]:.4f}", flush=True)
        mean = statistics.fmean(accuracies)
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        rows.append({"model": name, "parameters": parameters, "test_accuracy": accuracies,
                     "mean": mean, "std": std, "seconds": statistics.fmean(seconds)})
    print(f"\n{device}, {len(train_ids)} training images, {args.epochs} epochs")
    for row in rows:
        print(f"{row['model']:10s} {row['parameters']:>9,d} parameters  {row['mean']:.4f} ± "
              f"{row['std']:.4f}  " + " / ".join(f"{a:.4f}" for a in row["test_accuracy"])
              + f"  {row['seconds']:.0f} s/seed")
    print(json.dumps({"benchmark": "networks", "device": str(device), "epochs": args.epochs,
                      "results": rows}))


if __name__ == "__main__":
    main()
