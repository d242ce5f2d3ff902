"""Detection on layout canvases: the detector's training step, its predictions and mAP.

The losses are the torchvision detector's own (`bbox_regression` + `classification` for
SSD), mAP@0.5 is torchmetrics' `MeanAveragePrecision` (COCO's evaluation through
pycocotools). Labels: class index + 1, 0 being the background.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from training.device import autocast
from training.loops import Step


def as_rgb(x: Tensor) -> list[Tensor]:
    """A batch of gray or colour images in [0, 1] as the list of 3-channel images a
    torchvision detector takes."""
    return list(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x)


def detection_step() -> Step:
    """The detector's own losses summed: `loss = loss_bbox_regression + loss_classification`
    (each also reported). `y` is the list of targets (`boxes`, `labels`)."""

    def step(model: nn.Module, _ids: Tensor, x: Tensor, y: list[dict]) -> dict[str, Tensor]:
        losses = model(as_rgb(x), y)
        named = {f"loss_{key}": value for key, value in losses.items()}
        return {"loss": sum(named.values())} | named

    return step


@torch.no_grad()
def detect(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor, list[dict]]],
           device: torch.device) -> tuple[list[dict], list[dict]]:
    """Predictions (`boxes`, `scores`, `labels`, on the CPU) and targets of every canvas."""
    model.eval()
    predictions, targets = [], []
    for _, x, y in batches:
        with autocast(device):
            out = model(as_rgb(x.to(device)))
        predictions += [{"boxes": o["boxes"].float().cpu(), "scores": o["scores"].float().cpu(),
                         "labels": o["labels"].cpu()} for o in out]
        targets += [{k: v.cpu() for k, v in t.items()} for t in y]
    return predictions, targets


def mean_average_precision(predictions: list[dict], targets: list[dict]) -> dict[str, float]:
    """`map_50`: mAP at IoU 0.5 over the classes (COCO's 101-point interpolation, the 100
    highest-scoring boxes per image), and `map` (IoU 0.5:0.95), by torchmetrics."""
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox")
    metric.warn_on_many_detections = False
    metric.update(predictions, targets)
    result = metric.compute()
    return {"map_50": float(result["map_50"]), "map": float(result["map"])}
