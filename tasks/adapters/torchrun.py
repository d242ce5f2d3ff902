"""A training round run data-parallel inside a task: `torchrun` launches `training.ddp_round`.

`train_data_parallel` writes the round's job (the `training.rounds.Round` as a record, and the
trainee's states: network, modules beside it, optimizer, weight average) to a temporary
folder, launches `torchrun --standalone --nproc-per-node N -m training.ddp_round JOB OUT` (gloo
on CPUs, nccl on GPUs, one process per GPU), and loads rank 0's result back into the trainee,
so everything after the round (validation, checkpoint, versioning) is the same as in one
process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tasks.adapters.checkpoints import torch_save
from tasks.environment import PROJECT_ROOT
from training.ddp_round import cpu_state
from training.rounds import Round, Trainee, to_record


class DataParallelError(RuntimeError):
    """The data-parallel processes failed; the message ends with their output."""


def torchrun() -> str:
    """The torchrun launcher of this interpreter's environment."""
    return str(Path(sys.executable).with_name("torchrun"))


def train_data_parallel(procs: int, round_: Round, trainee: Trainee, device: str,
                        threads: int | None, timeout: float = 24 * 3600) -> dict[str, float]:
    """Trains `round_` in `procs` processes on `device` (`auto`, `cpu`, `cuda`) and copies the
    trained states into `trainee`; returns the round's losses (over the processes' shares
    together) and `ddp_processes`."""
    if round_.network is None:
        raise ValueError("this round trains in one process only: it has no network spec for "
                         "the other processes")
    job = {"round": to_record(round_), "device": device, "threads": threads,
           "state": cpu_state(trainee.model),
           "extras": {name: cpu_state(m) for name, m in trainee.extras.items()},
           "optimizer": trainee.optimizer.state_dict(),
           "averaged": None if trainee.averaged is None else cpu_state(trainee.averaged.module)}
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
    trainee.model.load_state_dict(out["model"])
    trainee.optimizer.load_state_dict(out["optimizer"])
    if trainee.averaged is not None:
        trainee.averaged.module.load_state_dict(out["averaged"])
    for name, module in trainee.extras.items():
        module.load_state_dict(out["extras"][name])
    return out["metrics"] | {"ddp_processes": float(procs)}
