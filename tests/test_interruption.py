"""An interrupted run stops: SIGTERM or Ctrl-C ends a flow's training loops within a batch,
marks its MLflow run KILLED and leaves no process behind (the temporary Prefect server its
command started included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from tasks.adapters import tracking
from tests.conftest import (
    assert_whole_after_kill,
    free_port,
    start_mlflow_server,
    subprocess_env,
    wait_for_file,
)
from training.stopping import StopRequested, check_stop, stop_requested


def test_ctrl_c_inside_a_run_marks_it_killed_and_stops_the_loops_until_the_next_run():
    with pytest.raises(KeyboardInterrupt), \
            tracking.tracked_run("interruption", "ctrl-c") as run_id:
        raise KeyboardInterrupt
    assert tracking.client().get_run(run_id).info.status == "KILLED"
    assert stop_requested()
    with pytest.raises(StopRequested):
        check_stop()  # what every batch of a training loop in this process now meets
    with pytest.raises(ValueError), tracking.tracked_run("interruption", "error") as failed:
        assert not stop_requested()  # a new run: the loops may train again
        raise ValueError("a plain error")
    assert tracking.client().get_run(failed).info.status == "FAILED"


def test_sigterm_stops_a_run_its_threads_and_its_temporary_prefect_server(own_store):
    """The command line without PREFECT_API_URL, as a user runs it: the run starts its own
    Prefect server, trains its rounds in a task runner's thread, and gets SIGTERM in its
    second round."""
    checkpoints = own_store / "checkpoints" / "train"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows", "train", "--profile", "smoke", "--rounds", "3",
         "--train-limit", "1024", "--min-steps", "300", "--seed", "23", "--model-name",
         "interrupted"],
        cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_file(proc, checkpoints, "round-001.pt", 240)
        assert proc.poll() is None, "the run ended before it could be stopped"
        family = [proc, *psutil.Process(proc.pid).children(recursive=True)]
        assert any("uvicorn" in " ".join(p.cmdline()) for p in family[1:]), \
            "the command started no temporary Prefect server"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # a hang guard, not a timing
        psutil.wait_procs(family[1:], timeout=10)
        assert not [p for p in family[1:] if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE], "a process was left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    [run] = tracking.client().search_runs(
        [e.experiment_id for e in tracking.client().search_experiments()],
        "attributes.run_name = 'train-cnn2-seed23'", ViewType.ACTIVE_ONLY)
    assert run.info.status == "KILLED"
    assert_whole_after_kill(checkpoints, "round-*.pt")  # no half-written round


def test_the_mlflow_server_going_away_ends_the_run_with_a_clear_error_and_the_rerun_resumes(
        tmp_path, own_store):
    port = free_port()
    server, uri = start_mlflow_server(tmp_path, port)
    checkpoints = own_store / "checkpoints" / "train"
    args = [sys.executable, "-m", "flows", "train", "--profile", "smoke", "--rounds", "2",
            "--train-limit", "512", "--min-steps", "200", "--seed", "31", "--model-name",
            "server-away"]
    # MLflow's own retries off, so the test need not wait out its backoff (minutes by default)
    env = subprocess_env() | {"MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                              "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_file(proc, checkpoints, "round-001.pt", 180)
        assert proc.poll() is None, "the run ended before the server went away"
        os.killpg(server.pid, signal.SIGKILL)  # the server goes away mid-run
        server.wait()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the MLflow tracking server at {uri} did not answer"), last
    [first_round] = checkpoints.rglob("round-001.pt")
    written = first_round.stat().st_mtime_ns
    # the server back on its store: the same command resumes from the finished round
    server, uri = start_mlflow_server(tmp_path, port)
    try:
        again = subprocess.run(args, cwd=Path(__file__).resolve().parents[1], env=env,
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert first_round.stat().st_mtime_ns == written  # round 1 came from the cache
        runs = MlflowClient(uri).search_runs(
            [e.experiment_id for e in MlflowClient(uri).search_experiments()],
            "attributes.status = 'FINISHED'")
        assert [run.info.run_name for run in runs] == ["train-cnn2-seed31"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
