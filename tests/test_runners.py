"""The local GPU cluster's wiring: one worker process per device, each seeing only its own.

CUDA is not needed to check it: the workers are real Dask worker processes, and what each one
sees is its environment and its resources.
"""

import os

from distributed import Client

from tasks.adapters.runners import local_gpus, one_gpu_per_worker_cluster


def _visible_devices() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_each_local_worker_holds_one_device():
    with one_gpu_per_worker_cluster(["3", "5"]) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        seen = client.run(_visible_devices)
        workers = client.scheduler_info()["workers"].values()
        assert sorted(seen.values()) == ["3", "5"]
        assert [w["resources"] for w in workers] == [{"GPU": 1}, {"GPU": 1}]
        assert all(w["nthreads"] == 1 for w in workers)


def test_cpu_runs_get_no_gpu_workers():
    assert local_gpus("cpu") == [] and local_gpus("mps") == []
