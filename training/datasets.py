"""Image data sets held in memory as one uint8 tensor, and their stable splits.

Small image sets train fastest as one tensor (N, C, H, W) rather than decoded image by image.
Two sources: Fashion-MNIST as torchvision reads it (`<root>/FashionMNIST/raw/`), and an
ImageFolder directory (one sub-folder per class, any format Pillow reads, gray or colour,
any size; resized to one square size).

Every image has a key: its path relative to the ImageFolder (`Sandal/0001.png`), or
`train/00042` / `test/00042` in Fashion-MNIST's two files; and a content hash (`content_hash`
of the file's bytes, or of the image's pixels in Fashion-MNIST's files), which knows the same
image under another name. An image's split is a pure function of its key (`stable_split`),
so adding, removing or renaming other images never moves it from test to training: a model
retrained on a grown folder is scored on images the earlier model never saw; copies of one
image (the same content under several names) share one split, the most held-out of theirs.

`LoadedDataset` is a prepared data set in memory; `readable_images` reads the image files a
user hands a registered model (predict, embed).
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.datasets import FashionMNIST

from training.preprocess import GRAY_MODES, decode_image, image_to_array

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
    keys: list[str] = field(default_factory=list)  # one per image (module docstring)
    contents: list[str] = field(default_factory=list)  # `content_hash` of each image

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise DataError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} "
                            f"{tuple(self.images.shape)}")
        if len(self.images) != len(self.labels):
            raise DataError(f"{len(self.images)} images but {len(self.labels)} labels")
        if self.keys and len(self.keys) != len(self.images):
            raise DataError(f"{len(self.images)} images but {len(self.keys)} keys")
        if self.contents and len(self.contents) != len(self.images):
            raise DataError(f"{len(self.images)} images but {len(self.contents)} content hashes")


def content_hash(data: bytes) -> str:
    """An image's content hash: BLAKE2b (128 bits) of its bytes, in hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def pixel_hashes(images: Tensor) -> list[str]:
    """`content_hash` of each uint8 image's pixels (Fashion-MNIST's images have no file)."""
    return [content_hash(image.numpy().tobytes()) for image in images]


def load_fashion_mnist(root: Path, train: bool) -> ImageSet:
    """Reads the train or test part of Fashion-MNIST from `root/FashionMNIST/raw/`."""
    raw = Path(root) / "FashionMNIST" / "raw"
    try:
        dataset = FashionMNIST(str(root), train=train, download=False)
    except RuntimeError as error:
        raise DataError(f"Fashion-MNIST not found in {raw} (run `make data`): {error}") from None
    part = "train" if train else "test"
    return ImageSet(dataset.data.unsqueeze(1).contiguous(), dataset.targets.long(),
                    list(dataset.classes),
                    keys=[f"{part}/{index:05d}" for index in range(len(dataset.targets))],
                    contents=pixel_hashes(dataset.data))


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
    root = Path(root)
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
    arrays, labels, keys, contents = [], [], [], []
    for path, label in readable:
        try:
            data = path.read_bytes()  # read once: decoded, and hashed as the image's content
            with Image.open(io.BytesIO(data)) as image:
                arrays.append(image_to_array(image, image_size, channels))
            labels.append(label)
            keys.append(path.relative_to(root).as_posix())
            contents.append(content_hash(data))
        except BAD_IMAGE_ERRORS as error:
            _bad_image(path, error, skip_bad_images, skipped)
    for label, class_dir in enumerate(class_dirs):
        if label not in labels:
            raise DataError(f"class folder {class_dir} has no readable images")
    images = torch.from_numpy(np.stack(arrays))
    labels = torch.tensor(labels)
    return ImageSet(images, labels, [p.name for p in class_dirs], skipped, keys, contents)


