"""The benchmark data sets: which Fashion-MNIST training images each `NxS` set holds, and the
sets as ImageFolder directories (as a user's own images would come), made once under
data/small/. `bench.small_data` describes the two groups (tuning sets, report sets).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from tasks.data import fashion_mnist_root
from tasks.environment import data_dir
from training.datasets import load_fashion_mnist

TUNING_SETS = ("500x28", "1500x28", "5000x28", "1500x8", "digits")  # the defaults were tuned here
REPORT_SETS = ("1000x28", "2500x16")  # never tuned on: drawn apart from every tuning set

def digits_folder() -> Path:
    """scikit-learn's handwritten digits (1,797 real 8 x 8 gray images in 10 classes, shipped
    inside the package) as an ImageFolder under data/small/ (made once, then renamed)."""
    root = data_dir() / "small" / "digits-1797x8"
    if root.is_dir():
        return root
    from sklearn.datasets import load_digits

    digits = load_digits()
    partial = root.with_name(root.name + ".partial")
    for n, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = partial / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * 255 / 16).round().clip(0, 255).astype("uint8")  # values 0..16
        Image.fromarray(pixels, mode="L").save(folder / f"{n:05d}.png")
    partial.rename(root)
    return root


def class_folder(name: str) -> str:
    """The folder (and so the class name) of a Fashion-MNIST class in the sets."""
    return name.replace("/", "-")


def resized(image: torch.Tensor, size: int) -> Image.Image:
    """A Fashion-MNIST image (uint8 1 x 28 x 28) as the sets store it at `size` pixels."""
    picture = Image.fromarray(image[0].numpy(), mode="L")
    return picture if size == 28 else picture.resize((size, size), Image.BILINEAR)


def image_folder(images: int, size: int) -> Path:
    """The ImageFolder of `images` Fashion-MNIST training images at `size` pixels (made once
    under data/small/, written under a temporary name and renamed). A set that is not a
    tuning set draws none of the tuning sets' images."""
    root = data_dir() / "small" / f"fashion-{images}x{size}"
    if root.is_dir():
        return root
    source = load_fashion_mnist(fashion_mnist_root(), train=True)
    partial = root.with_name(root.name + ".partial")
    for label, picks in enumerate(set_draws(source.labels, images, size)):
        folder = partial / class_folder(source.classes[label])
        folder.mkdir(parents=True, exist_ok=True)
        for n, index in enumerate(picks.tolist()):
            resized(source.images[index], size).save(folder / f"{n:05d}.png")
    partial.rename(root)
    return root


def class_draws(labels: torch.Tensor, images: int, size: int,
                apart: set[int] | None = None) -> list[torch.Tensor]:
    """The training-file positions of the set `images`x`size`, per class in label order:
    `images / 10` of each class, a permutation seeded by `images x 1000 + size`, none of
    the positions `apart`."""
    generator = torch.Generator().manual_seed(images * 1000 + size)
    draws = []
    for label in range(int(labels.max()) + 1):
        picks = (labels == label).nonzero().flatten()
        if apart:
            picks = torch.tensor([i for i in picks.tolist() if i not in apart])
        draws.append(picks[torch.randperm(len(picks), generator=generator)[:images // 10]])
    return draws


def tuning_sets(labels: torch.Tensor) -> set[int]:
    """Every training-file position of the Fashion-MNIST tuning sets."""
    return {i for spec in TUNING_SETS if spec != "digits"
            for i in drawn_positions(labels, *(int(part) for part in spec.split("x")))}


def set_draws(labels: torch.Tensor, images: int, size: int) -> list[torch.Tensor]:
    """The set `images`x`size`'s draws per class: a tuning set's as they always were, any
    other set's apart from every tuning set's images."""
    tuning = f"{images}x{size}" in TUNING_SETS
    return class_draws(labels, images, size, None if tuning else tuning_sets(labels))


def set_positions(spec: str) -> set[int]:
    """The training-file positions the Fashion-MNIST set `spec` (`NxS`) holds."""
    images, size = (int(part) for part in spec.split("x"))
    labels = load_fashion_mnist(fashion_mnist_root(), train=True).labels
    return set(torch.cat(set_draws(labels, images, size)).tolist())


def drawn_positions(labels: torch.Tensor, images: int, size: int) -> list[int]:
    """Every training-file position the set `images`x`size` holds."""
    return torch.cat(class_draws(labels, images, size)).tolist()
