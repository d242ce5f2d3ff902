"""A training round run data-parallel inside a task: `torchrun` launches `training.ddp_round`.

The task writes the round's job (`round_job`: data, states, passes, schedule; and for a
distillation stage the student's adapter and the feature bank, for a cascade module round
the module and its loss's settings) to a temporary folder,
launches `torchrun --standalone --nproc-per-node N -m training.ddp_round JOB OUT` (gloo on
CPUs, nccl on GPUs, one process per GPU), and loads rank 0's result back into its own model,
optimizer, weight average and adapter, so everything after the round (validation, checkpoint,
versioning) is the same as in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from tasks.adapters.checkpoints import torch_save
from tasks.adapters.environment import PROJECT_ROOT
from tasks.data import DatasetRef, LoadedDataset
from training.ddp_round import cpu_state

if TYPE_CHECKING:
    from tasks.configs.cascade import CascadeConfig
    from tasks.configs.sections import ClassifierConfig


class DataParallelError(RuntimeError):
    """The data-parallel processes failed; the message ends with their output."""


def torchrun() -> str:
    """The torchrun launcher of this interpreter's environment."""
    return str(Path(sys.executable).with_name("torchrun"))


def round_job(config: ClassifierConfig | CascadeConfig, dataset: DatasetRef,
              data: LoadedDataset, model: nn.Module, optimizer: torch.optim.Optimizer,
              positions: Tensor, passes: range, schedule: tuple[int, int],
              warmup_epochs: float, seeds: list[int] | None = None, seed: int | None = None,
              averaged: AveragedModel | None = None, average_decay: float | None = None,
              distill: dict[str, Any] | None = None, sparsity: dict[str, Any] | None = None,
              cascade: dict[str, Any] | None = None, batch_size: int | None = None
              ) -> dict[str, Any]:
    """The job of `training.ddp_round`: `passes` over the images at `positions` with the
    config's optimizer settings and `batch_size` (default: the config's), shuffled per pass
    by `seeds` or as one stream from `seed`; `distill` (the student's layer, adapter and
    bank) makes it a distillation stage, `sparsity` (a `SparsitySpec` dumped) adds the
    activation-sparsity term, `cascade` (the spec, module k, ...: `tasks.cascade`) makes
    `model` a cascade whose module k trains."""
    network = {"cascade": cascade} if cascade is not None else {"model": config.model,
                                                                  "width": config.width}
    return {"images": data.images, "labels": data.labels, "positions": positions,
            "mean": dataset.mean, "std": dataset.std, "channels": dataset.channels,
            "classes": len(dataset.classes), **network,
            "state": cpu_state(model), "optimizer": optimizer.state_dict(),
            "passes": list(passes), "seeds": seeds, "seed": seed, "schedule": list(schedule),
            "warmup_epochs": warmup_epochs, "batch_size": batch_size or config.batch_size,
            "augment": config.augment, "flip": config.flips(),
            "lr": config.lr, "momentum": config.momentum,
            "weight_decay": config.weight_decay, "label_smoothing": config.label_smoothing,
            "grad_clip": config.grad_clip, "device": config.device, "threads": config.threads,
            "average_decay": average_decay if averaged is not None else None,
            "averaged": None if averaged is None else cpu_state(averaged.module),
            "distill": distill, "sparsity": sparsity}


def train_round_data_parallel(procs: int, job: dict, model: nn.Module,
                              optimizer: torch.optim.Optimizer,
                              averaged: AveragedModel | None, threads: int | None,
                              timeout: float = 24 * 3600,
                              adapter: nn.Module | None = None) -> dict[str, float]:
    """Runs `job` in `procs` processes and copies the trained states into `model`, `optimizer`,
    `averaged` and `adapter`; returns the round's losses (over the processes' shares
    together) and `ddp_processes`."""
    with tempfile.TemporaryDirectory(prefix="ddp-round-") as folder:
        job_path, out_path = Path(folder) / "job.pt", Path(folder) / "out.pt"
        torch_save(job, job_path)
        per_process = threads or max(1, (os.cpu_count() or 1) // procs)
        env = {**os.environ, "OMP_NUM_THREADS": str(per_process),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                            os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([torchrun(), "--standalone", "--nproc-per-node", str(procs),
                               "-m", "training.ddp_round", str(job_path), str(out_path)],
                              cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not out_path.exists():
            raise DataParallelError(f"torchrun with {procs} processes failed (exit "
                                    f"{done.returncode}): {done.stderr[-3000:]}")
        out = torch.load(out_path, map_location="cpu", weights_only=True)
    if out["world_size"] != procs:
        raise DataParallelError(f"asked for {procs} processes, the job ran in "
                                f"{out['world_size']}")
    model.load_state_dict(out["model"])
    optimizer.load_state_dict(out["optimizer"])
    if averaged is not None:
        averaged.module.load_state_dict(out["averaged"])
    if adapter is not None:
        adapter.load_state_dict(out["adapter"])
    return out["metrics"] | {"ddp_processes": float(procs)}
