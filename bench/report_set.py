"""Report images that no choice of this project ever read, for the Fashion-MNIST benchmarks.

Some defaults were chosen, in earlier sessions, by their score on Fashion-MNIST's official test
images (PBT's variants, `--min-steps 3000`, the augmentation, the exit heads, ...), so a figure
on those images is an upper estimate of what a user sees. The training file holds 60,000
images, and a run with `--train-limit` trains on only some of them: the rest (`unused` in
`python -m flows splits`) were never scored by any choice, provided they are also kept apart
from what earlier sessions read:

- the validation images of the splits before stable splits (a stratified draw of 10% of the
  training file, seed `split_seed + 1`, reproduced in `earlier_validation`), on which the
  flows chose rounds, thresholds and weights;
- the images of `bench.small_data`'s tuning sets (`500x28`, `1500x28`, `5000x28`, `1500x8`),
  whose own test splits were read while tuning the defaults.

`report_images` takes `REPORT_IMAGES` of what is left, the ones whose keys hash lowest (salt
`report`): the same images for every run of a data section, whatever its seed. A benchmark
then scores its final models there as well as on the official test images, and says which is
which.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bench.sets import tuning_sets
from tasks.adapters.registration import pyfunc_accuracy
from tasks.configs.sections import FASHION_MNIST, DataSection
from tasks.data import split_assignment, split_source
from tasks.promotion import raw_images
from training.datasets import UNUSED, stable_limit

REPORT_IMAGES = 10_000


def earlier_validation(labels: Tensor, fraction: float = 0.1, seed: int = 1) -> set[int]:
    """The training-file positions of the validation split before stable splits (commit
    b349fe5, `stratified_split(labels, val_fraction, split_seed + 1)` at split seed 0): per
    class, in label order, a seeded permutation's first `round(n x fraction)`."""
    generator = torch.Generator().manual_seed(seed)
    held = []
    for cls in torch.unique(labels):
        idx = torch.nonzero(labels == cls).flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        held += idx[:int(round(len(idx) * fraction))].tolist()
    return set(held)


def unread_positions(keys: list[str], labels: Tensor, left: set[int], count: int,
                     what: str) -> Tensor:
    """`count` of the training-file positions in `left` that no earlier choice read
    (`earlier_validation`, `bench.sets.tuning_sets`), those whose keys hash lowest (salt `report`).
    `keys` and `labels` are the training file's, position for position."""
    read = earlier_validation(labels) | tuning_sets(labels)
    kept = sorted(left - read)
    if count > len(kept):
        raise ValueError(f"only {len(kept)} unread training images are left; {what}")
    return stable_limit(torch.tensor(kept), keys, count, 0, "report")


def report_positions(data: DataSection, keys: list[str], labels: Tensor,
                     count: int = REPORT_IMAGES) -> Tensor:
    """Positions (in the source, training file first) of `count` training-file images
    that `data`'s splits leave unused and that no earlier choice read (module docstring)."""
    if data.data != FASHION_MNIST:
        raise ValueError("report images are drawn from Fashion-MNIST's training file; "
                         f"data is {data.data!r}")
    splits = split_assignment(data, keys)
    train_file = [i for i, key in enumerate(keys) if key.startswith("train/")]
    if train_file != list(range(len(train_file))):
        raise ValueError("keys: the training file's (`train/...`) must come first")
    unused = {i for i in train_file if splits[i] == UNUSED}
    return unread_positions(keys[:len(train_file)], labels[:len(train_file)], unused, count,
                            f"lower the train limit ({data.train_limit}) or the count "
                            f"({count})")


class ReportSet:
    """The report images of a data section, as served models take them (raw uint8, N x H x W)
    and as checkpoints take them (a uint8 tensor N x C x H x W), with their labels."""

    def __init__(self, data: DataSection, count: int = REPORT_IMAGES):
        source, _ = split_source(data)
        index = report_positions(data, source.keys, source.labels, count)
        self.tensor = source.images[index]
        self.labels = source.labels[index]
        self.names = [source.classes[i] for i in self.labels.tolist()]
        self.raw = raw_images(source, index)

    def __len__(self) -> int:
        return len(self.labels)

    def served_accuracy(self, model_uri: str) -> float:
        """The served model's accuracy on the report images."""
        return pyfunc_accuracy(model_uri, self.raw, self.names)

    def checkpoint_accuracy(self, classifier, dataset, checkpoint, weights: str = "model"
                            ) -> float:
        """A checkpoint's accuracy on the report images (the data set's normalization, the
        flows' evaluation)."""
        from tasks.training import trained_model
        from training.batches import Batches, Normalize
        from training.loops import evaluate

        cpu = torch.device("cpu")
        model = trained_model(classifier, dataset, checkpoint, weights)
        batches = Batches(self.tensor, self.labels, torch.arange(len(self)), 256,
                          Normalize(dataset.mean, dataset.std), device=cpu)
        return evaluate(model, batches, cpu)["accuracy"]
