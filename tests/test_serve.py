"""`mlflow models serve -m models:/NAME@champion` answers raw-image requests (a real server)."""

import base64
import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.adapters import tracking
from tasks.data import fashion_mnist_root
from tests.conftest import SMOKE_MODEL
from training.datasets import load_fashion_mnist

MLFLOW = Path(sys.executable).with_name("mlflow")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(first_run, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = subprocess.Popen(
        [str(MLFLOW), "models", "serve", "-m", f"models:/{SMOKE_MODEL}@champion",
         "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PATH": f"{MLFLOW.parent}{os.pathsep}{os.environ['PATH']}"},
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"))  # noqa: SIM115 (closed by the OS)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow models serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("mlflow models serve did not answer /ping within 120 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_served_champion_answers_like_the_loaded_model(server, first_run):
    test = load_fashion_mnist(fashion_mnist_root(), train=False)
    pixels = test.images[:512, 0].numpy()  # enough that chance cannot pass for learning
    encoded = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode())
    by_png = post(f"{server}/invocations",
                  {"dataframe_split": {"columns": ["image"], "data": [[e] for e in encoded]}})
    by_array = post(f"{server}/invocations", {"inputs": pixels.tolist()})
    rows = by_png["predictions"]
    assert len(rows) == 512 and rows == by_array["predictions"]
    local = tracking.load_pyfunc(f"models:/{SMOKE_MODEL}@champion").predict(pixels)
    assert [row["label"] for row in rows] == local["label"].tolist()
    assert [row["confidence"] for row in rows] == pytest.approx(local["confidence"].tolist())
    accuracy = np.mean([row["label"] == test.classes[y] for row, y in
                        zip(rows, test.labels[:512].tolist(), strict=True)])
    # the smoke champion is weak (about 0.3 after 32 steps) but far above chance (0.1): on
    # 512 images a standard error is 0.02, so 0.2 is five of them below it
    assert accuracy > 0.2


def test_a_bad_payload_gets_its_cause_in_the_response(server):
    import urllib.error

    payload = {"dataframe_split": {"columns": ["image"], "data": [["not base64!"]]}}
    with pytest.raises(urllib.error.HTTPError) as answer:
        post(f"{server}/invocations", payload)
    assert answer.value.code == 400
    body = json.loads(answer.value.read())
    assert body["error_code"] == "INVALID_PARAMETER_VALUE"
    assert "row 0 of column 'image' is text but not base64 image bytes" in body["message"]


def test_a_registered_model_loads_with_only_serving_models_and_training(first_run, tmp_path):
    """The registered model's code is `serving/`, `models/` and `training/`: it loads and
    answers in a process where tasks/, flows/, Prefect and DVC cannot be imported."""
    from tests.conftest import subprocess_env

    blocked = ["dvc", "flows", "prefect", "tasks"]
    uri = first_run.registration.version_uri
    pixels = load_fashion_mnist(fashion_mnist_root(), train=False).images[:64, 0].numpy()
    np.save(tmp_path / "pixels.npy", pixels)
    code = "\n".join([
        "import importlib.abc, json, sys",
        "class Blocked(importlib.abc.MetaPathFinder):",
        "    def find_spec(self, name, path, target=None):",
        f"        if name.split('.')[0] in {blocked!r}:",
        "            raise ImportError(f'{name} is not part of a served model')",
        "sys.meta_path.insert(0, Blocked())",
        "import numpy as np, mlflow.pyfunc",
        f"out = mlflow.pyfunc.load_model({uri!r}).predict(np.load('pixels.npy'))",
        "print(json.dumps({'labels': out['label'].tolist(), 'modules': sorted(",
        f"    {{m.split('.')[0] for m in sys.modules}} & {set(blocked)!r})}}))"])
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served["modules"] == []
    assert served["labels"] == tracking.load_pyfunc(uri).predict(pixels)["label"].tolist()


def _lines(stream) -> queue.Queue:
    """The lines of `stream`, read in a thread (a test can wait for one with a timeout)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue, prefix: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line.strip()
    pytest.fail(f"no line starting {prefix!r} within {timeout:.0f} s")


def _answer(url: str, deadline: float) -> list:
    """The server's predictions for two blank images, once it answers."""
    while True:
        try:
            return post(f"{url}/invocations",
                        {"inputs": np.zeros((2, 28, 28), dtype=np.uint8).tolist()})[
                "predictions"]
        except urllib.error.HTTPError:
            raise  # the server answered: a refusal is the test's failure, not a wait
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_serve_follows_the_champion_alias_to_a_new_version(first_run):
    name = "follow-the-champion"
    source = f"models:/{SMOKE_MODEL}/1"
    first = tracking.register_version(source, name, first_run.run_id, {})
    second = tracking.register_version(source, name, first_run.run_id, {})
    tracking.set_alias(name, "champion", first)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows", "serve", name, "--port", str(port), "--poll-seconds",
         "0.5"], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        lines = _lines(proc.stdout)
        assert _wait_for(lines, "serving ") == (f"serving models:/{name}/{first} (champion) on "
                                                f"{url}")
        assert len(_answer(url, time.time() + 120)) == 2
        tracking.set_alias(name, "champion", second)  # the registry crowns another version
        assert _wait_for(lines, "serving ") == (
            f"serving models:/{name}/{second} (champion, was version {first}) on {url}")
        assert len(_answer(url, time.time() + 120)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        with pytest.raises(OSError):  # the scoring server went with it
            urllib.request.urlopen(f"{url}/ping", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
