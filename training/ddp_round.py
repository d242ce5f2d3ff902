"""One training round run data-parallel: `torchrun --nproc-per-node N -m training.ddp_round
JOB OUT`.

The job file (written by the task that launches it, `tasks/adapters/torchrun.py`) holds the
round (`training.rounds.Round` as a record: the network's and the step's specs, the batches
with their images, the passes, schedule and optimizer settings) and the live states: the
network's, the modules' trained beside it (a distillation adapter), the optimizer's and the
weight average's. Every process rebuilds them, joins the job (`training.distributed`: gloo on
CPUs, nccl on CUDA) and trains its share of each batch through `training.rounds.train_passes`, the
function the in-process path calls; DDP averages the gradients, so a step is one process's
step on the whole batch (BatchNorm aside: on CPUs each process normalises its own share).
Rank 0 writes the trained states and the round's losses to OUT, under a temporary name, then
renames it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.device import place_model, resolve_device
from training.distributed import start, stop
from training.recipe import optimizer_to, set_momentum_and_decay, sgd, start_average
from training.rounds import Round, Trainee, from_record, train_passes


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Trains the job's round in this process (one of the job's processes, or alone)."""
    device = resolve_device(job["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    place = start(device)
    round_: Round = from_record(job["round"])
    model = round_.network.build()
    model.load_state_dict(job["state"])
    extras = round_.step.extras()
    for name, module in extras.items():
        module.load_state_dict(job["extras"][name])
    # the parameters in the order the launching task's optimizer holds them
    optimizer = sgd(round_.step.parameters(model, extras), round_.lr, round_.momentum,
                    round_.weight_decay)
    if job["optimizer"] is not None:
        optimizer.load_state_dict(job["optimizer"])
        set_momentum_and_decay(optimizer, round_.momentum, round_.weight_decay)
    model = place_model(model, device)
    for module in extras.values():
        module.to(device)
    optimizer_to(optimizer, device)
    averaged = None
    if round_.average_decay is not None:
        averaged = start_average(model, round_.average_decay, job["averaged"])
    metrics = train_passes(round_, Trainee(model, optimizer, extras, averaged), device, place)
    out = {"model": cpu_state(model), "optimizer": optimizer.state_dict(), "metrics": metrics,
           "world_size": place.world_size,
           "extras": {name: cpu_state(module) for name, module in extras.items()},
           "averaged": None if averaged is None else cpu_state(averaged.module)}
    stop()
    return out if place.is_main else {}


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state on the CPU (what the job and result files hold)."""
    return {k: v.cpu() for k, v in module.state_dict().items()}


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, map_location="cpu", weights_only=True)
    out = run(job)
    if out:
        partial = Path(out_path).with_suffix(".partial")
        torch.save(out, partial)
        partial.rename(out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
