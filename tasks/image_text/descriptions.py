"""Description tables: a user's captions and class descriptions (CSV or Parquet), checked
before any work, and the project's own (WordNet per class, measured phrases per image).

A captions table has one row per (image, description): `image` (the file's path inside the
ImageFolder, or a Fashion-MNIST index), `text`, `weight` (optional, default 1). A class table
has `class`, `text`, `weight`. Both become tables of the prepared data set's positions.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch

from tasks.adapters.wordnet import WordNet
from tasks.configs.sections import FASHION_MNIST
from training.datasets import DataError, image_folder_listing
from training.image_text.descriptions import (
    PHRASE_WEIGHT,
    class_descriptions,
    image_measures,
    image_phrases,
    tertiles,
)

FASHION_MNIST_IMAGES = 70_000
SHOWN = 5  # bad rows named in an error


class DescriptionError(DataError):
    """A description table that cannot be used, with what is wrong in it."""


def read_table(path: str, key: str) -> pd.DataFrame:
    """A table with columns `key`, `text` and `weight` (1 where absent); empty texts,
    negative or non-finite weights raise `DescriptionError` with their count and first rows."""
    file = Path(path)
    frame = pd.read_parquet(file) if file.suffix.lower() == ".parquet" else pd.read_csv(
        file, dtype={key: str, "text": str}, keep_default_na=False)
    missing = [c for c in (key, "text") if c not in frame.columns]
    if missing:
        raise DescriptionError(f"{path}: no column {', '.join(missing)} (has "
                               f"{', '.join(map(str, frame.columns))})")
    frame = frame.assign(**{key: frame[key].astype(str), "text": frame["text"].astype(str)})
    if "weight" not in frame.columns:
        frame = frame.assign(weight=1.0)
    weights = pd.to_numeric(frame["weight"], errors="coerce")
    _refuse(path, frame, frame["text"].str.strip() == "", "an empty text")
    _refuse(path, frame, ~weights.map(lambda w: math.isfinite(w) and w >= 0),
            "a negative or non-numeric weight")
    return frame.assign(weight=weights.astype(float))[[key, "text", "weight"]]


def _refuse(path: str, frame: pd.DataFrame, bad: pd.Series, what: str) -> None:
    if bad.any():
        rows = [int(i) + 2 for i in frame.index[bad][:SHOWN]]  # 1-based, after the header
        raise DescriptionError(f"{path}: {int(bad.sum())} rows with {what} (lines "
                               f"{', '.join(map(str, rows))})")


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


def check_images(captions: pd.DataFrame, keys: list[str], path: str) -> None:
    """Refuses captions naming images the data set does not have (count, first few)."""
    unknown = sorted(set(captions["image"]) - set(keys))
    if unknown:
        raise DescriptionError(f"{path}: {len(unknown)} images not in the data set, e.g. "
                               f"{', '.join(unknown[:SHOWN])}")


def check_classes(table: pd.DataFrame, classes: list[str], path: str) -> None:
    """Refuses a class table that leaves a class without a description."""
    missing = [c for c in classes if c not in set(table["class"])]
    if missing:
        raise DescriptionError(f"{path}: no description for classes {', '.join(missing)}")


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


def own_captions(images: torch.Tensor, labels: torch.Tensor, train: torch.Tensor,
                 classes: pd.DataFrame, names: list[str], per_image: int, phrases: bool,
                 seed: int, described: torch.Tensor | None = None) -> pd.DataFrame:
    """The project's captions of the images (by position): `per_image` of its class's
    descriptions (a seeded draw) for every position in `described` (None: every position),
    and, with `phrases`, two measured phrases for every position (worded by the training
    split's thirds). Columns position, text, weight, kind.

    Class descriptions are derived from the label; the phrases only from the pixels. A
    few-label run passes its labelled positions as `described`, so an unlabelled image gets
    no text that knows its class (the draws do not depend on `described`: a labelled image
    gets the same texts as in the run with every label)."""
    generator = torch.Generator().manual_seed(seed)
    by_class = {name: rows for name, rows in classes.groupby("class", sort=False)}
    keep = None if described is None else set(described.tolist())
    rows = []
    for position, label in enumerate(labels.tolist()):
        own = by_class[names[label]]
        picks = torch.randperm(len(own), generator=generator)[:per_image].tolist()
        if keep is not None and position not in keep:
            continue
        rows += [(position, own.iloc[i]["text"], own.iloc[i]["weight"], own.iloc[i]["kind"])
                 for i in sorted(picks)]
    if phrases:
        measures = image_measures(images)
        cuts = tertiles({k: v[train] for k, v in measures.items()})
        for position, pair in enumerate(image_phrases(measures, cuts)):
            rows += [(position, text, PHRASE_WEIGHT, "phrase") for text in pair]
    return pd.DataFrame(rows, columns=["position", "text", "weight", "kind"])
