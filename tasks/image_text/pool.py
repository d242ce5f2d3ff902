"""Descriptions by matching: a pool of image-text pairs "from the web", and the training
images matched against it (`training.image_text.matching`); a match gives the pool item's texts to
the training image.

The project's own pool (Fashion-MNIST): transformed copies (resized, shifted, flipped,
recompressed) of a share of the training images, whose true matches are known, among as many
copies of Fashion-MNIST training images the run does not use (distractors); each item carries
its source image's own descriptions. In a few-label run (`labels_per_class`) it holds only
the unused images' copies: a pool made from the run's own images would hand an unlabelled
image texts derived from its label. A user's pool is a folder of images with a
`captions.csv` (image, text, weight) naming them (`training.image_text.matching.folder_pool`).
The pool is a versioned Parquet table
(image bytes, texts, weights, the source image where known).
"""

from __future__ import annotations

import pandas as pd
import torch

from tasks.configs.sections import FASHION_MNIST
from tasks.data import DatasetRef, fashion_mnist_root
from training.datasets import LoadedDataset, load_fashion_mnist
from training.image_text.descriptions import DescriptionError, own_captions
from training.image_text.matching import (
    NO_MATCH,
    png_bytes,
    to_pil,
    transformed_copy,
)


def own_pool(data: LoadedDataset, dataset: DatasetRef, classes: pd.DataFrame, share: float,
             distractors: int, per_image: int, phrases: bool, seed: int,
             train_copies: bool = True) -> pd.DataFrame:
    """The project's pool: copies of `share` of the training images (`source` = their
    position) among `distractors` copies of unused Fashion-MNIST training images (`source`
    = -1). One row per (item, text): item, image (PNG bytes), text, weight, source.

    Without `train_copies` (a few-label run) the pool holds no copy of a training image, only
    the unused images' copies: every item's texts come from an image outside the run, so a
    match never hands an unlabelled image text derived from its own label. The unused images
    are Fashion-MNIST training images outside the run's train, validation and test splits
    (with every training image in use, the pool is empty and the captioner describes all)."""
    if dataset.source != FASHION_MNIST:
        raise DescriptionError("the project's own pool is made from Fashion-MNIST: give "
                               "--pool with a folder of images and its captions.csv")
    generator = torch.Generator().manual_seed(seed + 23)
    train = data.splits["train"]
    copies = round(share * len(train)) if train_copies else 0
    picked = train[torch.randperm(len(train), generator=generator)[:copies]]
    source = load_fashion_mnist(fashion_mnist_root(), train=True)
    unused = torch.tensor(sorted(set(range(len(source.labels))) - set(data.ids.tolist())),
                          dtype=torch.long)
    others = unused[torch.randperm(len(unused), generator=generator)[:distractors]]
    images = torch.cat([data.images[picked], source.images[others]])
    labels = torch.cat([data.labels[picked], source.labels[others]])
    sources = picked.tolist() + [NO_MATCH] * len(others)
    if len(images) == 0:
        return pd.DataFrame({"item": pd.Series(dtype=int), "image": pd.Series(dtype=bytes),
                             "text": pd.Series(dtype=str), "weight": pd.Series(dtype=float),
                             "source": pd.Series(dtype=int)})
    texts = own_captions(images, labels, torch.arange(len(images)), classes, dataset.classes,
                         per_image, phrases, seed + 29)
    order = torch.randperm(len(images), generator=generator).tolist()  # items shuffled
    pngs = [png_bytes(transformed_copy(to_pil(images[i]), generator)) for i in order]
    item_of = {original: item for item, original in enumerate(order)}
    return pd.DataFrame({"item": texts["position"].map(item_of),
                         "image": texts["position"].map(lambda p: pngs[item_of[p]]),
                         "text": texts["text"], "weight": texts["weight"],
                         "source": texts["position"].map(lambda p: sources[p])}
                        ).sort_values(["item"], kind="stable").reset_index(drop=True)
