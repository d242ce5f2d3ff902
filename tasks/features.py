"""Embeddings of a registered model, and recognition by nearest neighbours.

Every exported program returns the logits and the embedding (the output of the model's last
feature layer, `training.features.WithEmbedding`), so any registered version embeds images:
- `embed_images`: an image file or folder to a table of `path`, `label` (the image's folder
  name under an ImageFolder root, else empty), `predicted_label`, `confidence`, `embedding`,
  saved as Parquet;
- `recognize`: each embedded image gets the label its k nearest neighbours in a gallery of
  labelled embeddings vote for (`training.recognition`), with the accuracy where labels exist;
- `recognition_accuracy`: the k-NN accuracy on a data set's test split with its training
  split as the gallery, beside the classifier's own accuracy on the same images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from prefect import task
from pydantic import Field, field_validator, model_validator

from tasks.adapters import tracking
from tasks.adapters.prediction import ModelVersionSection, existing_path, readable_images
from tasks.adapters.versioning import atomic_path
from tasks.configs.sections import DataSection
from tasks.data import DatasetRef, load_dataset, split_source
from training.datasets import DataError
from training.recognition import knn_accuracy, knn_classify

EMBEDDING_COLUMN = "embedding"
LABEL_COLUMN = "label"


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


def folder_labels(root: Path, files: list[Path]) -> list[str | None]:
    """Each file's folder below `root` (its class in an ImageFolder); None for a file at the
    root or for a single file."""
    if root.is_file():
        return [None] * len(files)
    return [f.parent.relative_to(root).as_posix() if f.parent != root else None for f in files]


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


def read_gallery(path: Path) -> tuple[np.ndarray, list[str]]:
    """The embeddings and labels of a gallery table.

    Raises:
        DataError: the file is not a Parquet table with `label` and `embedding` columns, or a
            row has no label.
    """
    try:
        table = pd.read_parquet(path)
    except Exception as error:
        raise DataError(f"cannot read gallery {path} as a Parquet table: {error}") from None
    missing = [c for c in (LABEL_COLUMN, EMBEDDING_COLUMN) if c not in table.columns]
    if missing:
        raise DataError(f"gallery {path} lacks the column(s) {missing}; it has "
                        f"{list(table.columns)}")
    unlabelled = table[LABEL_COLUMN].isna()
    if unlabelled.any():
        raise DataError(f"gallery {path}: {int(unlabelled.sum())} rows have no label, e.g. "
                        f"row {int(np.flatnonzero(unlabelled)[0])}")
    return np.stack(table[EMBEDDING_COLUMN].to_list()), table[LABEL_COLUMN].astype(str).tolist()


def recognize(table: pd.DataFrame, gallery: np.ndarray, gallery_labels: list[str], k: int
              ) -> tuple[pd.DataFrame, float | None]:
    """`table` with `recognized_label` and `similarity` (to the nearest gallery embedding),
    and the recognition accuracy when every row of `table` has a label (else None)."""
    if gallery.shape[1] != len(table[EMBEDDING_COLUMN].iloc[0]):
        raise DataError(f"the gallery's embeddings have {gallery.shape[1]} values, this model's "
                        f"{len(table[EMBEDDING_COLUMN].iloc[0])}: embed the gallery with the "
                        "same model")
    names = sorted(set(gallery_labels))
    index = {name: i for i, name in enumerate(names)}
    predicted, similarity = knn_classify(
        torch.from_numpy(gallery), torch.tensor([index[n] for n in gallery_labels]),
        torch.from_numpy(np.stack(table[EMBEDDING_COLUMN].to_list())), min(k, len(gallery)))
    table = table.assign(recognized_label=[names[i] for i in predicted.tolist()],
                         similarity=similarity.tolist())
    labelled = table[LABEL_COLUMN].notna().all()
    accuracy = float((table[LABEL_COLUMN] == table["recognized_label"]).mean()) \
        if labelled else None
    return table, accuracy


def _as_pixels(images: torch.Tensor) -> np.ndarray:
    """uint8 N x C x H x W to what the serving model takes: N x H x W (gray) or N x H x W x C."""
    pixels = images.permute(0, 2, 3, 1).numpy()
    return pixels[..., 0] if pixels.shape[3] == 1 else pixels


def split_recognition(embedder: Any, images: torch.Tensor, labels: torch.Tensor,
                      splits: dict[str, torch.Tensor], classes: list[str], k: int
                      ) -> dict[str, float]:
    """k-NN accuracy on the test split against the training split, and the classifier's."""
    embedded = {}
    for split in ("train", "test"):
        index = splits[split]
        table, vectors = embedder.embed(_as_pixels(images[index]))
        embedded[split] = (torch.from_numpy(vectors), labels[index], table)
    gallery, gallery_labels, _ = embedded["train"]
    queries, query_labels, table = embedded["test"]
    truth = [classes[i] for i in query_labels.tolist()]
    return {"knn_accuracy": knn_accuracy(gallery, gallery_labels, queries, query_labels,
                                         min(k, len(gallery))),
            "classifier_accuracy": float(np.mean(table["label"].to_numpy() == np.array(truth))),
            "gallery_images": float(len(gallery)), "test_images": float(len(queries))}


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
