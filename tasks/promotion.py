"""Promotion on the data set's test images (a task and what it needs from the data): the
test split as raw images, the images a registered version trained or was chosen on
(`training.promotion.Seen`, read from the data set its tags record), the test images neither
model saw (`unseen_test_split`), and the register-and-promote task that scores a classifier's
pyfunc on them through `tasks.adapters.registration.promote` (MLflow calls, the lock, the
decision).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks.adapters.registration import (
    Policy,
    Registration,
    log_served_model,
    promote,
    pyfunc_correct,
    served_ms_per_image,
    transient,
)
from tasks.adapters.versioning import ArtifactRef, ArtifactStore
from tasks.data import DatasetRef, load_dataset, load_dataset_artifact
from training.datasets import ImageSet, LoadedDataset
from training.promotion import Comparison, Correct, Scorer, Seen


def raw_images(data: LoadedDataset | ImageSet, index: Any) -> np.ndarray:
    """Images at `index` (of a prepared data set or a source) as raw uint8 (N x H x W, or
    N x H x W x C), as a user sends them."""
    images = data.images[index].permute(0, 2, 3, 1).numpy()
    return images[:, :, :, 0] if images.shape[3] == 1 else images


def test_images(dataset: DatasetRef) -> tuple[np.ndarray, list[str]]:
    """The test split as raw uint8 images (N x H x W, or N x H x W x C) and label names."""
    data = load_dataset(dataset)
    index = data.splits["test"]
    return raw_images(data, index), [dataset.classes[i] for i in data.labels[index].tolist()]


def seen_by(tags: dict[str, str]) -> Seen | None:
    """The images a registered version trained or was chosen on, read from the data set its
    tags record (`dataset.ref`); None when it records none (registered before data sets
    recorded their keys)."""
    recorded = tags.get("dataset.ref")
    if recorded is None:
        return None
    data = load_dataset_artifact(ArtifactRef.model_validate_json(recorded))
    return Seen.of(data) if data.keys else None


def unseen_test_split(dataset: DatasetRef, champion_tags: dict[str, str]
                      ) -> tuple[tuple[np.ndarray, list[str]] | None, Comparison]:
    """The test images that neither this run's model nor the champion trained or was chosen
    on, known by path or by content (as raw images and label names; None when there are
    none), and a note for the decision saying how many and why."""
    data = load_dataset(dataset)
    index = data.splits["test"].tolist()
    seen = seen_by(champion_tags)
    if seen is None or not data.keys:
        return test_images(dataset), Comparison(
            images=len(index), left_out=0,
            note=f"on the {len(index)} test images (the champion records no training images "
                 "to leave out)")
    seen |= Seen.of(data)
    unseen = [i for i in index
              if not seen.saw(data.keys[i], data.contents[i] if data.contents else None)]
    left_out = len(index) - len(unseen)
    note = (f"on the {len(unseen)} test images neither model trained or was chosen on"
            + (f" ({left_out} of the test split left out: the champion saw them, by path or "
               "by content)" if left_out else " (the whole test split)"))
    if not unseen:
        return None, Comparison(images=0, left_out=left_out, note=note)
    labels = [dataset.classes[i] for i in data.labels[unseen].tolist()]
    return (raw_images(data, unseen), labels), Comparison(images=len(unseen),
                                                          left_out=left_out, note=note)


@task(task_run_name="register-and-promote", retries=2, retry_delay_seconds=10,
      retry_condition_fn=lambda _task, _run, state: transient(state))
def register_and_promote(run_id: str, name: str, dataset: DatasetRef, program: ArtifactRef,
                         policy: Policy, refusal: str | None = None,
                         tags: dict[str, str] | None = None) -> Registration:
    """Logs the pyfunc, scores it and the champion on the test split, registers (tagged with
    `tags`), sets alias.

    With a `refusal` (the baseline gate's, `Baseline.refusal`) it is registered as a
    challenger only."""
    store = ArtifactStore()
    meta = {"classes": dataset.classes, "image_size": dataset.image_size,
            "channels": dataset.channels, "mean": dataset.mean, "std": dataset.std}
    with tempfile.TemporaryDirectory() as folder:
        meta_path = Path(folder) / "meta.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        model_uri = log_served_model(run_id, "classifier", {
            "program": str(store.fetch(program)), "meta": str(meta_path)})
    return promote_on_test_images(run_id, name, model_uri, dataset, program.md5, policy,
                                  refusal, tags)


def promote_on_test_images(run_id: str, name: str, model_uri: str, dataset: DatasetRef,
                           program_md5: str, policy: Policy, refusal: str | None,
                           tags: dict[str, str] | None = None) -> Registration:
    """`promote` for a classifier's pyfunc: scored by its accuracy on the data set's test
    split, timed on its images (read once, and only if something is scored), and compared
    with the champion (or each registered version) on the test images neither trained or was
    chosen on (`unseen_test_split`: by path and by content). The version is tagged with the
    data set (`dataset`: its hash; `dataset.ref`: the artifact, so that a later run can leave
    out the images this one saw) and `tags`."""
    split = functools.cache(lambda: test_images(dataset))

    @functools.cache
    def whole_split(uri: str) -> Correct:
        return pyfunc_correct(uri, *split())

    def compare(other_tags: dict[str, str]) -> tuple[Scorer | None, Comparison]:
        images, comparison = unseen_test_split(dataset, other_tags)
        if images is None:
            return None, comparison
        if comparison.left_out == 0:  # the whole split: the new model's evidence stands
            return whole_split, comparison
        return lambda uri: pyfunc_correct(uri, *images), comparison

    return promote(run_id, name, model_uri, whole_split,
                   dataset.classes, program_md5, {"dataset": dataset.artifact.md5,
                                                  "dataset.ref": dataset.artifact.model_dump_json()}
                   | (tags or {}), policy, refusal,
                   timer=lambda uri: served_ms_per_image(uri, split()[0]), compare=compare)
