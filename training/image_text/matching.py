"""Near-duplicate matching of images against a pool of image-text pairs ("from the web").

Each image becomes a signature: gray, resized to a common size (resizing), shifted so that its
centre of mass is the centre (shifts), mean removed and L2-normalized (brightness, contrast,
recompression noise). A query's similarity to a pool item is the larger cosine of its
signature with the item's and with the mirrored item's (flips). A query matches its most
similar item when that cosine is at least `threshold` and beats the second most similar item
by at least `margin` (Lowe's ratio test, as a difference): many garments look alike, and the
margin keeps a look-alike from passing as a copy.

A pool is a table of image-text pairs (`folder_pool`: a user's folder and its `captions.csv`);
`match_training_images` hands a matched training image its pool item's texts.

A DCT perceptual hash (imagehash's `phash`) was tried first: on 28-pixel Fashion-MNIST items
it found at most a quarter of the true copies, whatever its threshold (docs/image_text.md).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from training.datasets import IMAGE_EXTENSIONS, LoadedDataset
from training.image_text.descriptions import DescriptionError, read_descriptions

NO_MATCH = -1
SIGNATURE_SIZE = 28


def to_pil(image: Tensor) -> Image.Image:
    """A uint8 C x H x W image as a PIL image (gray or RGB)."""
    array = image.permute(1, 2, 0).numpy()
    return Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)


def signatures(images: list[Image.Image], mirrored: bool = False,
               size: int = SIGNATURE_SIZE) -> Tensor:
    """N x size^2: each image gray at `size` pixels, its centre of mass moved to the centre
    (whole pixels, wrapping round), mean removed, L2-normalized (mirrored with `mirrored`)."""
    gray = [image.convert("L").resize((size, size), Image.Resampling.BILINEAR)
            for image in images]
    if mirrored:
        gray = [image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image in gray]
    x = torch.from_numpy(np.stack([np.asarray(g, dtype=np.float32) for g in gray])) / 255
    positions = torch.arange(size, dtype=torch.float32)
    mass = x.sum((1, 2)).clamp(min=1e-6)
    centre = (size - 1) / 2
    dy = (centre - (x.sum(2) * positions).sum(1) / mass).round().long()
    dx = (centre - (x.sum(1) * positions).sum(1) / mass).round().long()
    centred = torch.stack([torch.roll(x[i], (int(dy[i]), int(dx[i])), (0, 1))
                           for i in range(len(x))])
    centred = centred - centred.mean((1, 2), keepdim=True)
    return F.normalize(centred.flatten(1), dim=1)


def match(queries: Tensor, pool: Tensor, pool_mirrored: Tensor, threshold: float,
          margin: float) -> tuple[Tensor, Tensor]:
    """Per query signature: the matched pool index (`NO_MATCH` where none passes) and the
    best cosine (with a pool item as it is or mirrored)."""
    similarity = torch.maximum(queries @ pool.T, queries @ pool_mirrored.T)
    if similarity.shape[1] < 2:  # a pool of one: nothing to tell it from
        similarity = torch.cat([similarity, similarity.new_full((len(queries), 1), -1.0)], 1)
    top = similarity.topk(2, dim=1)
    passed = (top.values[:, 0] >= threshold) & (top.values[:, 0] - top.values[:, 1] >= margin)
    return torch.where(passed, top.indices[:, 0], NO_MATCH), top.values[:, 0]


def transformed_copy(image: Image.Image, generator: torch.Generator) -> Image.Image:
    """A web copy of `image`: shifted (up to 2 pixels at the original size), resized
    (0.8-2x), flipped half the time, saved as JPEG (quality 40-90) and read back."""
    def draw(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand(1, generator=generator))

    width, height = image.size
    scale = draw(0.8, 2.0)
    dx, dy = round(draw(-2, 2)), round(draw(-2, 2))
    shifted = image.transform(image.size, Image.Transform.AFFINE, (1, 0, -dx, 0, 1, -dy))
    copy = shifted.resize((max(8, round(width * scale)), max(8, round(height * scale))),
                          Image.Resampling.BILINEAR)
    if draw(0, 1) < 0.5:
        copy = copy.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    buffer = io.BytesIO()
    copy.save(buffer, format="JPEG", quality=round(draw(40, 90)))
    buffer.seek(0)
    return Image.open(buffer).convert(image.mode)


def precision_recall(found: Tensor, truth: Tensor) -> dict[str, float]:
    """`found`, `truth`: per query, a pool index or `NO_MATCH`. Precision: the share of the
    matches made that are the true one; recall: the share of the true matches found."""
    made, present = found != NO_MATCH, truth != NO_MATCH
    correct = made & (found == truth)
    return {"precision": float(correct.sum()) / max(int(made.sum()), 1),
            "recall": float(correct.sum()) / max(int(present.sum()), 1),
            "matched": int(made.sum()), "true_matches": int(present.sum())}


POOL_CAPTIONS = "captions.csv"


def png_bytes(image: Image.Image) -> bytes:
    """`image` encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def folder_pool(folder: str) -> pd.DataFrame:
    """A user's pool: the images of `folder` named by its `captions.csv` (their paths inside
    the folder), with the table's texts and weights; `source` unknown (-1)."""
    root = Path(folder)
    table = read_descriptions(str(root / POOL_CAPTIONS), "image")
    names = sorted(set(table["image"]))
    missing = [n for n in names if not (root / n).is_file()
               or (root / n).suffix.lower() not in IMAGE_EXTENSIONS]
    if missing:
        raise DescriptionError(f"{root / POOL_CAPTIONS}: {len(missing)} images missing or not "
                               f"images, e.g. {', '.join(missing[:5])}")
    item = {name: i for i, name in enumerate(names)}
    return pd.DataFrame({"item": table["image"].map(item),
                         "image": table["image"].map(lambda n: (root / n).read_bytes()),
                         "text": table["text"], "weight": table["weight"],
                         "source": NO_MATCH}).sort_values("item", kind="stable")


