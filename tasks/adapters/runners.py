"""Task runners: in this process, or on a Dask cluster through prefect-dask.

Tasks that run on Dask workers report to the Prefect API. Without a configured server each
worker process would start a temporary server of its own (about 20 s each, and the flow's UI
would not see their task runs), so before a local cluster starts, the API the flow itself uses
(a configured server, or the flow's own temporary one) is put in the environment the workers
inherit. Where GPUs exist, the local cluster has one worker per GPU (`local_gpus`). Local
workers load `tasks.adapters.stalls`: one whose event loop stops dumps its threads' stacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dask
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from tasks.adapters import stalls
from tasks.configs.sections import RunnerSection


def shared_api_url() -> str:
    """The Prefect API this process uses; starts the temporary server if there is none yet."""
    url = PREFECT_API_URL.value()
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()  # a no-op when this process's temporary server already runs
    return server.api_url


def task_runner(config: RunnerSection, device: str = "auto") -> TaskRunner:
    """The task runner a config's cluster section asks for, for tasks training on `device`
    (see the module docstring for the Dask case)."""
    if config.runner == "process":
        return ThreadPoolTaskRunner(max_workers=1)
    from prefect_dask import DaskTaskRunner

    if config.dask_address:
        return DaskTaskRunner(address=config.dask_address)
    os.environ["PREFECT_API_URL"] = shared_api_url()  # the workers inherit it
    use_this_process_threads_on_workers()
    dump_stacks_of_stalled_workers()
    devices = local_gpus(device)
    if devices:
        return DaskTaskRunner(cluster_class=one_gpu_per_worker_cluster,
                              cluster_kwargs={"devices": devices})
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
        "n_workers": config.dask_workers, "threads_per_worker": 1, "processes": True,
        "dashboard_address": None})


def local_gpus(device: str) -> list[str]:
    """The CUDA devices local workers get, one each: none unless `device` allows CUDA and
    PyTorch sees GPUs (ids as CUDA_VISIBLE_DEVICES names them, if it is set)."""
    import torch

    if device not in ("auto", "cuda") or not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    count = torch.cuda.device_count()
    return names[:count] if names else [str(i) for i in range(count)]


def one_gpu_per_worker_cluster(devices: list[str], asynchronous: bool = False, **kwargs: Any):
    """A local Dask cluster of one single-threaded worker process per GPU, each seeing only its
    own device (CUDA_VISIBLE_DEVICES) and offering the resource `GPU: 1`, as dask-cuda's
    LocalCUDACluster does (dask-cuda itself pins another Dask than this project's)."""
    from distributed import Nanny, Scheduler, SpecCluster

    workers = {f"gpu-{device}": {"cls": Nanny, "options": {
        "nthreads": 1, "resources": {"GPU": 1}, "env": {"CUDA_VISIBLE_DEVICES": device}}}
        for device in devices}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    return SpecCluster(workers=workers, scheduler=scheduler, asynchronous=asynchronous,
                       name="compactml-gpus", **kwargs)


def use_this_process_threads_on_workers() -> None:
    """Local Dask workers start with this process's thread settings, not Dask's default of 1.

    Dask sets OMP_NUM_THREADS=1 (in this process too) before it spawns a worker, and PyTorch's
    CPU kernels set up under that compute in another order than under the default, even at the
    same `torch.set_num_threads`: a task would give other bits on a worker than in-process.
    Tasks set their own thread count (`--threads`, or `worker_threads`).
    """
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    dask.config.set({"distributed.nanny.pre-spawn-environ": {
        **dask.config.get("distributed.nanny.pre-spawn-environ", {}),
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads}})


def dump_stacks_of_stalled_workers() -> None:
    """Local Dask workers load `tasks.adapters.stalls` (its `COMPACTML_STALL_SECONDS` checked
    here, before any worker starts)."""
    stalls.stall_seconds()
    preload = list(dask.config.get("distributed.worker.preload", []))
    if stalls.MODULE not in preload:
        dask.config.set({"distributed.worker.preload": [*preload, stalls.MODULE]})


def worker_threads(config: RunnerSection, threads: int | None) -> int | None:
    """PyTorch threads per task: `threads` if given; on a local Dask cluster, the cores shared
    among its workers (so overlapping tasks do not oversubscribe them); else PyTorch's default.
    """
    if threads is not None or config.runner == "process" or config.dask_address:
        return threads
    return max(1, (os.cpu_count() or 1) // config.dask_workers)


class Completed:
    """A task already run in this process, shaped like a Prefect future: `result()` returns its
    value or raises its error."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value, self.error = None, None
        try:
            self.value = call()
        except Exception as error:  # kept for result(), as a future keeps a failed state
            self.error = error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def submitter(config: RunnerSection) -> Callable[..., Any]:
    """`submit(task, *args)`: the task's future on Dask, or its result now, run in turn."""
    if config.runner == "process":
        return lambda task, *args: Completed(lambda: task(*args))
    return lambda task, *args: task.submit(*args)
