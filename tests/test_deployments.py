"""prefect.yaml against a real Prefect server on 127.0.0.1: deploy, then run as the UI would."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks import tracking

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
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
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


def _cli(env: dict, *args: str, timeout: int = 300) -> str:
    done = subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_deploy_then_run_from_the_server(server):
    url, env = server
    _cli(env, "work-pool", "create", "local", "--type", "process", "--overwrite")
    _cli(env, "--no-prompt", "deploy", "--all")
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
    schedules = deployments["pipeline-nightly"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * *"]
    assert not schedules[0]["active"]  # retraining is switched on in the UI, not by deploying
    params = {"config": {"profile": "smoke", "model_name": "deployed", "train_limit": 512,
                         "registry": True}}
    _cli(env, "deployment", "run", "train/train", "--params", json.dumps(params))
    _cli(env, "worker", "start", "--pool", "local", "--run-once", timeout=600)
    runs = _api(url, "/flow_runs/filter", {})
    assert [r["state"]["type"] for r in runs] == ["COMPLETED"]
    assert tracking.alias_version("deployed", "champion") == "1"
