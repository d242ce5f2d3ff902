"""Mini-batches straight from an in-memory uint8 tensor: normalise and augment on the fly.

Faster than a DataLoader over single images for small data: one gather per batch, no decoding,
no worker processes. The images can sit on the training device, so a GPU batch never crosses
the bus.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor


class Normalize:
    """`(x / 255 - mean) / std` per channel, on uint8 (N, C, H, W) input."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def __call__(self, images: Tensor) -> Tensor:
        mean, std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float().div_(255) - mean) / std


def draw_shift_flip(n: int, max_shift: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random flips (n,) and shifts (n, 2) for `shift_flip`, from `generator` on the CPU."""
    flips = torch.rand(n, generator=generator) < 0.5
    shifts = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator) if max_shift > 0 \
        else torch.zeros(n, 2, dtype=torch.long)
    return flips, shifts


def random_shift_flip(x: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Random crop after zero padding by `max_shift` pixels, and a horizontal flip half the time.

    The standard small-image augmentation (pad-and-crop plus flip), done for the whole batch
    with one gather. Random numbers come from `generator` on the CPU, so a seed gives the same
    batch on every device.
    """
    flips, shifts = draw_shift_flip(len(x), max_shift, generator)
    return shift_flip(x, flips, shifts, max_shift)


def shift_flip(x: Tensor, flips: Tensor, shifts: Tensor, max_shift: int) -> Tensor:
    """Applies drawn flips and shifts (see `draw_shift_flip`) to a batch."""
    n, _, h, w = x.shape
    if max_shift > 0:
        padded = torch.nn.functional.pad(x, (max_shift,) * 4)
        rows = (shifts[:, :1] + torch.arange(h)).to(x.device)
        cols = (shifts[:, 1:] + torch.arange(w)).to(x.device)
        batch = torch.arange(n, device=x.device)[:, None, None, None]
        chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        x = padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]
    return torch.where(flips.to(x.device).view(n, 1, 1, 1), x.flip(-1), x)


def max_shift_for(augment: float, size: int) -> int:
    """The largest shift of the pad-and-crop augmentation: `augment * size / 7` pixels rounded
    down, a fraction of the image never exceeded (4 pixels at strength 1 on 28 pixels, like
    CIFAR's 4 of 32). A whole pixel is an eighth of an 8-pixel image: at the default strength
    such an image is only flipped (a 1-pixel shift cost `lenet` 4 points on 8-pixel
    Fashion-MNIST)."""
    return math.floor(augment * size / 7 + 1e-9)


class Batches:
    """Iterates `(ids, images, labels)` batches over `indices` of an image tensor.

    Args:
        images: uint8 (N, C, H, W), the whole data set (moved to `device` once).
        labels: int64 (N,).
        indices: which rows to iterate (dataset ids; returned with each batch).
        batch_size: images per batch; the last batch may be smaller unless `drop_last` (which
            keeps a short batch only when there is no full one).
        normalize: the per-channel normalisation.
        shuffle: reshuffle every pass, from `seed` and the pass number.
        seed: seed of the shuffling and augmentation generator.
        augment: augmentation strength in [0, 1]: 0 is none; otherwise flips and shifts of up
            to `max_shift_for(augment, size)` pixels (4 * augment at 28 pixels).
        flip: whether the augmentation flips (half the images, horizontally); the draws are
            the same either way, so the shifts do not depend on it.
        device: where batches are produced.
        rank, world_size: under data-parallel training, this process's share of every batch:
            the images at positions `rank, rank + world_size, ...` of the batch all processes
            draw alike (same order, same augmentation), so the union over ranks is the batch
            one process would see.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        indices: Tensor,
        batch_size: int,
        normalize: Normalize,
        shuffle: bool = False,
        seed: int = 0,
        augment: float = 0.0,
        drop_last: bool = False,
        device: torch.device | str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        flip: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size or batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} must split evenly over {world_size} "
                             f"processes (rank {rank})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = labels.to(self.device)
        self.indices = indices.long()
        self.batch_size = batch_size
        self.normalize = normalize
        self.shuffle = shuffle
        self.seed = seed
        self.augment = augment
        self.flip = flip
        self.drop_last = drop_last
        self.passes = 0

    def __len__(self) -> int:
        full, rest = divmod(len(self.indices), self.batch_size)
        return full if rest == 0 or (self.drop_last and full > 0) else full + 1

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.passes)
        self.passes += 1
        order = self.indices
        if self.shuffle:
            order = order[torch.randperm(len(order), generator=generator)]
        max_shift = max_shift_for(self.augment, self.images.shape[-1])
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            ids = order[start:start + self.batch_size]
            if self.augment > 0:
                flips, shifts = draw_shift_flip(len(ids), max_shift, generator)
                flips &= self.flip
            mine = slice(self.rank, None, self.world_size)
            ids = ids[mine]
            on_device = ids.to(self.device)
            x = self.images[on_device]
            if self.augment > 0:
                x = shift_flip(x, flips[mine], shifts[mine], max_shift)
            yield ids, self.normalize(x), self.labels[on_device]
