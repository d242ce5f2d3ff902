"""Test session setup: a private MLflow store, artifact store, DVC remote and Prefect home.

The variables are set before `tasks` is imported, so project.env's defaults (which only fill
what is unset) never point a test at the project's own stores. Prefect runs against one
session-wide `prefect_test_harness`. The data is the real Fashion-MNIST prepared by `make data`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="compactml-tests-"))
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_DIR}/mlruns/mlflow.db"
os.environ["COMPACTML_ARTIFACTS"] = str(_SESSION_DIR / "artifacts")
os.environ["COMPACTML_DVC_REMOTE"] = str(_SESSION_DIR / "dvc-remote")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
(_SESSION_DIR / "mlruns").mkdir()

import tasks  # noqa: E402,F401  (applies project.env for everything not set above)


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
