"""Data tasks: the default data set's preparation, and a run's data set as one artifact.

`prepare_dataset` reads the source (Fashion-MNIST or an ImageFolder), splits it into train /
validation / test by each image's key (`training.datasets.stable_split`: a hash of its relative
path, so a grown folder keeps every image's split), and writes the images it uses, their
labels, keys, dataset ids and the split as one versioned tensor file. Later tasks (here, or
on another worker) load that file by reference; the same source version and split settings
give the same file and hash, and Prefect's cache skips the work when they were prepared before.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
from pathlib import Path

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tasks.adapters.caching import computation_key
from tasks.adapters.checkpoints import torch_save
from tasks.adapters.versioning import ArtifactRef, ArtifactStore, atomic_path, data_dvc_hash
from tasks.configs.sections import FASHION_MNIST, DataSection
from tasks.environment import PROJECT_ROOT, data_dir
from training.baselines import raw_pixel_baselines
from training.datasets import (
    DataError,
    ImageSet,
    LoadedDataset,
    assign_splits,
    channel_stats,
    content_hash,
    empty_splits,
    fill_empty_splits,
    image_folder_listing,
    labelled_images,
    load_fashion_mnist,
    load_image_folder,
    reshape_images,
    split_positions,
    validation_images,
)

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                       "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def fashion_mnist_root() -> Path:
    """Where torchvision finds Fashion-MNIST (`<root>/FashionMNIST/raw/`)."""
    return data_dir() / "fashion-mnist"


def install_fashion_mnist(source: Path = DEBIAN_FASHION_MNIST) -> list[Path]:
    """Gunzips Debian's Fashion-MNIST files into the data folder (atomically, only if missing).

    Returns:
        The files written (empty when all were there already).
    """
    raw = fashion_mnist_root() / "FashionMNIST" / "raw"
    written = []
    for name in FASHION_MNIST_FILES:
        target = raw / name
        if target.exists():
            continue
        packed = source / f"{name}.gz"
        if not packed.exists():
            raise FileNotFoundError(f"{packed} is missing: install Debian's package "
                                    "dataset-fashion-mnist (`make data` does)")
        with gzip.open(packed, "rb") as src, atomic_path(target) as temporary:
            temporary.write_bytes(src.read())
        written.append(target)
    return written


def source_version(data: DataSection) -> str:
    """The version of a data source: data.dvc's hash, or a fingerprint of an ImageFolder.

    The fingerprint hashes every file's relative path, size and modification time, so a
    changed, added or removed image gives a new version (and a new prepared data set).
    """
    if data.data == FASHION_MNIST:
        return f"data.dvc:{data_dvc_hash(PROJECT_ROOT / 'data.dvc')}"
    digest = hashlib.md5()
    root = Path(data.data)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"folder:{digest.hexdigest()}"


class DatasetRef(BaseModel):
    """A prepared data set: its artifact and what a model needs to know about it."""

    model_config = ConfigDict(frozen=True)

    artifact: ArtifactRef
    source: str
    version: str
    classes: list[str]
    channels: int
    image_size: int
    mean: list[float]
    std: list[float]
    sizes: dict[str, int]
    skipped: list[str]


log = logging.getLogger(__name__)


def split_assignment(data: DataSection, keys: list[str], contents: list[str] | None = None
                     ) -> list[str]:
    """Each key's split under `data`'s split settings (`training.datasets.assign_splits`):
    `train`, `val`, `test` (Fashion-MNIST's `test/` keys are its test split), or `unused` when
    `train_limit` / `val_limit` / `test_limit` leave it out; copies of one image (`contents`)
    share a split. An ImageFolder class left with no validation or no test image is handled
    as `tiny_classes` says (`check_tiny_classes`)."""
    fashion = data.data == FASHION_MNIST
    splits = assign_splits(keys, data.val_fraction, 0.0 if fashion else data.test_fraction,
                           data.split_seed, data.group_pattern, data.train_limit,
                           data.test_limit, data.val_limit, contents)
    return splits if fashion else check_tiny_classes(data, keys, splits, contents)


def check_tiny_classes(data: DataSection, keys: list[str], splits: list[str],
                       contents: list[str] | None = None) -> list[str]:
    """The splits with every ImageFolder class holding a validation and a test image: with
    `tiny_classes` `keep`, a class the hashes left without one gets one of its training
    images moved there (`training.datasets.fill_empty_splits`, logged); a class too small
    for three splits (or any such class with `refuse`) stops the run naming it; `warn` only
    warns. A class's errors could otherwise never be seen before a model is served."""
    if data.tiny_classes == "keep":
        splits, filled = fill_empty_splits(keys, splits, data.split_seed, data.group_pattern,
                                           contents)
        for name, moved in sorted(filled.items()):
            log.warning("class %r had no %s image under these split settings: one of its "
                        "training images was moved there", name, " or ".join(moved))
    tiny = empty_splits(keys, splits)
    if not tiny:
        return splits
    listed = "; ".join(f"{name!r}: {c['train']} training, {c['val']} validation, {c['test']} "
                       "test images" for name, c in sorted(tiny.items()))
    message = (f"{len(tiny)} class(es) of {data.data} have no validation or no test image "
               f"under these split settings ({listed}): add images to them, or raise "
               "--val-fraction / --test-fraction or the limits")
    if data.tiny_classes == "warn":
        log.warning("%s (--tiny-classes warn: running anyway)", message)
        return splits
    raise DataError(f"{message}; --tiny-classes warn runs anyway")


def source_keys(data: DataSection) -> list[str]:
    """Every image's key in the source, from the file listing alone (nothing decoded)."""
    if data.data == FASHION_MNIST:
        raw = fashion_mnist_root() / "FashionMNIST" / "raw"
        counts = [int.from_bytes((raw / f"{name}-labels-idx1-ubyte").read_bytes()[4:8], "big")
                  for name in ("train", "t10k")]
        return [f"{part}/{i:05d}" for part, count in zip(("train", "test"), counts, strict=True)
                for i in range(count)]
    root = Path(data.data)
    return [path.relative_to(root).as_posix() for path, _ in image_folder_listing(root)[1]]


def source_contents(data: DataSection) -> list[str]:
    """Every image's content hash, in `source_keys`' order (the files' bytes are read,
    nothing is decoded)."""
    if data.data == FASHION_MNIST:
        return [content for train in (True, False)
                for content in load_fashion_mnist(fashion_mnist_root(), train).contents]
    return [content_hash(path.read_bytes()) for path, _ in
            image_folder_listing(Path(data.data))[1]]


def split_source(data: DataSection) -> tuple[ImageSet, dict[str, Tensor]]:
    """The source's images and the indices of its train / val / test splits, after the
    train and test limits (`split_assignment`): the same splits every run (and every tool)
    of `data` sees."""
    if data.data == FASHION_MNIST:
        train = load_fashion_mnist(fashion_mnist_root(), train=True)
        test = load_fashion_mnist(fashion_mnist_root(), train=False)
        images = reshape_images(torch.cat([train.images, test.images]), data.image_size,
                                data.channels or 1)
        source = ImageSet(images, torch.cat([train.labels, test.labels]), train.classes,
                          keys=train.keys + test.keys, contents=train.contents + test.contents)
    else:
        source = load_image_folder(Path(data.data), data.image_size, data.channels or None,
                                   data.skip_bad_images)
    splits = split_assignment(data, source.keys, source.contents)
    return source, {name: split_positions(splits, name) for name in ("train", "val", "test")}


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="prepare-dataset")
def prepare_dataset(data: DataSection, version: str) -> DatasetRef:
    """Reads, splits and versions the data set of a run (cached on the source version)."""
    source, parts = split_source(data)
    train, val, test = parts["train"], parts["val"], parts["test"]
    used = torch.cat([train, val, test])
    positions = torch.arange(len(used))
    splits = {"train": positions[:len(train)],
              "val": positions[len(train):len(train) + len(val)],
              "test": positions[len(train) + len(val):]}
    images = source.images[used].contiguous()
    mean, std = channel_stats(images[splits["train"]])
    payload = {"images": images, "labels": source.labels[used].contiguous(), "ids": used,
               "splits": splits, "keys": [source.keys[i] for i in used.tolist()],
               "contents": [source.contents[i] for i in used.tolist()]}
    key = hashlib.md5(f"{data.model_dump_json()}|{version}".encode()).hexdigest()[:16]
    ref = ArtifactStore().write(f"datasets/{key}.pt", lambda path: torch_save(payload, path))
    return DatasetRef(artifact=ref, source=data.data, version=version, classes=source.classes,
                      channels=images.shape[1], image_size=images.shape[2], mean=mean, std=std,
                      sizes={name: len(idx) for name, idx in splits.items()},
                      skipped=source.skipped)


