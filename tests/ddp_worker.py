"""A short training run that `torchrun` launches in 2 processes (see test_distributed.py).

`python -m tests.ddp_worker OUT.json` trains a small BatchNorm-free CNN on 512 real
Fashion-MNIST images for 3 epochs of global batch 64 and writes the per-epoch losses and final
weights' sum (rank 0). Run without torchrun, it is the one-process reference.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from training.batches import Batches, Normalize
from training.distributed import start, stop, wrap
from training.loops import classification_step, cosine_lr, train_epoch

EPOCHS, BATCH, IMAGES = 3, 64, 512


def run() -> tuple[list[float], list[float], int]:
    """Per-epoch mean losses, a per-parameter weight summary, and the number of processes."""
    from tasks.data import fashion_mnist_root  # data path only; the loop is pure training/
    from training.datasets import load_fashion_mnist

    device = torch.device("cpu")
    torch.set_num_threads(1)
    job = start(device)
    data = load_fashion_mnist(fashion_mnist_root(), train=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 10))
    trained = wrap(model, device, job)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = Batches(data.images, data.labels, torch.arange(IMAGES), BATCH,
                      Normalize([0.286], [0.353]), shuffle=True, seed=1, augment=0.5,
                      drop_last=True, rank=job.rank, world_size=job.world_size)
    total = EPOCHS * len(batches)
    losses = []
    for epoch in range(EPOCHS):
        metrics = train_epoch(trained, optimizer, batches, classification_step(), device,
                              lr_at=lambda n: cosine_lr(0.1, n, total),
                              first_step=epoch * len(batches), grad_clip=5.0)
        losses.append(metrics["loss"])
    weights = [p.detach().double().sum().item() for p in model.parameters()]
    stop()
    return losses, weights, job.world_size


if __name__ == "__main__":
    losses, weights, world = run()
    if int(__import__("os").environ.get("RANK", 0)) == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump({"losses": losses, "weights": weights, "world_size": world}, handle)
