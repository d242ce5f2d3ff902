"""Test session setup: a private MLflow store, artifact store, DVC remote and Prefect home.

The variables are set before Prefect or MLflow is imported, so tests never write to the
project's own stores. Prefect runs against one
session-wide `prefect_test_harness`. The data is the real Fashion-MNIST prepared by `make data`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.environment import read_env_file  # Prefect and MLflow are not imported yet

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="compactml-tests-"))
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
# A tracking URI chosen by the user (a test server, say) is honoured; the project's own default
# store is never written by tests. Under pytest-xdist each worker has a store of its own: a
# worker inherits the store its controller chose (marked below), never shares it.
if os.environ.get("MLFLOW_TRACKING_URI") in (None, read_env_file()["MLFLOW_TRACKING_URI"],
                                             os.environ.get("COMPACTML_TEST_SESSION_STORE")):
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_DIR}/mlruns/mlflow.db"
    os.environ["COMPACTML_TEST_SESSION_STORE"] = os.environ["MLFLOW_TRACKING_URI"]
os.environ["COMPACTML_ARTIFACTS"] = str(_SESSION_DIR / "artifacts")
os.environ["COMPACTML_DVC_REMOTE"] = str(_SESSION_DIR / "dvc-remote")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
# The session's stores are its own: experiment and model names without a project prefix
# (tests/test_config_cli.py checks the committed default, compactml).
os.environ["COMPACTML_PROJECT"] = ""
# The registry lock's settle time (1 s) must only exceed a write to the store: milliseconds on
# the session's SQLite file, so every promotion of the suite need not wait a second.
os.environ["COMPACTML_REGISTRY_SETTLE_SECONDS"] = "0.05"
(_SESSION_DIR / "mlruns").mkdir()


# The test files that take longest (servers, subprocesses, deployments), longest first. `make
# test` hands whole files to its workers in collection order (`--dist loadfile
# --no-loadscope-reorder`); these go first, so no long file starts last while the other worker
# has run out of work. Ordered by `pytest --durations=0` at commit 075dc3f.
LONGEST_FIRST = (
    "test_deployments.py", "test_distributed.py", "test_interruption.py", "test_distill_flow.py",
    "test_sparsify_flow.py", "test_registry_lock.py", "test_pbt_flow.py", "test_train_flow.py",
    "test_cascade_flow.py", "test_image_text_flow.py", "test_distill_tasks.py", "test_serve.py",
    "test_pipeline_flow.py", "test_config_cli.py", "test_retention.py")
_renamed = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).is_file()]
assert not _renamed, f"LONGEST_FIRST names test files that are gone: {_renamed}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the others after, as collected."""
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    """One temporary Prefect server and database for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    """The session's scratch folder (stores, remote, Prefect home)."""
    return _SESSION_DIR


@pytest.fixture(scope="session")
def fashion_folder(tmp_path_factory) -> Path:
    """A small ImageFolder made from real Fashion-MNIST images: PNG, JPEG, gray and RGB, sizes
    28 and 36, three classes of 40 images each."""
    from PIL import Image

    from tasks.data import fashion_mnist_root
    from training.datasets import load_fashion_mnist

    source = load_fashion_mnist(fashion_mnist_root(), train=False)
    root = tmp_path_factory.mktemp("folder")
    for cls in (0, 1, 7):
        folder = root / source.classes[cls].replace("/", "-")
        folder.mkdir()
        picks = (source.labels == cls).nonzero().flatten()[:40]
        for n, index in enumerate(picks.tolist()):
            image = Image.fromarray(source.images[index, 0].numpy(), mode="L")
            if n % 3 == 1:
                image = image.convert("RGB").resize((36, 36))
            image.save(folder / f"img{n:03d}.{'jpg' if n % 2 else 'png'}")
    return root


SMOKE_MODEL = "smoke-model"


def smoke(**overrides):
    """A seconds-long `train` config on 1024 Fashion-MNIST images, named SMOKE_MODEL (the smoke
    profile registers nothing unless given `registry=True`)."""
    from tasks.configs.train import TrainConfig

    return TrainConfig(**{"profile": "smoke", "model_name": SMOKE_MODEL, "rounds": 2,
                          "train_limit": 1024, "lr": 0.1, **overrides})


@pytest.fixture(scope="session")
def first_run():
    """The session's first smoke run of the `train` flow (the champion of SMOKE_MODEL)."""
    from flows.train import train

    return train(smoke(registry=True))


