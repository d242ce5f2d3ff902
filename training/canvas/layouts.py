"""Synthetic layouts of real objects, for detection and contour recognition.

No detection or contour data set ships in any package reachable here, so the project builds
one: real Fashion-MNIST items, each resized by a random scale, pasted at random
non-overlapping positions on a larger canvas over a distractor texture (smooth random
brightness, random strokes and pixel noise, as bright as the items, so a threshold cannot
find them). Per canvas it keeps:

- the image (uint8, 1 x S x S);
- the instance map (uint8, S x S): 0 for the background, k for the k-th object's pixels (an
  item's pixels above `MASK_LEVEL` after resizing; the item's dark gaps stay background);
- per object its box (x1, y1, x2, y2, pixel edges: the mask spans columns x1 .. x2 - 1) and
  class index.

The contour label is the instance map's boundary (`boundaries`): object pixels with a
4-neighbour outside the object. Everything is deterministic from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MASK_LEVEL = 32  # an item's pixel (0-255, after resizing) at or above this is the object
ITEM = 28


@dataclass(frozen=True)
class LayoutSpec:
    """How canvases are drawn."""

    canvas: int = 128
    min_objects: int = 1
    max_objects: int = 4
    min_scale: float = 0.75  # an item's side on the canvas: 28 x scale pixels
    max_scale: float = 1.75
    texture: float = 0.6  # the texture's brightest value, as a share of 255
    strokes: int = 6  # the most random line strokes per canvas
    noise: float = 8.0  # pixel noise std (0-255 scale)

    def __post_init__(self) -> None:
        side = round(ITEM * self.max_scale)
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(f"need 1 <= min_objects <= max_objects, got {self.min_objects} "
                             f"and {self.max_objects}")
        if not 0 < self.min_scale <= self.max_scale or side > self.canvas:
            raise ValueError(f"scales {self.min_scale}..{self.max_scale} must be > 0 and give "
                             f"items that fit a canvas of {self.canvas} pixels")


@dataclass
class Layouts:
    """Canvases with their objects (see the module docstring)."""

    images: Tensor  # (N, 1, S, S) uint8
    instances: Tensor  # (N, S, S) uint8
    boxes: list[Tensor]  # per canvas (k, 4) float32
    labels: list[Tensor]  # per canvas (k,) int64
    sources: list[Tensor]  # per canvas (k,) int64: the items' indices in the source set

    def __len__(self) -> int:
        return len(self.images)

    def state(self) -> dict:
        return {"images": self.images, "instances": self.instances, "boxes": self.boxes,
                "labels": self.labels, "sources": self.sources}

    @classmethod
    def from_state(cls, state: dict) -> Layouts:
        return cls(**{key: state[key] for key in ("images", "instances", "boxes", "labels",
                                                  "sources")})

    def subset(self, index: Tensor) -> Layouts:
        rows = index.tolist()
        return Layouts(self.images[index], self.instances[index],
                       [self.boxes[i] for i in rows], [self.labels[i] for i in rows],
                       [self.sources[i] for i in rows])


def _texture(spec: LayoutSpec, generator: torch.Generator) -> Tensor:
    """A distractor background (S x S float, 0-255)."""
    size = spec.canvas
    coarse = torch.rand(1, 1, 6, 6, generator=generator)
    smooth = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)[0, 0]
    smooth = (smooth - smooth.min()) / (smooth.max() - smooth.min()).clamp_min(1e-6)
    peak = 255.0 * spec.texture * (0.4 + 0.6 * torch.rand((), generator=generator).item())
    canvas = smooth * peak
    strokes = int(torch.randint(0, spec.strokes + 1, (), generator=generator))
    steps = torch.linspace(0, 1, 2 * size)
    for _ in range(strokes):
        start, end = torch.rand(2, 2, generator=generator) * (size - 1)
        points = (start + steps[:, None] * (end - start)).round().long()
        brightness = 255.0 * spec.texture * torch.rand((), generator=generator).item()
        width = int(torch.randint(1, 3, (), generator=generator))
        for dy in range(width):
            rows = (points[:, 1] + dy).clamp(0, size - 1)
            canvas[rows, points[:, 0]] = brightness
    canvas += torch.randn(size, size, generator=generator) * spec.noise
    return canvas.clamp(0, 255)


def _free(box: tuple[int, int, int, int], taken: list[tuple[int, int, int, int]],
          margin: int = 2) -> bool:
    x1, y1, x2, y2 = box
    return all(x1 >= b[2] + margin or b[0] >= x2 + margin or y1 >= b[3] + margin
               or b[1] >= y2 + margin for b in taken)


def make_layouts(items: Tensor, labels: Tensor, count: int, spec: LayoutSpec, seed: int,
                 tries: int = 30) -> Layouts:
    """`count` canvases of the items (N x 28 x 28 uint8, their class indices `labels`)."""
    if items.dim() != 3 or items.shape[1:] != (ITEM, ITEM):
        raise ValueError(f"items must be N x {ITEM} x {ITEM}, got {tuple(items.shape)}")
    generator = torch.Generator().manual_seed(seed)
    size = spec.canvas
    images = torch.zeros(count, 1, size, size, dtype=torch.uint8)
    instances = torch.zeros(count, size, size, dtype=torch.uint8)
    all_boxes, all_labels, all_sources = [], [], []
    for n in range(count):
        canvas = _texture(spec, generator)
        wanted = int(torch.randint(spec.min_objects, spec.max_objects + 1, (),
                                   generator=generator))
        taken: list[tuple[int, int, int, int]] = []
        boxes, classes, sources = [], [], []
        for _ in range(wanted):
            source = int(torch.randint(len(items), (), generator=generator))
            scale = spec.min_scale + (spec.max_scale - spec.min_scale) * torch.rand(
                (), generator=generator).item()
            side = round(ITEM * scale)
            item = F.interpolate(items[source][None, None].float(), size=(side, side),
                                 mode="bilinear", antialias=True, align_corners=False)[0, 0]
            mask = item >= MASK_LEVEL
            if not mask.any():
                continue
            ys, xs = mask.nonzero(as_tuple=True)
            for _ in range(tries):
                top, left = (torch.randint(0, size - side + 1, (2,), generator=generator)
                             .tolist())
                box = (left + int(xs.min()), top + int(ys.min()), left + int(xs.max()) + 1,
                       top + int(ys.max()) + 1)
                if _free(box, taken):
                    break
            else:
                continue
            taken.append(box)
            region = canvas[top:top + side, left:left + side]
            region[mask] = item[mask]
            instances[n, top:top + side, left:left + side][mask] = len(taken)
            boxes.append(box)
            classes.append(int(labels[source]))
            sources.append(source)
        images[n, 0] = canvas.round().to(torch.uint8)
        all_boxes.append(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        all_labels.append(torch.tensor(classes, dtype=torch.int64))
        all_sources.append(torch.tensor(sources, dtype=torch.int64))
    return Layouts(images, instances, all_boxes, all_labels, all_sources)


def boundaries(instances: Tensor) -> Tensor:
    """Boundary maps (bool, same shape as `instances`: (..., H, W)): object pixels (id > 0)
    with a 4-neighbour of another id (the background or another object). Pixels past the
    image's edge count as background."""
    padded = F.pad(instances.long(), (1, 1, 1, 1))
    centre = padded[..., 1:-1, 1:-1]
    edge = torch.zeros_like(centre, dtype=torch.bool)
    for dy, dx in ((0, 1), (2, 1), (1, 0), (1, 2)):
        neighbour = padded[..., dy:dy + centre.shape[-2], dx:dx + centre.shape[-1]]
        edge |= neighbour != centre
    return edge & (centre > 0)


