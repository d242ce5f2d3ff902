"""Mini-batches straight from an in-memory uint8 tensor: normalise and augment on the fly.

Faster than a DataLoader over single images for small data: one gather per batch, no decoding,
no worker processes. The images can sit on the training device, so a GPU batch never crosses
the bus.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from training.datasets import LoadedDataset
from training.device import inference_batch
from training.settings import DatasetShape
from training.stopping import check_stop


class Normalize:
    """`(x / 255 - mean) / std` per channel, on uint8 (N, C, H, W) input."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def __call__(self, images: Tensor) -> Tensor:
        mean, std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float().div_(255) - mean) / std


WARP_TURN = math.radians(20.0)  # the warp's largest rotation at strength 1 (10 degrees at 0.5)
WARP_ZOOM = 0.2  # the warp's largest change of scale at strength 1 (10% at 0.5)


def draw_shift_flip(n: int, max_shift: float, generator: torch.Generator,
                    max_turn: float = 0.0, max_zoom: float = 0.0) -> tuple[Tensor, Tensor]:
    """Random flips (n,) and moves for `shift_flip`, from `generator` on the CPU.

    Where `max_shift` m >= 1 the moves are whole-pixel shifts (n, 2) (rows, columns) in
    [-m, m]; where 0 < m < 1 they are warps (n, 4) (rows, columns, radians, scale): a shift
    uniform in [-m, m] pixels, a rotation in [-max_turn, max_turn] and a scale in
    1 +- max_zoom (see `max_shift_for`)."""
    flips = torch.rand(n, generator=generator) < 0.5
    if max_shift >= 1:
        whole = int(max_shift)
        moves = torch.randint(0, 2 * whole + 1, (n, 2), generator=generator) - whole
    elif max_shift > 0:
        spread = torch.tensor([max_shift, max_shift, max_turn, max_zoom])
        moves = (torch.rand(n, 4, generator=generator) * 2 - 1) * spread
        moves[:, 3] += 1.0
    else:
        moves = torch.zeros(n, 2, dtype=torch.long)
    return flips, moves


def random_shift_flip(x: Tensor, max_shift: float, generator: torch.Generator,
                      max_turn: float = 0.0, max_zoom: float = 0.0) -> Tensor:
    """Random crop after zero padding by `max_shift` pixels, and a horizontal flip half the time.

    The standard small-image augmentation (pad-and-crop plus flip), done for the whole batch
    with one gather (a warp below one pixel). Random numbers come from `generator` on the CPU,
    so a seed gives the same batch on every device.
    """
    flips, moves = draw_shift_flip(len(x), max_shift, generator, max_turn, max_zoom)
    return shift_flip(x, flips, moves)


def shift_flip(x: Tensor, flips: Tensor, moves: Tensor) -> Tensor:
    """Applies drawn flips and moves (see `draw_shift_flip`) to a batch. A whole-pixel shift
    makes image `i` `x_i(r + shift_r, c + shift_c)`, zero outside, by one gather from the
    zero-padded batch (the result keeps `x`'s dtype); warps interpolate (`warp`, float)."""
    n, _, h, w = x.shape
    if moves.is_floating_point():
        x = warp(x, moves.to(x.device))
    elif len(moves) and moves.abs().max() > 0:
        pad = int(moves.abs().max())
        padded = torch.nn.functional.pad(x, (pad,) * 4)
        rows = (moves[:, :1] + pad + torch.arange(h)).to(x.device)
        cols = (moves[:, 1:] + pad + torch.arange(w)).to(x.device)
        batch = torch.arange(n, device=x.device)[:, None, None, None]
        chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        x = padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]
    return torch.where(flips.to(x.device).view(n, 1, 1, 1), x.flip(-1), x)


def warp(x: Tensor, moves: Tensor) -> Tensor:
    """`x` (N, C, H, W) under the affine warps `moves` (N, 4): rows and columns to shift by (in
    pixels, fractions allowed), a rotation (radians) and a scale about the centre; bilinear,
    zero outside. Output pixel p samples the input at R(turn) p / scale + shift."""
    n, _, h, w = x.shape
    shift_r, shift_c, turn, scale = moves.float().unbind(1)
    cos, sin = torch.cos(turn) / scale, torch.sin(turn) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift_c * 2 / w], 1),
                         torch.stack([sin, cos, shift_r * 2 / h], 1)], 1)
    grid = torch.nn.functional.affine_grid(theta, [n, 1, h, w], align_corners=False)
    return torch.nn.functional.grid_sample(x.float(), grid, mode="bilinear",
                                           padding_mode="zeros", align_corners=False)


def max_shift_for(augment: float, size: int) -> float:
    """The largest shift of the pad-and-crop augmentation, a fraction of the image never
    exceeded: `augment * size / 7` pixels, rounded down to whole pixels where that is at least
    one (4 pixels at strength 1 on 28 pixels, like CIFAR's 4 of 32). Below one pixel (0.57 at
    the default 0.5 on 8 pixels) it stays a fraction, and the image is warped instead: that
    shift, a rotation of up to `WARP_TURN` and a scale of up to `WARP_ZOOM` (times `augment`),
    bilinear. A whole pixel is an eighth of an 8-pixel image (it cost `lenet` 4 points on
    8-pixel Fashion-MNIST); no move at all left the 8 x 8 digits below 3-NN on their pixels
    (docs/train.md)."""
    shift = augment * size / 7
    return float(math.floor(shift + 1e-9)) if shift >= 1 - 1e-9 else shift


