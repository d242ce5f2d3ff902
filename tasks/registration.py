"""Registration: the final model as an MLflow pyfunc, promoted only if it beats the champion.

Both the new model and the current champion are scored through their pyfunc (raw uint8 images
in, labels out) on the same test split in the same run, so the comparison is on the same images
and also proves that the served model works end to end. Each model's own network and
preprocessing settings come from its stored files; the Python preprocessing code is the one
installed in this process.

A model identical to a registered version (same exported program) is not registered again, so
a re-run or a retried task never adds a duplicate version. A champion trained on other classes
is not compared (its labels could never match): the new model stays a challenger and the
decision says to choose another `--model-name`.
"""

from __future__ import annotations

import json
import tempfile
from importlib.metadata import version as package_version
from pathlib import Path

import numpy as np
from mlflow.exceptions import MlflowException
from prefect import task
from pydantic import BaseModel, ConfigDict

from tasks import tracking
from tasks.data import DatasetRef, load_dataset
from tasks.environment import PROJECT_ROOT
from tasks.versioning import ArtifactRef, ArtifactStore

CHAMPION, CHALLENGER = "champion", "challenger"
SERVING_PACKAGES = ("torch", "torchvision", "mlflow", "pillow", "pandas", "numpy")


class Registration(BaseModel):
    """The outcome of registering a model version and deciding its alias."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: str
    alias: str
    accuracy: float
    champion_version: str | None
    champion_accuracy: float | None
    decision: str


def pip_requirements() -> list[str]:
    """Exact pins of what the served model imports (torch without its local build tag)."""
    return [f"{name}=={package_version(name).split('+')[0]}" for name in SERVING_PACKAGES]


def test_images(dataset: DatasetRef) -> tuple[np.ndarray, list[str]]:
    """The test split as raw uint8 images (N x H x W, or N x H x W x C) and label names."""
    data = load_dataset(dataset)
    index = data.splits["test"]
    images = data.images[index].permute(0, 2, 3, 1).numpy()
    if images.shape[3] == 1:
        images = images[:, :, :, 0]
    return images, [dataset.classes[i] for i in data.labels[index].tolist()]


def pyfunc_accuracy(model_uri: str, images: np.ndarray, labels: list[str]) -> float:
    """Fraction of `images` that the pyfunc at `model_uri` labels correctly."""
    predicted = tracking.load_pyfunc(model_uri).predict(images)["label"].tolist()
    return float(np.mean([p == t for p, t in zip(predicted, labels, strict=True)]))


def _transient(state) -> bool:
    """Retry only when the tracking server or the file system failed, not on a logic error."""
    try:
        state.result()
    except (OSError, TimeoutError, ConnectionError):
        return True
    except MlflowException as error:
        return error.error_code in ("TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR")
    except Exception:
        return False
    return False


class Baseline(BaseModel):
    """A reference a model must beat on validation to become champion: the stronger raw-pixel
    baseline (`training.baselines`), and the model's own validation accuracy."""

    model_config = ConfigDict(frozen=True)

    name: str
    val_accuracy: float
    model_val_accuracy: float

    @property
    def beaten(self) -> bool:
        return self.model_val_accuracy > self.val_accuracy

    def refusal(self) -> str:
        return (f"below the raw-pixel {self.name} baseline on validation "
                f"({self.model_val_accuracy:.4f} <= {self.val_accuracy:.4f}): registered, "
                "never champion; train longer (--min-steps) or pick another model")


def decide(accuracy: float, champion_accuracy: float | None) -> tuple[str, str]:
    """Champion only when strictly better than the current one (or when there is none)."""
    if champion_accuracy is None:
        return CHAMPION, "no champion yet"
    if accuracy > champion_accuracy:
        return CHAMPION, f"beats the champion: {accuracy:.4f} > {champion_accuracy:.4f}"
    return CHALLENGER, f"does not beat the champion: {accuracy:.4f} <= {champion_accuracy:.4f}"


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: _transient(state))
def register_and_promote(run_id: str, name: str, dataset: DatasetRef,
                         program: ArtifactRef, baseline: Baseline | None = None) -> Registration:
    """Logs the pyfunc, scores it and the champion on the test split, registers, sets alias.

    A model that does not beat `baseline` on validation is registered as a challenger."""
    store = ArtifactStore()
    meta = {"classes": dataset.classes, "image_size": dataset.image_size,
            "channels": dataset.channels, "mean": dataset.mean, "std": dataset.std}
    with tempfile.TemporaryDirectory() as folder:
        meta_path = Path(folder) / "meta.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        model_uri = tracking.log_pyfunc_model(
            run_id, str(PROJECT_ROOT / "tasks" / "pyfunc_model.py"),
            artifacts={"program": str(store.fetch(program)), "meta": str(meta_path)},
            pip_requirements=pip_requirements(),
            code_paths=[str(PROJECT_ROOT / "tasks"), str(PROJECT_ROOT / "training")])
    images, labels = test_images(dataset)
    accuracy = pyfunc_accuracy(model_uri, images, labels)
    champion_version = tracking.alias_version(name, CHAMPION)
    champion_accuracy, refusal = None, None
    if champion_version is not None:
        champion_classes = tracking.version_tags(name, champion_version).get("classes")
        if champion_classes is not None and champion_classes != json.dumps(dataset.classes):
            refusal = (f"the champion (version {champion_version}) was trained on other "
                       "classes; register this data set's models under another --model-name")
        else:
            try:
                champion_accuracy = pyfunc_accuracy(f"models:/{name}/{champion_version}",
                                                    images, labels)
            except Exception as error:  # an old champion that no longer loads or predicts
                refusal = (f"the champion (version {champion_version}) could not be scored: "
                           f"{error}")
    if baseline is not None and not baseline.beaten:
        refusal = baseline.refusal()
    if refusal:  # never replace a champion on a comparison that did not happen
        alias, decision = CHALLENGER, refusal
    else:
        alias, decision = decide(accuracy, champion_accuracy)
    version = tracking.find_version(name, "program", program.md5)
    if version is None:
        version = tracking.register_model(model_uri, name, run_id, {
            "test_accuracy": f"{accuracy:.6f}", "dataset": dataset.artifact.md5,
            "program": program.md5, "classes": json.dumps(dataset.classes)})
    elif version == champion_version:
        alias, decision = CHAMPION, f"same model as the champion (version {version})"
    tracking.set_alias(name, alias, version)
    tracking.set_tags(run_id, {"registry.model": name, "registry.version": version,
                               "registry.alias": alias, "registry.decision": decision,
                               "registry.champion_version": champion_version or "none"})
    tracking.log_metrics(run_id, {"registry_test_accuracy": accuracy}
                         | ({"champion_test_accuracy": champion_accuracy}
                            if champion_accuracy is not None else {}))
    return Registration(name=name, version=version, alias=alias, accuracy=accuracy,
                        champion_version=champion_version, champion_accuracy=champion_accuracy,
                        decision=decision)
