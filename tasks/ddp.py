"""A training round run data-parallel inside a task: `torchrun` launches `training.ddp_round`.

The task writes the round's job (data, states, passes, schedule) to a temporary folder,
launches `torchrun --standalone --nproc-per-node N -m training.ddp_round JOB OUT` (gloo on
CPUs, nccl on GPUs, one process per GPU), and loads rank 0's result back into its own model,
optimizer and weight average, so everything after the round (validation, checkpoint,
versioning) is the same as in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from tasks.checkpoints import torch_save
from tasks.environment import PROJECT_ROOT


class DataParallelError(RuntimeError):
    """The data-parallel processes failed; the message ends with their output."""


def torchrun() -> str:
    """The torchrun launcher of this interpreter's environment."""
    return str(Path(sys.executable).with_name("torchrun"))


def train_round_data_parallel(procs: int, job: dict, model: nn.Module,
                              optimizer: torch.optim.Optimizer,
                              averaged: AveragedModel | None, threads: int | None,
                              timeout: float = 24 * 3600) -> dict[str, float]:
    """Runs `job` in `procs` processes and copies the trained states into `model`, `optimizer`
    and `averaged`; returns the round's losses (over the processes' shares together) and
    `ddp_processes`."""
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
    return out["metrics"] | {"ddp_processes": float(procs)}
