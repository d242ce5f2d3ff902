"""The local clusters' wiring: one worker process per device, each seeing only its own; a
worker whose event loop stops dumps its threads' stacks.

CUDA is not needed to check it: the workers are real Dask worker processes, and what each one
sees is its environment and its resources.
"""

import os
import time

import pytest
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


def test_a_worker_whose_event_loop_stops_dumps_every_threads_stack(capfd, monkeypatch):
    """A local worker of `task_runner` loads `tasks.adapters.stalls`: while its loop runs,
    nothing is dumped; with its loop stuck past COMPACTML_STALL_SECONDS, every thread's stack
    reaches the worker's stderr (the flow's); the worker lives on and answers again."""
    from tasks.adapters.runners import task_runner
    from tasks.configs.sections import RunnerSection

    monkeypatch.setenv("COMPACTML_STALL_SECONDS", "2")  # the workers inherit it
    with task_runner(RunnerSection(runner="dask", dask_workers=1)) as runner:
        [pid] = runner.client.run(os.getpid).values()
        time.sleep(3)  # an idle worker's loop runs on and keeps re-arming: no dump
        assert "most recent call first" not in capfd.readouterr().err
        # `Client.run` calls a plain function on the worker's event loop: 5 s stuck there
        runner.client.run(time.sleep, 5)
        assert list(runner.client.run(os.getpid).values()) == [pid]  # alive, answering
    err = capfd.readouterr().err
    assert "Timeout (0:00:02)!" in err and "most recent call first" in err
    assert "distributed/worker.py" in err and " in run\n" in err  # where the loop was stuck


def test_a_stall_or_lease_limit_that_is_not_a_positive_number_is_named(monkeypatch):
    from tasks.adapters.stalls import stall_seconds
    from tasks.environment import seconds_setting
    monkeypatch.delenv("COMPACTML_STALL_SECONDS", raising=False)
    assert stall_seconds() == 60
    for value in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv("COMPACTML_STALL_SECONDS", value)
        with pytest.raises(ValueError, match=f"COMPACTML_STALL_SECONDS .*'{value}'"):
            stall_seconds()
        monkeypatch.setenv("COMPACTML_REGISTRY_LEASE_SECONDS", value)  # what locks.py reads
        with pytest.raises(ValueError, match=f"COMPACTML_REGISTRY_LEASE_SECONDS .*'{value}'"):
            seconds_setting("COMPACTML_REGISTRY_LEASE_SECONDS", 60)