def match_training_images(data: LoadedDataset, pool: pd.DataFrame, threshold: float,
                          margin: float) -> tuple[pd.DataFrame, dict[str, float]]:
    """The training images matched against the pool: their captions (position, text,
    weight, kind `matched`), and the matching's figures (precision and recall where the pool
    knows its true matches)."""
    items = pool.drop_duplicates("item").set_index("item").sort_index()
    train = data.splits["train"]
    if len(items) == 0:  # nothing to match against: the captioner describes every image
        return (pd.DataFrame({"position": pd.Series(dtype=int), "text": pd.Series(dtype=str),
                              "weight": pd.Series(dtype=float), "kind": pd.Series(dtype=str)}),
                {"pool_items": 0, "matched_images": 0})
    pool_images = [Image.open(io.BytesIO(b)) for b in items["image"]]
    queries = signatures([to_pil(data.images[p]) for p in train.tolist()])
    found, _ = match(queries, signatures(pool_images), signatures(pool_images, mirrored=True),
                     threshold, margin)
    truth_of = {int(s): int(i) for i, s in items["source"].items() if s != NO_MATCH}
    truth = torch.tensor([truth_of.get(p, NO_MATCH) for p in train.tolist()])
    figures = {"pool_items": len(items), "matched_images": int((found != NO_MATCH).sum())}
    if truth_of:
        figures |= {f"match_{k}": v for k, v in precision_recall(found, truth).items()}
    pairs = pd.DataFrame({"position": train.tolist(), "item": found.tolist()})
    rows = pairs[pairs["item"] != NO_MATCH].merge(pool[["item", "text", "weight"]], on="item")
    captions = pd.DataFrame({"position": rows["position"], "text": rows["text"],
                             "weight": rows["weight"], "kind": "matched"})
    return captions, figures