def unit_hash(key: str, seed: int, salt: str = "split") -> float:
    """A number in [0, 1) that depends only on `key`, `seed` and `salt`: the first 8 bytes of
    SHA-1(`salt:seed:key`) over 2^64 (the stable-split recipe of TensorFlow's speech-commands
    `which_set`). Uniform over keys, the same on every machine and Python."""
    digest = hashlib.sha1(f"{salt}:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def group_key(key: str, group_pattern: str | re.Pattern | None) -> str:
    """The key whose hash decides an image's split: the image's own key, or, with a
    `group_pattern`, its folder plus the part of its file name the pattern matches (the first
    group where the pattern has one, else the whole match), so that `cat/001_flip.png` and
    `cat/001.png` under `(\\d+)` share the group `cat/001`. A name the pattern does not match
    is a group of its own."""
    if group_pattern is None:
        return key
    folder, _, name = key.rpartition("/")
    match = re.search(group_pattern, name)
    if match is None:
        return key
    part = match.group(1) if match.re.groups else match.group(0)
    return f"{folder}/{part}" if folder else part


def check_group_pattern(pattern: str | None) -> str | None:
    """`pattern` if it compiles as a regular expression; a `ValueError` naming it if not."""
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"group pattern {pattern!r} is not a regular expression: "
                             f"{error}") from None
    return pattern


def duplicate_groups(keys: Sequence[str], contents: Sequence[str] | None) -> dict[str, str]:
    """The group key of every key whose content (`contents`, one per key) is also held under
    another key: `content:<hash>`."""
    if not contents:
        return {}
    if len(contents) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(contents)} content hashes")
    counts: dict[str, int] = {}
    for content in contents:
        counts[content] = counts.get(content, 0) + 1
    return {key: f"content:{content}" for key, content in zip(keys, contents, strict=True)
            if counts[content] > 1}


HELD_OUT = {"train": 0, "val": 1, "test": 2}  # the order in which copies of an image join


def stable_split(keys: Sequence[str], val_fraction: float, test_fraction: float, seed: int,
                 group_pattern: str | None = None, contents: Sequence[str] | None = None
                 ) -> list[str]:
    """Each key's split, `train`, `val` or `test`, as a pure function of its group's key.

    With u = `unit_hash(group_key(key), seed)`: test when u < test_fraction; validation when
    u < test_fraction + (1 - test_fraction) * val_fraction (so `val_fraction` is the share of
    the images left after the test split); training otherwise. No other key enters, so adding,
    removing or renaming images never moves another image across splits, and every image of
    a group (variants of one original) lands in one split. Each class keeps its share in
    expectation (the keys hold the class folder); a class of a few images may have none in a
    split. `test_fraction` 0 keeps every key out of the test split (Fashion-MNIST's training
    file: its test file is the test split).

    With `contents` (each key's content hash), copies of one image under several keys share
    the most held-out of their splits (test before validation before training): a copy never
    trains while another is tested, and adding a copy never moves an image out of the test
    split (it may bring a training image into it: promotion leaves out what a model saw, by
    content).
    """
    if not (0.0 <= test_fraction < 1.0 and 0.0 <= val_fraction < 1.0):
        raise ValueError(f"fractions must be in [0, 1): val {val_fraction}, test {test_fraction}")
    compiled = re.compile(group_pattern) if group_pattern is not None else None
    val_edge = test_fraction + (1.0 - test_fraction) * val_fraction
    splits = []
    for key in keys:
        u = unit_hash(group_key(key, compiled), seed)
        splits.append("test" if u < test_fraction else "val" if u < val_edge else "train")
    copies = duplicate_groups(keys, contents)
    if copies:
        joined: dict[str, str] = {}
        for key, split in zip(keys, splits, strict=True):
            if key in copies:
                group = copies[key]
                joined[group] = max(joined.get(group, split), split, key=HELD_OUT.__getitem__)
        splits = [joined[copies[key]] if key in copies else split
                  for key, split in zip(keys, splits, strict=True)]
    return splits


def stable_limit(indices: Tensor, keys: Sequence[str], count: int | None, seed: int,
                 salt: str) -> Tensor:
    """At most `count` of `indices`: those whose keys hash lowest (`unit_hash` with `salt`),
    sorted. Pure per key like `stable_split`: a grown folder keeps its chosen images unless a
    new one hashes lower than the last one chosen."""
    if count is None or count >= len(indices):
        return indices
    ranks = torch.tensor([unit_hash(keys[i], seed, salt) for i in indices.tolist()],
                         dtype=torch.float64)
    return indices[ranks.argsort()[:count]].sort().values


