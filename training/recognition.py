"""Recognition by nearest neighbours in an embedding space (the k-NN probe of DINO et al.).

A query gets the label that its k most similar gallery embeddings vote for, each neighbour's
vote weighted by its cosine similarity: score(c) = sum over neighbours n with label c of
cos(query, n). Ties go to the lower class index. No training: the probe measures how well the
embedding alone separates the classes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


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
