"""One training round run data-parallel: `torchrun --nproc-per-node N -m training.ddp_round
JOB OUT`.

The job file (written by the task that launches it, `tasks/ddp.py`) holds everything the round
needs: the images and labels, the training positions, the normalisation, the network's name
and state, the optimizer's state, the passes with their shuffling seeds, the schedule and the
weight average. Every process builds the same network and batches and trains its share of each
batch (`training.distributed`: gloo on CPUs, nccl on CUDA); DDP averages the gradients, so a
step is one process's step on the whole batch (BatchNorm aside: on CPUs each process
normalises its own share). Rank 0 writes the trained states and the round's losses to OUT,
under a temporary name, then renames it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from models import build_model
from training.batches import Batches, Normalize
from training.device import place_model, resolve_device
from training.distributed import start, stop, wrap
from training.loops import classification_step
from training.recipe import (
    optimizer_to,
    set_momentum_and_decay,
    sgd,
    start_average,
    train_round,
)


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Trains the job's round in this process (one of the job's processes, or alone)."""
    device = resolve_device(job["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    place = start(device)
    model = build_model(job["model"], job["channels"], job["classes"], job["width"])
    model.load_state_dict(job["state"])
    optimizer = sgd(model.parameters(), job["lr"], job["momentum"], job["weight_decay"])
    if job["optimizer"] is not None:
        optimizer.load_state_dict(job["optimizer"])
        set_momentum_and_decay(optimizer, job["momentum"], job["weight_decay"])
    model = place_model(model, device)
    optimizer_to(optimizer, device)
    averaged = None
    if job["average_decay"] is not None:
        averaged = start_average(model, job["average_decay"], job["averaged"])
    trained = wrap(model, device, place)
    normalize = Normalize(job["mean"], job["std"])
    seeds = dict(zip(job["passes"], job["seeds"], strict=True))

    def batches_for(epoch: int) -> Batches:
        return Batches(job["images"], job["labels"], job["positions"], job["batch_size"],
                       normalize, shuffle=True, seed=seeds[epoch], augment=job["augment"],
                       drop_last=True, device=device, rank=place.rank,
                       world_size=place.world_size)

    metrics = train_round(trained, optimizer, batches_for,
                          classification_step(job["label_smoothing"]), device,
                          range(job["passes"][0], job["passes"][-1] + 1), job["lr"],
                          tuple(job["schedule"]), job["warmup_epochs"], job["grad_clip"],
                          averaged=averaged)
    out = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
           "optimizer": optimizer.state_dict(), "metrics": metrics,
           "world_size": place.world_size,
           "averaged": None if averaged is None else {
               k: v.cpu() for k, v in averaged.module.state_dict().items()}}
    stop()
    return out if place.is_main else {}


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, map_location="cpu", weights_only=True)
    out = run(job)
    if out:
        partial = Path(out_path).with_suffix(".partial")
        torch.save(out, partial)
        partial.rename(out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
