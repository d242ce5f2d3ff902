"""Recognition by nearest neighbours in an embedding space (the k-NN probe of DINO et al.).

A query gets the label that its k most similar gallery embeddings vote for, each neighbour's
vote weighted by its cosine similarity: score(c) = sum over neighbours n with label c of
cos(query, n). Ties go to the lower class index. No training: the probe measures how well the
embedding alone separates the classes.

Over tables of embeddings (a `label` and an `embedding` column): a gallery read from Parquet
(`read_gallery`), a table recognized against it (`recognize`), and the k-NN accuracy on a test
split against the training split (`split_recognition`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from torch.nn import functional as F

from training.datasets import DataError


def knn_classify(gallery: Tensor, gallery_labels: Tensor, queries: Tensor, k: int,
                 chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """The voted label of each query, and its similarity to its nearest gallery embedding.

    Args:
        gallery: G x D embeddings with known labels.
        gallery_labels: G integer labels (0 .. C-1).
        queries: Q x D embeddings to recognize.
        k: neighbours that vote (at most G).
        chunk: queries compared at once (bounds memory at chunk x G similarities).
    """
    if gallery.ndim != 2 or queries.ndim != 2 or gallery.shape[1] != queries.shape[1]:
        raise ValueError(f"gallery {tuple(gallery.shape)} and queries {tuple(queries.shape)} "
                         "must be N x D with the same D")
    if len(gallery_labels) != len(gallery):
        raise ValueError(f"{len(gallery_labels)} labels for {len(gallery)} gallery embeddings")
    if not 1 <= k <= len(gallery):
        raise ValueError(f"k={k} must be between 1 and the gallery size {len(gallery)}")
    gallery = F.normalize(gallery.float(), dim=1)
    classes = int(gallery_labels.max()) + 1
    labels, nearest = [], []
    for start in range(0, len(queries), chunk):
        similarity = F.normalize(queries[start:start + chunk].float(), dim=1) @ gallery.T
        top, index = similarity.topk(k, dim=1)
        votes = torch.zeros(len(top), classes, dtype=top.dtype, device=top.device)
        votes.scatter_add_(1, gallery_labels[index].long(), top)
        labels.append(votes.argmax(dim=1))  # argmax returns the first maximum: lower class
        nearest.append(top[:, 0])
    return torch.cat(labels), torch.cat(nearest)


def knn_accuracy(gallery: Tensor, gallery_labels: Tensor, queries: Tensor,
                 query_labels: Tensor, k: int) -> float:
    """Fraction of queries whose k-NN vote (see `knn_classify`) is their own label."""
    predicted, _ = knn_classify(gallery, gallery_labels, queries, k)
    return float((predicted == query_labels.to(predicted.device)).float().mean())


EMBEDDING_COLUMN = "embedding"


LABEL_COLUMN = "label"


def folder_labels(root: Path, files: list[Path]) -> list[str | None]:
    """Each file's folder below `root` (its class in an ImageFolder); None for a file at the
    root or for a single file."""
    if root.is_file():
        return [None] * len(files)
    return [f.parent.relative_to(root).as_posix() if f.parent != root else None for f in files]


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
