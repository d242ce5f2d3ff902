"""Description tables: a user's captions and class descriptions (CSV or Parquet), checked
before any work, and the project's own (WordNet per class, measured phrases per image).

A captions table has one row per (image, description): `image` (the file's path inside the
ImageFolder, or a Fashion-MNIST index), `text`, `weight` (optional, default 1). A class table
has `class`, `text`, `weight`. Both become tables of the prepared data set's positions.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tasks.adapters.wordnet import WordNet
from tasks.configs.sections import FASHION_MNIST
from training.datasets import image_folder_listing
from training.image_text.descriptions import DescriptionError, class_descriptions

FASHION_MNIST_IMAGES = 70_000


def image_keys(data: str, skipped: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every source image's key, in source order: a Fashion-MNIST index, or the file's path
    inside the ImageFolder (`class/file.png`), the `skipped` (unreadable) files left out."""
    if data == FASHION_MNIST:
        return [str(i) for i in range(FASHION_MNIST_IMAGES)]
    root, left_out = Path(data), set(skipped)
    return [path.relative_to(root).as_posix() for path, _ in image_folder_listing(root)[1]
            if str(path) not in left_out]


def source_classes(data: str) -> list[str]:
    """The class names of a data source, read without its images."""
    if data == FASHION_MNIST:
        from torchvision.datasets import FashionMNIST

        return list(FashionMNIST.classes)
    return [folder.name for folder in image_folder_listing(Path(data))[0]]


def wordnet_classes(classes: list[str], wordnet: WordNet | None = None) -> pd.DataFrame:
    """Each class's descriptions from WordNet's first noun sense of its name (else of a
    `/`-separated part of it, else of its last word): name, synonyms, definition, hypernym.
    Raises `DescriptionError` naming the classes WordNet does not know."""
    wordnet = wordnet or WordNet()
    rows, unknown = [], []
    for name in classes:
        words = [name, *name.split("/"), name.replace("-", " ").split()[-1]]
        senses = next((s for s in map(wordnet.synsets, words) if s), None)
        if senses is None:
            unknown.append(name)
            continue
        sense = senses[0]
        hypernym = wordnet.synset(sense.hypernyms[0]).lemmas[0] if sense.hypernyms else None
        rows += [(name, text, weight, kind) for kind, text, weight in
                 class_descriptions(name, sense.lemmas, sense.definition, hypernym)]
    if unknown:
        raise DescriptionError(f"WordNet has no noun for classes {', '.join(unknown)}: give "
                               "--class-descriptions")
    return pd.DataFrame(rows, columns=["class", "text", "weight", "kind"])