TARGETS = ("boxes", "contours")


class LayoutBatches:
    """`(ids, x, y)` batches of canvases: `x` float in [0, 1] (B x 1 x S x S) on `device`; `y`
    for `boxes` the list of detection targets (`boxes`, `labels` = class index + 1, 0 being
    the background), for `contours` B x 2 x S x S floats (boundary, mask). With a `generator`,
    every pass shuffles and flips half the canvases horizontally (boxes and maps with them)."""

    def __init__(self, layouts: Layouts, target: str, batch_size: int, device: torch.device,
                 generator: torch.Generator | None = None) -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self.layouts, self.target, self.batch_size = layouts, target, batch_size
        self.device, self.generator = device, generator

    def __len__(self) -> int:
        return -(-len(self.layouts) // self.batch_size)

    def __iter__(self):
        count = len(self.layouts)
        order = (torch.randperm(count, generator=self.generator) if self.generator is not None
                 else torch.arange(count))
        for start in range(0, count, self.batch_size):
            ids = order[start:start + self.batch_size]
            flips = (torch.rand(len(ids), generator=self.generator) < 0.5
                     if self.generator is not None else torch.zeros(len(ids), dtype=torch.bool))
            yield ids, *self._batch(ids, flips)

    def _batch(self, ids: Tensor, flips: Tensor):
        images = self.layouts.images[ids]
        instances = self.layouts.instances[ids]
        images = torch.where(flips[:, None, None, None], images.flip(-1), images)
        instances = torch.where(flips[:, None, None], instances.flip(-1), instances)
        x = images.to(self.device).float() / 255.0
        if self.target == "contours":
            y = torch.stack([boundaries(instances), instances > 0], 1).float()
            return x, y.to(self.device)
        size = images.shape[-1]
        targets = []
        for row, flipped in zip(ids.tolist(), flips.tolist(), strict=True):
            boxes = self.layouts.boxes[row].clone()
            if flipped:
                boxes[:, [0, 2]] = size - boxes[:, [2, 0]]
            targets.append({"boxes": boxes.to(self.device),
                            "labels": (self.layouts.labels[row] + 1).to(self.device)})
        return x, targets
