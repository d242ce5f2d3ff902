"""The project's own image descriptions: per class from a lexicon entry (synonyms, definition,
hypernym), per image from measures of the image itself (size, ink, brightness, shape).

A Fashion-MNIST sneaker gets, for example, "a sneaker", "gym shoe, sneaker, tennis shoe", "a
canvas shoe with a pliable rubber sole", "a kind of shoe", and phrases such as "a wide, low
item filling half the frame" and "a dark, lopsided shape, heavier at the bottom".

A user's description tables (CSV or Parquet) are read and checked here too
(`read_descriptions`, `check_images`, `check_classes`); `own_captions` draws the project's
captions per image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from training.datasets import DataError

# Weights of the description kinds: the class's name, synonyms and definition say what it is;
# a hypernym is shared with sibling classes; a measured phrase says little about the class.
CLASS_WEIGHTS = {"name": 1.0, "synonyms": 1.0, "definition": 1.0, "hypernym": 0.5}
PHRASE_WEIGHT = 0.25
INK = 0.2  # a pixel is ink when above this fraction of its image's brightest value


def class_descriptions(name: str, lemmas: Sequence[str], definition: str,
                       hypernym: str | None) -> list[tuple[str, str, float]]:
    """(kind, text, weight) of one class: its name, its synonyms, its definition and its
    hypernym (kinds without a value are left out)."""
    rows = [("name", f"a {name.lower()}"),
            ("synonyms", ", ".join(dict.fromkeys(lemmas)) if len(lemmas) > 1 else ""),
            ("definition", definition),
            ("hypernym", f"a kind of {hypernym}" if hypernym else "")]
    return [(kind, text, CLASS_WEIGHTS[kind]) for kind, text in rows if text]


def image_measures(images: Tensor) -> dict[str, Tensor]:
    """Per image (uint8 N x C x H x W): `ink` (the share of ink pixels), `brightness` (the
    ink's mean value, 0..1), `aspect` (the ink's bounding box, width / height), `balance` (the
    ink's centre of mass, 0 top .. 1 bottom) and `symmetry` (1 - the mean left-right
    difference of the ink, 0..1)."""
    gray = images.float().mean(1) / 255  # N x H x W
    peak = gray.flatten(1).amax(1).clamp(min=1e-6).view(-1, 1, 1)
    ink = gray > INK * peak
    count = ink.flatten(1).sum(1).clamp(min=1)
    height, width = gray.shape[1:]
    rows, cols = ink.any(2), ink.any(1)
    extent_h = _extent(rows).clamp(min=1)
    extent_w = _extent(cols).clamp(min=1)
    ys = torch.arange(height, dtype=torch.float32).view(1, -1, 1)
    centre = (ink * ys).flatten(1).sum(1) / count / max(height - 1, 1)
    inked = gray * ink
    mirror = (inked - inked.flip(2)).abs().flatten(1).sum(1) / inked.flatten(1).sum(1).clamp(
        min=1e-6)
    return {"ink": ink.flatten(1).float().mean(1),
            "brightness": inked.flatten(1).sum(1) / count,
            "aspect": extent_w / extent_h,
            "balance": centre,
            "symmetry": (1 - mirror / 2).clamp(0, 1)}


def _extent(any_ink: Tensor) -> Tensor:
    """Per row of booleans: last True position - first True position + 1 (0 when none)."""
    positions = torch.arange(any_ink.shape[1]).expand_as(any_ink)
    last = torch.where(any_ink, positions, -1).amax(1)
    first = torch.where(any_ink, positions, any_ink.shape[1]).amin(1)
    return (last - first + 1).clamp(min=0).float()


WORDS = {  # each measure's words for its lower, middle and upper third
    "ink": ("filling little of the frame", "filling half the frame",
            "filling most of the frame"),
    "brightness": ("dark", "grey", "bright"),
    "aspect": ("tall", "squarish", "wide"),
    "balance": ("heavier at the top", "balanced", "heavier at the bottom"),
    "symmetry": ("lopsided", "fairly symmetric", "symmetric"),
}


def tertiles(measures: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
    """Each measure's cuts at its 1/3 and 2/3 quantiles (of the images given: the training
    split, so every split is worded alike)."""
    return {name: (float(values.quantile(1 / 3)), float(values.quantile(2 / 3)))
            for name, values in measures.items()}


def image_phrases(measures: dict[str, Tensor], cuts: dict[str, tuple[float, float]]
                  ) -> list[tuple[str, str]]:
    """Two phrases per image from its measures, worded by third: "a wide, grey item filling
    half the frame" and "a lopsided shape, heavier at the bottom"."""
    def word(name: str, index: int) -> str:
        low, high = cuts[name]
        value = float(measures[name][index])
        return WORDS[name][0 if value < low else 1 if value < high else 2]

    phrases = []
    for i in range(len(measures["ink"])):
        phrases.append((f"a {word('aspect', i)}, {word('brightness', i)} item "
                        f"{word('ink', i)}",
                        f"a {word('symmetry', i)} shape, {word('balance', i)}"))
    return phrases


SHOWN = 5  # bad rows named in an error


class DescriptionError(DataError):
    """A description table that cannot be used, with what is wrong in it."""


def read_descriptions(path: str, key: str) -> pd.DataFrame:
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