def load_dataset(ref: DatasetRef) -> LoadedDataset:
    """The prepared data set in memory (pulled by hash if missing; cached per process)."""
    return _load_artifact(ref.artifact)


def load_dataset_artifact(artifact: ArtifactRef) -> LoadedDataset:
    """A prepared data set by its artifact alone (a registered version records only that)."""
    return _load_artifact(artifact)


@functools.lru_cache(maxsize=4)
def _load_artifact(artifact: ArtifactRef) -> LoadedDataset:
    payload = torch.load(ArtifactStore().fetch(artifact), map_location="cpu", weights_only=True)
    return LoadedDataset(payload["images"], payload["labels"], payload["ids"], payload["splits"],
                         payload.get("keys") or [], payload.get("contents") or [])


@task(cache_key_fn=computation_key, persist_result=True, task_run_name="raw-pixel-baselines")
def pixel_baselines(dataset: DatasetRef, labels_per_class: int | None = None, split_seed: int = 0,
                    left_out_labels: tuple[int, ...] = ()) -> dict[str, float]:
    """The k-NN and linear baselines on the raw pixels of the prepared splits
    (`training.baselines`): what a model must beat on validation to be promoted.

    The baselines hold the labels the run holds, no more: the training and validation images
    of `left_out_labels` are left out (image_text's unseen classes), and with
    `labels_per_class` K they fit on the same K training images per class the run keeps
    labelled and choose k and the penalty on the same K validation images per class its
    choices read (`training.datasets.labelled_images`, `validation_images`). The test split
    stays whole. `train_images` and `val_images` say how many they read."""
    data = load_dataset(dataset)
    splits = dict(data.splits)
    for split in ("train", "val") if left_out_labels else ():
        positions = splits[split]
        splits[split] = positions[~torch.isin(data.labels[positions],
                                              torch.tensor(left_out_labels))]
    splits["train"] = labelled_images(data.labels, splits["train"], labels_per_class, split_seed,
                                      data.keys)
    splits["val"] = validation_images(data.labels, splits["val"], labels_per_class, split_seed,
                                      data.keys)
    return raw_pixel_baselines(data.images, data.labels, splits) | {
        "train_images": len(splits["train"]), "val_images": len(splits["val"])}