def subprocess_env() -> dict[str, str]:
    """The environment of a `python -m flows` subprocess: this session's, with the API of its
    Prefect test harness (so it starts no temporary server of its own)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


@pytest.fixture
def own_store(tmp_path, monkeypatch) -> Path:
    """An artifact store of the test's own (`COMPACTML_ARTIFACTS`, for this process and the
    `python -m flows` subprocesses it starts), so the test reads only what its own runs wrote;
    the session's DVC remote stays shared, and a result another test left in Prefect's cache is
    pulled from it by hash."""
    store = tmp_path / "artifacts"
    monkeypatch.setenv("COMPACTML_ARTIFACTS", str(store))
    return store


def wait_for_file(proc: subprocess.Popen, folder: Path, pattern: str, timeout: float
                  ) -> list[Path]:
    """The files matching `pattern` under `folder` (the test's own store) as soon as one
    appears while `proc` runs; empty if it ends or `timeout` passes first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if found := sorted(folder.rglob(pattern)):
            return found
        time.sleep(0.05)
    return []


def kill_when(args: list[str], ready: Callable[[], object], what: str, timeout: float = 180,
              env: dict[str, str] | None = None) -> object:
    """Runs `python -m flows *args` (in `env`, default `subprocess_env()`) and SIGKILLs it (and
    its children) as soon as `ready()` returns something true; fails if the run ends first or
    `timeout` passes (`what`: what was awaited, for the message). Returns what `ready` gave."""
    proc = subprocess.Popen([sys.executable, "-m", "flows", *args],
                            cwd=Path(__file__).resolve().parents[1],
                            env=env or subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, found = time.time() + timeout, None
    while time.time() < deadline and proc.poll() is None and not found:
        found = ready()
        if not found:
            time.sleep(0.05)
    running = proc.poll() is None
    if running:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert running, "the run ended before it could be killed"
    assert found, f"{what} within {timeout:.0f} s"
    return found


def kill_when_written(args: list[str], folder: Path, pattern: str,
                      timeout: float = 180) -> list[Path]:
    """Runs `python -m flows *args` and SIGKILLs it (and its children) as soon as a file
    matching `pattern` appears under `folder`, a folder of the test's own store (`own_store`:
    no other run writes there) (`kill_when`). Returns the files."""
    return kill_when(args, lambda: sorted(folder.rglob(pattern)),
                     f"no {pattern} appeared under {folder}", timeout)


def assert_whole_after_kill(folder: Path, pattern: str) -> None:
    """No half-written file under a real name after `kill_when_written`: every file matching
    `pattern` (`round-*.pt`) whose pointer exists has the bytes its pointer records, and none
    of our own temporaries (`.round-002.<random>.pt`) is left. A kill during `dvc commit` may
    leave DVC's link-test file (`.<22 characters>.tmp`); the next commit in the folder
    removes it."""
    from tasks.adapters.versioning import data_dvc_hash, md5_of

    assert not list(folder.rglob(f".{pattern}")), "a temporary of ours was left"
    for pointer in folder.rglob(f"{pattern}.dvc"):
        file = pointer.with_suffix("")
        if file.exists():  # (DVC may have been relinking it from its cache)
            assert md5_of(file) == data_dvc_hash(pointer), file


def task_states(flow_state) -> dict[str, str]:
    """Task run name -> state name (`Cached`, `Completed`, ...) of one flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = flow_state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run.state.name for run in runs}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`python -m flows *argv` inside this process (the stack already imported): its exit code
    (0 when the command returns), stdout and stderr. For what happens before any work; a
    subprocess where the whole program's behaviour is the point."""
    from flows.cli import main
    from flows.commands import COMMANDS

    capsys.readouterr()
    try:
        main(COMMANDS, list(argv))
        code = 0
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_mlflow_server(folder: Path, port: int) -> tuple[subprocess.Popen, str]:
    """A real MLflow tracking server on 127.0.0.1:`port` with its SQLite store and artifacts in
    `folder` (the same folder again: the same store), once it answers; and its URI. Stop it
    with `os.killpg(proc.pid, ...)`."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder}/server.db",
         "--default-artifact-root", f"file://{folder}/artifacts"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return proc, uri
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"no MLflow server answered at {uri}") from None
            time.sleep(0.3)
