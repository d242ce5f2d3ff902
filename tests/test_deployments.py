"""prefect.yaml against a real Prefect server on 127.0.0.1: deploy, then run as the UI would."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks.adapters import tracking

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(url: str, path: str, body: dict | None = None) -> object:
    request = urllib.request.Request(f"{url}{path}", method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           # the UI's pages call this API (by default the standard port's)
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            _api(url, "/health")
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail((home / "server.log").read_text()[-2000:])
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the Prefect server did not start within 120 s")
    client_env = {**env, "PREFECT_API_URL": url}
    yield url, client_env
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _wait_for(url: str, proc: subprocess.Popen, log: Path, seconds: float = 120) -> None:
    """Waits until `url` answers, failing with the log's tail if `proc` dies or time runs out."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            if proc.poll() is not None:
                pytest.fail(log.read_text()[-2000:])
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"{url} did not answer within {seconds:.0f} s")


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory):
    """MLflow's UI and API on 127.0.0.1, on the tests' tracking store."""
    folder = tmp_path_factory.mktemp("mlflow-ui")
    port = _free_port()
    log = open(folder / "server.log", "wb")  # noqa: SIM115 (closed below)
    uri = os.environ["MLFLOW_TRACKING_URI"]
    # artifacts as the project keeps them, not behind the server (`mlflow-artifacts:/`): a
    # server that creates the store's Default experiment first would send every client's
    # models there (`make ui` does the same)
    root = Path(uri.removeprefix("sqlite:///")).parent / "artifacts"
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server",
                             "--backend-store-uri", uri, "--default-artifact-root",
                             root.resolve().as_uri(), "--host", "127.0.0.1", "--port",
                             str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_for(url, proc, folder / "server.log")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _page(url: str) -> str:
    """The page at `url` as a person's browser renders it (headless Chromium with a profile of
    its own, its scripts run for up to 20 s of virtual time), as HTML."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "headless Chromium is missing: `make test` installs Debian's chromium"
    with tempfile.TemporaryDirectory() as profile:  # a profile each: browsers run at once
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                               f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                               "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _cli(env: dict, *args: str, timeout: int = 300, cwd: Path = ROOT) -> str:
    done = subprocess.run([PREFECT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def deployed(server):
    """prefect.yaml deployed to the server, with the process work pool it names."""
    url, env = server
    _cli(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    # the repository a worker clones: this checkout (`make deploy`: the git remote `origin`)
    _cli({**env, "COMPACTML_REPOSITORY": str(ROOT)}, "--no-prompt", "deploy", "--all")
    return url, env


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def _run_deployment(url: str, env: dict, name: str, params: dict, folder: Path) -> dict:
    """Starts a run of deployment `name` as the UI's Run button does, lets a process worker
    started in `folder` (not the project) run it, and returns the flow run."""
    deployment = _api(url, f"/deployments/name/{name}")
    created = _api(url, f"/deployments/{deployment['id']}/create_flow_run",
                   {"parameters": params})  # the server checks them against the schema
    # what `make worker` sets: the data and stores stay with the worker's project
    _cli({**env, "COMPACTML_DATA_DIR": str(ROOT / "data")}, "worker", "start", "--pool", "local",
         "--run-once", timeout=600, cwd=folder)
    return _api(url, f"/flow_runs/{created['id']}")


def test_deploy_registers_every_deployment_of_prefect_yaml(deployed):
    url, env = deployed
    deployments = {d["name"]: d for d in _api(url, "/deployments/filter", {})}
    assert set(deployments) == {"train", "pipeline", "pipeline-nightly", "distill", "pbt",
                                "sparsify", "sparsify-detection", "sparsify-contour", "cascade",
                                "image_text"}
    assert deployments["sparsify"]["parameters"] == {"config": {"profile": "quick"}}
    assert deployments["sparsify-contour"]["parameters"] == {
        "config": {"profile": "quick", "task": "contour"}}
    assert deployments["distill"]["parameters"] == {"config": {"profile": "quick"}}
    assert deployments["train"]["parameters"] == {"config": {"profile": "quick"}}
    assert deployments["pipeline-nightly"]["entrypoint"] == "flows/pipeline.py:pipeline"
    for deployment in deployments.values():  # one run at a time; the next one waits
        assert deployment["global_concurrency_limit"]["limit"] == 1, deployment["name"]
        assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    for deployment in deployments.values():  # each runs the commit deployed, cloned anew
        assert deployment["pull_steps"] == [{"prefect.deployments.steps.git_clone": {
            "repository": str(ROOT), "commit_sha": _head()}}], deployment["name"]
    schedules = deployments["pipeline-nightly"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * *"]
    assert not schedules[0]["active"]  # retraining is switched on in the UI, not by deploying
    # running a deployment through a process worker: the nightly pipeline's test below


def test_the_nightly_pipeline_runs_from_a_worker_elsewhere_and_retrains_on_new_data(
        deployed, mlflow_ui, fashion_folder, tmp_path):
    """The scheduled deployment's run, triggered twice from a worker outside the project: it
    trains and registers; after a user adds images it retrains and registers again. Then the
    pages a user opens show it: the flow run in Prefect's UI, the run and the registered
    versions in MLflow's."""
    import shutil

    from mlflow import MlflowClient

    url, env = deployed
    folder = tmp_path / "shop"
    shutil.copytree(fashion_folder, folder)
    # nested as the flow's parameter schema (and the UI's form) has it
    params = {"config": {"profile": "smoke", "dataset": {"data": str(folder)},
                         "run": {"model_name": "nightly", "registry": True}}}
    client = MlflowClient()

    flow_runs = []
    elsewhere = tmp_path / "worker"  # a worker outside the project folder
    elsewhere.mkdir()

    def nightly():
        """The pipeline's MLflow run of one triggered nightly run (completed)."""
        run = _run_deployment(url, env, "pipeline/pipeline-nightly", params, elsewhere)
        assert run["state"]["type"] == "COMPLETED", run["state"].get("message")
        flow_runs.append(run)
        found = client.search_runs(
            [client.get_experiment_by_name("pipeline").experiment_id],
            f"tags.`prefect.flow_run_id` = '{run['id']}'")
        assert len(found) == 1
        return found[0]

    first = nightly()
    assert tracking.alias_version("nightly", "champion") == "1"
    # the run executed the deployed commit, cloned by the pull step (not this work tree, which
    # may hold changes: then its commit tag would end in -dirty), and wrote nothing into it
    assert first.data.tags["git.commit"] == _head()
    logs = _api(url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_runs[0]["id"]]}}})
    assert any("git_clone" in log["message"] for log in logs)
    assert not list(elsewhere.iterdir())  # the clone was the run's temporary folder
    # no descriptions given: the image-text step is skipped and the run says why
    assert first.data.tags["pipeline.image_text"].startswith("skipped: the run has no "
                                                             "descriptions")
    assert "step_sparsify_test_accuracy" in first.data.metrics
    # (the same images again train nothing: tests/test_pipeline_flow.py, in process)
    from PIL import Image, ImageOps

    for source in sorted(folder.iterdir()):  # the user adds new images to every class
        for n, image in enumerate(sorted(source.iterdir())[:5]):
            with Image.open(image) as original:  # new pictures, not copies of old ones
                ImageOps.mirror(original).save(source / f"added{n}{image.suffix}")
    second = nightly()
    assert second.data.tags["pipeline.key"] != first.data.tags["pipeline.key"]
    assert "step_sparsify_test_accuracy" in second.data.metrics
    assert second.data.tags["registry.version"] == "2"
    # each version's recorded data set: the grown folder kept every old test image in test,
    # and the two versions were compared on test images neither trained or was chosen on
    from tasks.adapters.versioning import ArtifactRef
    from tasks.data import load_dataset_artifact

    def keys(version: str, *splits: str) -> set[str]:
        data = load_dataset_artifact(ArtifactRef.model_validate_json(
            tracking.version_tags("nightly", version)["dataset.ref"]))
        return {data.keys[i] for split in splits for i in data.splits[split].tolist()}

    assert keys("1", "test") <= keys("2", "test")
    assert not keys("2", "test") & (keys("1", "train", "val") | keys("2", "train", "val"))
    assert second.data.tags["registry.compared_images"] == str(len(keys("2", "test")))
    assert "test images neither model trained" in second.data.tags["registry.decision"]
    from tasks.adapters.versioning import ArtifactStore, md5_of

    for name in ("dataset", "program.sparsify", "program.teacher"):  # versioned in DVC
        ref = tracking.artifact_refs(second.info.run_id)[name]
        path = ArtifactStore().path_of(ref["path"])
        assert md5_of(path) == ref["md5"] and path.with_name(path.name + ".dvc").exists()

    experiment = second.info.experiment_id
    with ThreadPoolExecutor(3) as browsers:  # three headless Chromiums at once
        prefect_page, models_page, run_page = browsers.map(_page, [
            f"{url.removesuffix('/api')}/runs/flow-run/{flow_runs[-1]['id']}",
            f"{mlflow_ui}/#/models/nightly",
            f"{mlflow_ui}/#/experiments/{experiment}/runs/{second.info.run_id}"])
    assert flow_runs[-1]["name"] in prefect_page and "Completed" in prefect_page
    assert "Version 2" in models_page and "Version 1" in models_page
    assert second.info.run_name in run_page and "step_sparsify_test_accuracy" in run_page
    assert "Logged models (1)" in run_page  # its model, linked to the run
