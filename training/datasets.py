"""Image data sets held in memory as one uint8 tensor, and their deterministic splits.

Small image sets train fastest as one tensor (N, C, H, W) rather than decoded image by image.
Two sources: Fashion-MNIST as torchvision reads it (`<root>/FashionMNIST/raw/`), and an
ImageFolder directory (one sub-folder per class, any format Pillow reads, gray or colour,
any size; resized to one square size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.datasets import FashionMNIST

from training.preprocess import GRAY_MODES, image_to_array

# Extensions of the formats Pillow can open (some registered ones, like .pdf, are save-only).
IMAGE_EXTENSIONS = frozenset(ext.lower() for ext, fmt in Image.registered_extensions().items()
                             if fmt in Image.OPEN)
BAD_IMAGE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError,
                    Image.DecompressionBombError)


class DataError(ValueError):
    """A data set that cannot be used as given; the message names the file or folder."""


@dataclass
class ImageSet:
    """Images as uint8 (N, C, H, W), integer labels (N,), and the class names."""

    images: Tensor
    labels: Tensor
    classes: list[str]
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise DataError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} "
                            f"{tuple(self.images.shape)}")
        if len(self.images) != len(self.labels):
            raise DataError(f"{len(self.images)} images but {len(self.labels)} labels")


def load_fashion_mnist(root: Path, train: bool) -> ImageSet:
    """Reads the train or test part of Fashion-MNIST from `root/FashionMNIST/raw/`."""
    raw = Path(root) / "FashionMNIST" / "raw"
    try:
        dataset = FashionMNIST(str(root), train=train, download=False)
    except RuntimeError as error:
        raise DataError(f"Fashion-MNIST not found in {raw} (run `make data`): {error}") from None
    return ImageSet(dataset.data.unsqueeze(1).contiguous(), dataset.targets.long(),
                    list(dataset.classes))


def reshape_images(images: Tensor, size: int, channels: int) -> Tensor:
    """uint8 images at another square size or channel count, through the same conversion the
    served model applies to raw images (so training and serving see the same pixels)."""
    if images.shape[1:] == (channels, size, size):
        return images
    mode = "L" if images.shape[1] == 1 else "RGB"
    arrays = [image_to_array(Image.fromarray(img.squeeze(2) if mode == "L" else img, mode),
                             size, channels)
              for img in images.permute(0, 2, 3, 1).numpy()]
    return torch.from_numpy(np.stack(arrays))


def _bad_image(path: Path, error: Exception, skip: bool, skipped: list[str]) -> None:
    if not skip:
        raise DataError(f"cannot read image {path}: {error} "
                        "(pass --skip-bad-images to skip such files)") from None
    skipped.append(str(path))


def image_folder_listing(root: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """An ImageFolder's class folders (sorted) and its image files with their labels, in the
    order `load_image_folder` reads them. Raises `DataError` as it does."""
    root = Path(root)
    if not root.exists():
        raise DataError(f"data path {root} does not exist")
    if not root.is_dir():
        raise DataError(f"data path {root} is not a directory of class folders")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(class_dirs) < 2:
        raise DataError(f"{root} needs at least 2 class sub-folders, found {len(class_dirs)}")
    listing: list[tuple[Path, int]] = []
    for label, class_dir in enumerate(class_dirs):
        files = sorted(
            p for p in class_dir.rglob("*")
            if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
            and not any(part.startswith(".") for part in p.relative_to(class_dir).parts)
        )
        if not files:
            raise DataError(f"class folder {class_dir} has no images")
        listing.extend((path, label) for path in files)
    return class_dirs, listing


def load_image_folder(
    root: Path, image_size: int, channels: int | None = None, skip_bad_images: bool = False
) -> ImageSet:
    """Reads an ImageFolder directory into memory.

    Args:
        root: a directory with one sub-folder per class (sorted names are the classes).
        image_size: every image is resized to `image_size` x `image_size`.
        channels: 1 or 3; `None` picks 1 when every image is grayscale, else 3.
        skip_bad_images: skip (and list in `skipped`) files Pillow cannot decode instead of
            raising.

    Raises:
        DataError: a missing path, no class folders, an empty class folder, or an unreadable
            image (naming the file).
    """
    class_dirs, listing = image_folder_listing(root)
    # Pass 1 reads headers only (cheap) to find the modes; pass 2 decodes into the final size,
    # so full-size images are never all held at once.
    readable, modes, skipped = [], [], []
    for path, label in listing:
        try:
            with Image.open(path) as image:
                modes.append(image.mode)
            readable.append((path, label))
        except BAD_IMAGE_ERRORS as error:
            _bad_image(path, error, skip_bad_images, skipped)
    if channels is None:
        channels = 1 if all(mode in GRAY_MODES for mode in modes) else 3
    arrays, labels = [], []
    for path, label in readable:
        try:
            with Image.open(path) as image:
                arrays.append(image_to_array(image, image_size, channels))
            labels.append(label)
        except BAD_IMAGE_ERRORS as error:
            _bad_image(path, error, skip_bad_images, skipped)
    for label, class_dir in enumerate(class_dirs):
        if label not in labels:
            raise DataError(f"class folder {class_dir} has no readable images")
    images = torch.from_numpy(np.stack(arrays))
    labels = torch.tensor(labels)
    return ImageSet(images, labels, [p.name for p in class_dirs], skipped)


def stratified_split(
    labels: Tensor, fraction: float, seed: int
) -> tuple[Tensor, Tensor]:
    """Splits indices so that `fraction` of each class goes to the second part.

    Deterministic for a seed; each class with at least 2 items keeps one on each side.

    Returns:
        (kept, held_out) index tensors, each sorted.
    """
    generator = torch.Generator().manual_seed(seed)
    kept, held = [], []
    for cls in torch.unique(labels):
        idx = torch.nonzero(labels == cls).flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        n_held = int(round(len(idx) * fraction))
        if len(idx) >= 2:
            n_held = min(max(n_held, 1), len(idx) - 1)
        held.append(idx[:n_held])
        kept.append(idx[n_held:])
    return torch.cat(kept).sort().values, torch.cat(held).sort().values


def limit(indices: Tensor, count: int | None, seed: int) -> Tensor:
    """A seeded random subset of `count` indices (all of them when `count` is None)."""
    if count is None or count >= len(indices):
        return indices
    generator = torch.Generator().manual_seed(seed)
    return indices[torch.randperm(len(indices), generator=generator)[:count]].sort().values


def channel_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 images, on the 0..1 scale."""
    x = images.float().div_(255)
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return mean.tolist(), std.tolist()