UNUSED = "unused"  # an image of the training or test split left out by a limit


def split_positions(splits: Sequence[str], name: str) -> Tensor:
    """The positions whose split is `name`, in order."""
    return torch.tensor([i for i, split in enumerate(splits) if split == name], dtype=torch.long)


def assign_splits(keys: Sequence[str], val_fraction: float, test_fraction: float, seed: int,
                  group_pattern: str | None = None, train_limit: int | None = None,
                  test_limit: int | None = None, val_limit: int | None = None,
                  contents: Sequence[str] | None = None) -> list[str]:
    """Each key's split: `train`, `val`, `test` (`stable_split`; keys under `test/` are the
    test split whatever their hash when `test_fraction` is 0: Fashion-MNIST's test file), or
    `UNUSED` where `train_limit` / `val_limit` / `test_limit` leave it out (the keys that hash
    lowest are kept, `stable_limit`). A pure function of each key and the settings: no image
    moves to another split as the folder grows. What the flows (`tasks.data.split_assignment`)
    and the benchmarks that train outside them both use. `contents`: each key's content hash,
    so that copies of an image share a split (`stable_split`)."""
    splits = stable_split(keys, val_fraction, test_fraction, seed, group_pattern, contents)
    if test_fraction == 0.0:
        splits = ["test" if key.startswith("test/") else split
                  for key, split in zip(keys, splits, strict=True)]
    for name, count in (("train", train_limit), ("val", val_limit), ("test", test_limit)):
        members = split_positions(splits, name)
        kept = set(stable_limit(members, keys, count, seed, f"{name}-limit").tolist())
        for i in members.tolist():
            if i not in kept:
                splits[i] = UNUSED
    return splits


def empty_splits(keys: Sequence[str], splits: Sequence[str]) -> dict[str, dict[str, int]]:
    """The classes (the first part of their keys) with no validation or no test image, and
    their images per split."""
    counts: dict[str, dict[str, int]] = {}
    for key, split in zip(keys, splits, strict=True):
        per_split = counts.setdefault(key.split("/", 1)[0], {"train": 0, "val": 0, "test": 0})
        if split in per_split:
            per_split[split] += 1
    return {name: c for name, c in counts.items() if c["val"] == 0 or c["test"] == 0}


def fill_empty_splits(keys: Sequence[str], splits: list[str], seed: int,
                      group_pattern: str | None = None, contents: Sequence[str] | None = None
                      ) -> tuple[list[str], dict[str, list[str]]]:
    """Gives every class (the first part of its keys) at least one validation and one test
    image: a class the hashes left without one gets the training group (`stable_split`'s:
    an image, its copies, its variants under `group_pattern`) whose key hashes lowest (salt
    `keep-<split>`) moved there, as long as a training group stays. Returns the splits and
    the splits filled per class; a class too small for three splits stays in `empty_splits`."""
    splits = list(splits)
    copies = duplicate_groups(keys, contents)
    compiled = re.compile(group_pattern) if group_pattern is not None else None
    groups: dict[str, dict[str, list[int]]] = {}  # class -> group -> positions
    for i, key in enumerate(keys):
        group = copies.get(key) or group_key(key, compiled)
        groups.setdefault(key.split("/", 1)[0], {}).setdefault(group, []).append(i)
    filled: dict[str, list[str]] = {}
    for name in empty_splits(keys, splits):
        members = groups[name]
        for split in ("val", "test"):
            if any(splits[i] == split for positions in members.values() for i in positions):
                continue
            training = [g for g, positions in members.items()
                        if all(splits[i] == "train" for i in positions)]
            if len(training) < 2:
                continue
            chosen = min(training, key=lambda g: unit_hash(g, seed, f"keep-{split}"))
            for i in members[chosen]:
                splits[i] = split
            filled.setdefault(name, []).append(split)
    return splits, filled


