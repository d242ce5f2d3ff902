"""Contour recognition: the loss of a boundary-and-mask network and its two scores.

- Boundary F-measure with a pixel tolerance (the BSDS measure, in the form DAVIS computes it):
  a predicted boundary pixel is correct when a true boundary pixel lies within `tolerance`
  pixels (Euclidean: a disk), a true one is found when a predicted one lies within it.
  precision = correct / predicted, recall = found / true, summed over all images (BSDS's
  data-set-wide count at one threshold), F = 2PR / (P + R). BSDS also thins the prediction
  and matches pixels one to one; this count does neither, so a thick predicted boundary is
  paid for in precision only where it strays past the tolerance.
- Mask IoU: |predicted & true| / |predicted | true| per image (1 when both are empty),
  averaged over the images.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.device import autocast
from training.loops import Step

BOUNDARY_POS_WEIGHT = 10.0  # boundary pixels are ~3% of a canvas; weigh them up in the BCE


def disk(radius: int) -> Tensor:
    """A (2r+1) x (2r+1) float kernel, 1 where x^2 + y^2 <= r^2."""
    steps = torch.arange(-radius, radius + 1, dtype=torch.float32)
    return ((steps[:, None] ** 2 + steps[None, :] ** 2) <= radius**2).float()


def dilate(mask: Tensor, radius: int) -> Tensor:
    """Binary dilation of bool maps (..., H, W) by a disk of `radius` pixels."""
    if radius <= 0:
        return mask.bool()
    shape = mask.shape
    flat = mask.reshape(-1, 1, *shape[-2:]).float()
    kernel = disk(radius).to(flat.device)[None, None]
    return (F.conv2d(flat, kernel, padding=radius) > 0).reshape(shape)


def boundary_counts(predicted: Tensor, true: Tensor, tolerance: int) -> Tensor:
    """[correct predicted, predicted, found true, true] boundary pixels over the maps."""
    predicted, true = predicted.bool(), true.bool()
    return torch.tensor([float((predicted & dilate(true, tolerance)).sum()),
                         float(predicted.sum()),
                         float((true & dilate(predicted, tolerance)).sum()),
                         float(true.sum())])


def f_measure(counts: Tensor) -> dict[str, float]:
    """Precision, recall and F from `boundary_counts` (an empty side counts as perfect)."""
    correct, predicted, found, true = counts.tolist()
    precision = correct / predicted if predicted else 1.0
    recall = found / true if true else 1.0
    f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"boundary_precision": precision, "boundary_recall": recall, "boundary_f": f}


def mask_iou(predicted: Tensor, true: Tensor) -> Tensor:
    """IoU per image of bool masks (N, H, W); 1 where both are empty."""
    predicted, true = predicted.bool().flatten(1), true.bool().flatten(1)
    inter = (predicted & true).sum(1).float()
    union = (predicted | true).sum(1).float()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))


def contour_step(pos_weight: float = BOUNDARY_POS_WEIGHT) -> Step:
    """`loss = loss_boundary + loss_mask`: binary cross-entropies of the two logit maps against
    `y` (N x 2 x H x W: boundary, mask), boundary pixels weighted by `pos_weight`."""

    def step(model: nn.Module, _ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        logits = model(x).float()
        boundary = F.binary_cross_entropy_with_logits(
            logits[:, 0], y[:, 0], pos_weight=torch.tensor(pos_weight, device=logits.device))
        mask = F.binary_cross_entropy_with_logits(logits[:, 1], y[:, 1])
        return {"loss": boundary + mask, "loss_boundary": boundary, "loss_mask": mask}

    return step


@torch.no_grad()
def contour_scores(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor, Tensor]],
                   device: torch.device, tolerance: int = 2) -> dict[str, float]:
    """`boundary_f` (with `boundary_precision`, `boundary_recall`) at `tolerance` pixels and
    `mask_iou` of the network's maps thresholded at probability 0.5."""
    model.eval()
    counts, ious = torch.zeros(4), []
    for _, x, y in batches:
        with autocast(device):
            logits = model(x.to(device)).float().cpu()
        predicted = logits > 0  # sigmoid > 0.5
        counts += boundary_counts(predicted[:, 0], y[:, 0] > 0.5, tolerance)
        ious.append(mask_iou(predicted[:, 1], y[:, 1] > 0.5))
    return f_measure(counts) | {"mask_iou": torch.cat(ious).mean().item()}
