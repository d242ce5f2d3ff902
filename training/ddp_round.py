"""One training round run data-parallel: `torchrun --nproc-per-node N -m training.ddp_round
JOB OUT`.

The job file (written by the task that launches it, `tasks/adapters/torchrun.py`) holds everything
the round needs: the images and labels, the training positions, the normalisation, the network's
name and state, the optimizer's state, the passes with their shuffling seeds (one per pass, or one
stream of batches over all passes, as a distillation stage draws them), the schedule and the weight
average. A `job["sparsity"]` adds the activation-sparsity term of `training.sparsify.term` to the
step. A distillation job (`job["distill"]`) also holds the student's layer, its adapter and the
feature bank: the step is then `training.distill.losses.distillation_step`. A cascade job
(`job["cascade"]`) trains module k of a `models.cascade` network instead of a registered one: its
state is the whole network's, its optimizer that of the module's
`training.cascade.learning.StageModel` parameters, its step `training.cascade.learning.module_step`.

Every process builds the same network and batches and trains its share of each batch
(`training.distributed`: gloo on CPUs, nccl on CUDA); DDP averages the gradients, so a step
is one process's step on the whole batch (BatchNorm aside: on CPUs each process normalises its
own share). Rank 0 writes the trained states and the round's losses to OUT, under a temporary
name, then renames it.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import build_model
from models.cascade import CascadeSpec, build_cascade
from training.batches import Batches, Normalize
from training.cascade.learning import StageModel, module_step
from training.device import place_model, resolve_device
from training.distill.feature_bank import FeatureBank
from training.distill.losses import FeatureAdapter, FeatureLoss, bank_targets, distillation_step
from training.distributed import Distributed, start, stop, wrap
from training.features import FeatureHooks
from training.loops import Step, classification_step
from training.recipe import (
    optimizer_to,
    set_momentum_and_decay,
    sgd,
    start_average,
    train_round,
)
from training.sparsify.term import SparsityTransform, sparsity_regularized


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Trains the job's round in this process (one of the job's processes, or alone)."""
    device = resolve_device(job["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    place = start(device)
    cascade = job.get("cascade")
    if cascade is None:
        model = build_model(job["model"], job["channels"], job["classes"], job["width"])
    else:
        model = build_cascade(CascadeSpec(**cascade["spec"]), job["channels"], job["classes"])
    model.load_state_dict(job["state"])
    distill = job.get("distill")
    adapter = None
    if distill is not None:
        adapter = FeatureAdapter(*distill["adapter_shapes"])
        adapter.load_state_dict(distill["adapter"])
    # the parameters in the order the launching task's optimizer holds them
    stage = None if cascade is None else StageModel(model, cascade["k"], cascade["frozen"])
    if stage is not None:
        trainable = stage.trainable_parameters()
    else:
        trainable = list((model if adapter is None else nn.ModuleList([model, adapter]))
                         .parameters())
    optimizer = sgd(trainable, job["lr"], job["momentum"], job["weight_decay"])
    if job["optimizer"] is not None:
        optimizer.load_state_dict(job["optimizer"])
        set_momentum_and_decay(optimizer, job["momentum"], job["weight_decay"])
    model = place_model(model, device)
    if adapter is not None:
        adapter.to(device).train()
    optimizer_to(optimizer, device)
    averaged = None
    if job["average_decay"] is not None:
        averaged = start_average(model, job["average_decay"], job["averaged"])
    trained = wrap(model, device, place) if stage is None else \
        wrap_stage(stage, job, device, place)
    batches_for = pass_batches(job, device, place)
    with ExitStack() as hooks:
        if stage is not None:
            step = call_model
        elif distill is None:
            step = classification_step(job["label_smoothing"])
        else:
            step = student_step(job, model, adapter, device, place, hooks)
        if job.get("sparsity") is not None:
            spec = job["sparsity"]
            transform = SparsityTransform(spec["transform"], spec["power"], spec["abs_power"],
                                          spec["base"])
            step = hooks.enter_context(sparsity_regularized(
                step, model, spec["lambdas"], transform, spec.get("thresholds")))
        metrics = train_round(trained, optimizer, batches_for, step, device,
                              range(job["passes"][0], job["passes"][-1] + 1), job["lr"],
                              tuple(job["schedule"]), job["warmup_epochs"], job["grad_clip"],
                              averaged=averaged)
    out = {"model": cpu_state(model), "optimizer": optimizer.state_dict(), "metrics": metrics,
           "world_size": place.world_size,
           "adapter": None if adapter is None else cpu_state(adapter),
           "averaged": None if averaged is None else cpu_state(averaged.module)}
    stop()
    return out if place.is_main else {}


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state on the CPU (what the result file holds)."""
    return {k: v.cpu() for k, v in module.state_dict().items()}


def pass_batches(job: dict[str, Any], device: torch.device, place: Distributed):
    """`epoch -> Batches` of this process's share: a new shuffle per pass from the pass's seed
    (`job["seeds"]`), or one stream of batches drawn pass after pass from `job["seed"]` (a
    distillation stage, whose passes repeat one `Batches`)."""

    def batches(seed: int) -> Batches:
        return Batches(job["images"], job["labels"], job["positions"], job["batch_size"],
                       Normalize(job["mean"], job["std"]), shuffle=True, seed=seed,
                       augment=job["augment"], drop_last=True, device=device,
                       rank=place.rank, world_size=place.world_size, flip=job["flip"])

    if job.get("seeds") is None:
        stream = batches(job["seed"])
        return lambda _epoch: stream
    seeds = dict(zip(job["passes"], job["seeds"], strict=True))
    return lambda epoch: batches(seeds[epoch])


class StepModel(nn.Module):
    """`step(model, ids, x, y)` as a module's forward, so that DDP sees the whole step (whose
    loss may call sub-modules of `model` directly, as the cascade's does) and averages the
    gradients of every parameter it reaches."""

    def __init__(self, model: nn.Module, step: Step) -> None:
        super().__init__()
        self.model, self.step = model, step

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        return self.step(self.model, ids, x, y)


def call_model(model: nn.Module, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """The step of a `StepModel` (or its DDP wrapper): its forward."""
    return model(ids, x, y)


def wrap_stage(stage: StageModel, job: dict[str, Any], device: torch.device,
               place: Distributed) -> nn.Module:
    """The cascade job's `module_step` on `stage` as DDP trains it: the network's parameters
    that the stage does not train need no gradients, and a step may leave some of the trained
    ones without any (joint training never runs the predictors of the modules before k).
    Each process draws its own random routes (`module_step`), seeded by the round's first
    pass and its rank."""
    cascade = job["cascade"]
    trained = set(stage.trainable_parameters())
    for parameter in stage.net.parameters():
        parameter.requires_grad_(parameter in trained)
    torch.manual_seed(job["seeds"][0] * 1000 + place.rank)
    step = module_step(stage.net, stage.k, cascade["relative_time"], cascade["latency_weight"],
                       job["label_smoothing"], stage.frozen)
    return wrap(StepModel(stage, step), device, place, find_unused=True)


def student_step(job: dict[str, Any], model: nn.Module, adapter: nn.Module,
                 device: torch.device, place: Distributed, hooks: ExitStack) -> Step:
    """The distillation step of `distill`'s student layer, adapter (its gradients averaged
    over the processes like the network's) and feature bank."""
    distill = job["distill"]
    bank = FeatureBank.from_state_dict(distill["bank"]).to(device)
    captured = hooks.enter_context(FeatureHooks(model, [distill["layer"]]))
    if any(p.requires_grad for p in adapter.parameters()):
        adapter = wrap(adapter, device, place)
    return distillation_step(captured, distill["layer"], adapter, bank_targets(bank, device),
                             FeatureLoss(distill["feature_loss"], distill["temperature"]),
                             distill["ce_weight"], distill["feature_weight"],
                             job["label_smoothing"])


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, map_location="cpu", weights_only=True)
    out = run(job)
    if out:
        partial = Path(out_path).with_suffix(".partial")
        torch.save(out, partial)
        partial.rename(out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