def limit(indices: Tensor, count: int | None, seed: int) -> Tensor:
    """A seeded random subset of `count` indices (all of them when `count` is None)."""
    if count is None or count >= len(indices):
        return indices
    generator = torch.Generator().manual_seed(seed)
    return indices[torch.randperm(len(indices), generator=generator)[:count]].sort().values


VALIDATION_SEED = 1009  # added to the split seed for the same-budget validation draw


def validation_images(labels: Tensor, val: Tensor, per_class: int | None, split_seed: int,
                      keys: Sequence[str]) -> Tensor:
    """The validation positions the run's choices read (early stopping, the round kept, the
    head mixing): all of `val`, or with `per_class` K (`labels_per_class`) at most K of each
    class, drawn by key like `labelled_images` with the split seed (the labels a few-label
    user could hold out), so that no choice reads more labels than the run is said to have."""
    return labelled_images(labels, val, per_class, split_seed + VALIDATION_SEED, keys)


def labelled_images(labels: Tensor, train: Tensor, per_class: int | None, seed: int,
                    keys: Sequence[str]) -> Tensor:
    """The positions of `train` that keep their label: all, or at most `per_class` of each
    class: those whose keys (`keys[position]`) hash lowest (`unit_hash` with the salt
    `labels`), sorted. Pure per key like `stable_split`: a grown folder keeps the labelled
    images unless a new one of the class hashes lower than the last one kept."""
    if per_class is None:
        return train
    last = int(train.max()) if len(train) else -1
    if len(keys) <= last:
        raise ValueError(f"a few-label draw needs each image's key: {len(keys)} keys for "
                         f"positions up to {last}")
    kept = []
    for label in labels[train].unique().tolist():
        members = train[labels[train] == label]
        kept.append(stable_limit(members, keys, per_class, seed, "labels"))
    return torch.cat(kept).sort().values if kept else train


def channel_stats(images: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 images, on the 0..1 scale."""
    x = images.float().div_(255)
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return mean.tolist(), std.tolist()


@dataclass
class LoadedDataset:
    """Images (uint8 N x C x H x W), labels, dataset ids, split positions, each image's key
    (its path relative to the data folder; `train/00042` in Fashion-MNIST) and content hash
    (`training.datasets.content_hash`; empty in data sets prepared before they were
    recorded), in memory."""

    images: Tensor
    labels: Tensor
    ids: Tensor
    splits: dict[str, Tensor]
    keys: list[str]
    contents: list[str] = field(default_factory=list)

    def _seen(self, names: list[str]) -> set[str]:
        return {names[i] for split in ("train", "val") for i in self.splits[split].tolist()}

    def seen_keys(self) -> set[str]:
        """The keys of the images a model of this data set trained or was chosen on."""
        return self._seen(self.keys)

    def seen_contents(self) -> set[str]:
        """The content hashes of those images (empty when none were recorded)."""
        return self._seen(self.contents) if self.contents else set()


def image_files(path: Path) -> list[Path]:
    """The file itself, or every image file under a folder (sorted)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and p.suffix.lower() in IMAGE_EXTENSIONS)


def read_images(files: list[Path], skip_bad: bool) -> tuple[list[Path], list[bytes], list[Path]]:
    """The readable files and their bytes, and the skipped ones.

    Raises:
        DataError: a file is not a readable image (and `skip_bad` is off).
    """
    kept, blobs, skipped = [], [], []
    for file in files:
        data = file.read_bytes()
        try:
            decode_image(data)
        except ValueError as error:
            if not skip_bad:
                raise DataError(f"cannot read image {file}: {error}") from None
            skipped.append(file)
            continue
        kept.append(file)
        blobs.append(data)
    return kept, blobs, skipped


def readable_images(images: str, skip_bad: bool) -> tuple[list[Path], list[bytes], list[Path]]:
    """The image files under `images` that decode, their bytes, and the skipped ones.

    Raises:
        DataError: no image files there, or one does not decode (and `skip_bad` is off).
    """
    files = image_files(Path(images).expanduser())
    if not files:
        raise DataError(f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS)[:6])}, ...) "
                        f"under {images}")
    return read_images(files, skip_bad)
