"""Embeddings of a registered model, and recognition by nearest neighbours.

Every exported program returns the logits and the embedding (the output of the model's last
feature layer, `training.features.WithEmbedding`), so any registered version embeds images:
- `embed_images`: an image file or folder to a table of `path`, `label` (the image's folder
  name under an ImageFolder root, else empty), `predicted_label`, `confidence`, `embedding`,
  saved as Parquet;
- `training.recognition.recognize`: each embedded image gets the label its k nearest
  neighbours in a gallery of labelled embeddings vote for, with the accuracy where labels
  exist;
- `recognition_accuracy`: the k-NN accuracy on a data set's test split with its training
  split as the gallery, beside the classifier's own accuracy on the same images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from prefect import task
from pydantic import Field, field_validator, model_validator

from tasks.adapters import tracking
from tasks.adapters.prediction import ModelVersionSection, existing_path
from tasks.adapters.versioning import atomic_path
from tasks.configs.sections import DataSection
from tasks.data import DatasetRef, load_dataset, split_source
from training.datasets import DataError, readable_images
from training.recognition import EMBEDDING_COLUMN, LABEL_COLUMN, folder_labels, split_recognition


class FeaturesConfig(ModelVersionSection, DataSection):
    """Which model version embeds which images; against which gallery they are recognized.

    The data fields (`--data`, limits, split seed) choose the data set of `--evaluate`.
    """

    images: str | None = Field(None, description="an image file, or a folder searched "
                               "recursively (an ImageFolder's sub-folder names become labels)")
    out: str = Field("embeddings.parquet", description="the Parquet table the embeddings of "
                     "--images are written to")
    gallery: str | None = Field(None, description="a Parquet table of labelled embeddings "
                                "(columns `label` and `embedding`, as this command writes for "
                                "an ImageFolder): --images are recognized against it")
    evaluate: bool = Field(False, description="report the k-NN recognition accuracy on the test "
                           "split of --data, with its training split as the gallery")
    k: int = Field(5, ge=1, le=1000, description="neighbours that vote in a recognition")

    @field_validator("images", "gallery")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        return value if value is None else existing_path(value)

    @model_validator(mode="after")
    def _something_to_do(self) -> FeaturesConfig:
        if self.images is None and not self.evaluate:
            raise ValueError("give --images (to embed), --evaluate (k-NN accuracy), or both")
        if self.gallery is not None and self.images is None:
            raise ValueError("--gallery needs --images to recognize")
        return self


def load_embedder(model_uri: str) -> Any:
    """The registered version's serving model (`serving.classifier.ImageClassifierModel`, or
    a subclass; versions logged before `serving.entry` held it directly).

    Raises:
        DataError: the version is not an image model of this project.
    """
    served = tracking.load_pyfunc(model_uri).unwrap_python_model()
    model = getattr(served, "implementation", served)
    if not callable(getattr(model, "embed", None)):
        raise DataError(f"{model_uri} is a {type(model).__name__}, not an image model of this "
                        "project: it cannot embed images")
    return model


def embed_images(embedder: Any, images: str, skip_bad: bool = False) -> pd.DataFrame:
    """The table of the module docstring for the image file or folder `images`."""
    kept, blobs, _ = readable_images(images, skip_bad)
    table, embeddings = embedder.embed(pd.DataFrame({"image": blobs}))
    table = table.rename(columns={"label": "predicted_label"})
    table.insert(0, "path", [str(p) for p in kept])
    table.insert(1, LABEL_COLUMN, folder_labels(Path(images).expanduser(), kept))
    table[EMBEDDING_COLUMN] = list(embeddings.astype(np.float32))
    return table


def write_table(table: pd.DataFrame, path: Path) -> Path:
    """Writes `table` as Parquet, atomically (a crash leaves no half-written file)."""
    with atomic_path(path) as temporary:
        table.to_parquet(temporary, index=False)
    return path


def recognition_accuracy(embedder: Any, data: DataSection, k: int) -> dict[str, float]:
    """`split_recognition` on the splits every run of `data` sees (`tasks.data.split_source`)."""
    source, splits = split_source(data)
    return split_recognition(embedder, source.images, source.labels, splits, source.classes, k)


@task(task_run_name="recognition-test")
def recognition_test(model_uri: str, dataset: DatasetRef, k: int = 5) -> dict[str, float]:
    """`split_recognition` for a registered version on a flow's prepared data set."""
    data = load_dataset(dataset)
    return split_recognition(load_embedder(model_uri), data.images, data.labels, data.splits,
                             dataset.classes, k)