def draw_views(n: int, augment: float, size: int, generator: torch.Generator,
               flip: bool = True) -> tuple[Tensor, Tensor]:
    """The flips and moves of `n` images of `size` pixels at augmentation strength `augment`
    (`draw_shift_flip` at `max_shift_for`; no flips unless `flip`), as `Batches` draws them."""
    flips, moves = draw_shift_flip(n, max_shift_for(augment, size), generator,
                                   WARP_TURN * augment, WARP_ZOOM * augment)
    return flips & flip, moves


def unmoved_views(n: int, augment: float, size: int) -> tuple[Tensor, Tensor]:
    """`n` views in `draw_views`' layout that leave each image as it is (no flip, no move; a
    warp's scale 1)."""
    shift = max_shift_for(augment, size)
    moves = torch.zeros(n, 4 if 0 < shift < 1 else 2)
    if 0 < shift < 1:
        moves[:, 3] = 1.0
    return torch.zeros(n, dtype=torch.bool), moves


@dataclass(frozen=True)
class RecordedViews:
    """One recorded augmentation per dataset id (a consistent feature bank's): where
    `recorded`, image `ids[i]` is shown flipped by `flips[i]` and moved by `moves[i]` (see
    `draw_shift_flip`) instead of by a fresh draw. `ids` sorted."""

    ids: Tensor
    flips: Tensor
    moves: Tensor
    recorded: Tensor

    @classmethod
    def of(cls, ids: Tensor, flips: Tensor, moves: Tensor) -> RecordedViews:
        """Views drawn for `ids` (any order), every one recorded."""
        order = ids.argsort()
        return cls(ids[order].long(), flips[order], moves[order].float(),
                   torch.ones(len(ids), dtype=torch.bool))

    def over(self, ids: Tensor, flips: Tensor, moves: Tensor) -> tuple[Tensor, Tensor]:
        """The drawn `flips` and `moves` of a batch of `ids`, with each recorded view in place
        of its image's draw."""
        ids = ids.cpu().long()
        rows = torch.searchsorted(self.ids, ids).clamp_(max=len(self.ids) - 1)
        known = (self.ids[rows] == ids) & self.recorded[rows]
        if self.moves.shape[1] != moves.shape[1]:
            raise ValueError(f"recorded views move by {self.moves.shape[1]} values, this "
                             f"augmentation by {moves.shape[1]}: the bank was written at "
                             "another augmentation strength or image size")
        return (torch.where(known, self.flips[rows], flips),
                torch.where(known[:, None], self.moves[rows].to(moves.dtype), moves))


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
            to `max_shift_for(augment, size)` pixels (4 * augment at 28 pixels); on images too
            small for a whole pixel, a warp (a fractional shift, a turn and a zoom).
        flip: whether the augmentation flips (half the images, horizontally); the draws are
            the same either way, so the shifts do not depend on it.
        device: where batches are produced.
        rank, world_size: under data-parallel training, this process's share of every batch:
            the images at positions `rank, rank + world_size, ...` of the batch all processes
            draw alike (same order, same augmentation), so the union over ranks is the batch
            one process would see.
        views: recorded views shown in place of the fresh draws of their images (the draws
            still happen, so the other images' augmentation does not change).
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
        views: RecordedViews | None = None,
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
        self.views = views
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
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            check_stop()  # an interrupted run's loops end within a batch (training.stopping)
            ids = order[start:start + self.batch_size]
            if self.augment > 0:
                flips, moves = draw_views(len(ids), self.augment, self.images.shape[-1],
                                          generator, self.flip)
                if self.views is not None:
                    flips, moves = self.views.over(ids, flips, moves)
            mine = slice(self.rank, None, self.world_size)
            ids = ids[mine]
            on_device = ids.to(self.device)
            x = self.images[on_device]
            if self.augment > 0:
                x = shift_flip(x, flips[mine], moves[mine])
            yield ids, self.normalize(x), self.labels[on_device]


def split_batches(data: LoadedDataset, dataset: DatasetShape, split: str, batch_size: int,
                  device: torch.device, shuffle: bool = False, seed: int = 0,
                  augment: float = 0.0, flip: bool = True) -> Batches:
    """Batches over one split of a loaded data set; a shuffled (training) pass drops a short
    last batch, so BatchNorm never sees a batch of one."""
    return Batches(data.images, data.labels, data.splits[split], batch_size,
                   Normalize(dataset.mean, dataset.std), shuffle=shuffle, seed=seed,
                   augment=augment, drop_last=shuffle, device=device, flip=flip)


def eval_batches(data: LoadedDataset, dataset: DatasetShape, split: str,
                 device: torch.device) -> Batches:
    """One split in order, unaugmented, in batches of the device's `inference_batch`: for
    scoring and predicting without gradients."""
    return position_batches(data, dataset, data.splits[split], device)


def position_batches(data: LoadedDataset, dataset: DatasetShape, positions: torch.Tensor,
                     device: torch.device) -> Batches:
    """`eval_batches` over the images at `positions` (a part of a split, such as the
    validation images a few-label run's choices read)."""
    return Batches(data.images, data.labels, positions, inference_batch(device),
                   Normalize(dataset.mean, dataset.std), device=device)
