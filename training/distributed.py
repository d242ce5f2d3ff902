"""Data-parallel training with torch.distributed (DDP), as launched by `torchrun`.

Every process runs the same loop: the same batches in the same order, each taking its share of
every batch (`Batches(rank=..., world_size=...)`); DDP averages the gradients, so a step equals
one process's step on the whole batch. BatchNorm is the exception: each process normalises its
share, unless the model's BatchNorm layers are made synchronous (done on CUDA; PyTorch's
SyncBatchNorm does not run on CPUs), as in every DDP setup. The loop's metrics are summed over
the processes, so each one reports the whole batch's loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Distributed:
    """This process's place in a data-parallel job (rank 0 of 1 when not launched so)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes files and logs (rank 0)."""
        return self.rank == 0


def from_environment() -> Distributed:
    """The job as `torchrun` describes it in RANK, WORLD_SIZE and LOCAL_RANK."""
    try:
        return Distributed(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                           int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as error:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {error}") from None


def start(device: torch.device) -> Distributed:
    """Joins the job's process group (gloo on CPUs, nccl on CUDA) when there is more than one
    process; returns this process's place in it."""
    job = from_environment()
    if job.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return job


def wrap(model: nn.Module, device: torch.device, job: Distributed,
         find_unused: bool = False) -> nn.Module:
    """The model as DDP trains it (synchronous BatchNorm on CUDA); unchanged for one process.
    `find_unused`: some parameters that need gradients may get none in a step (DDP then looks
    for them after each forward instead of waiting for their gradients)."""
    if job.world_size == 1:
        return model
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return DistributedDataParallel(model, device_ids=[device.index or job.local_rank],
                                       find_unused_parameters=find_unused)
    return DistributedDataParallel(model, find_unused_parameters=find_unused)


def stop() -> None:
    """Leaves the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def sum_over_processes(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over every process of the job (unchanged outside a job)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values
