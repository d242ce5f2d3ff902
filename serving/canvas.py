"""The registered canvas models (detection and contour): MLflow pyfuncs that take raw images.

Inputs as the classifier's (`serving.inputs`): a DataFrame with a column `image`
of encoded bytes (or their base64 text), or a uint8 array N x H x W (x C). Each image is turned
gray and resized to the canvas the network was trained on; the outputs are in the input
image's own pixels:
- detection: one row per image with `boxes` (a list of [x1, y1, x2, y2]), `labels` (class
  names) and `scores`, the detector's boxes scoring at least `min_score` (default 0.05, a
  `params` entry);
- contour: one row per image with `boundary` (H x W uint8, 1 on the predicted object
  boundaries) and `mask` (H x W uint8, 1 on the objects).
The network is rebuilt from its name (`models.canvas`) and its stored weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from models.canvas import build_task_model
from serving.inputs import input_images
from training.canvas.detection import as_rgb
from training.preprocess import images_to_batch

MIN_SCORE = 0.05
CHUNK = 64


class CanvasModel(mlflow.pyfunc.PythonModel):
    """Raw images in; boxes, labels and scores (detection) or boundary and mask maps (contour)
    out (see the module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        meta = json.loads(Path(context.artifacts["meta"]).read_text())
        self.task: str = meta["task"]
        self.classes: list[str] = meta["classes"]
        self.canvas: int = meta["canvas"]
        self.network = build_task_model(self.task, meta["model"], len(self.classes),
                                        self.canvas, meta.get("width"))
        self.network.load_state_dict(torch.load(context.artifacts["weights"],
                                                map_location="cpu", weights_only=True))
        self.network.eval()

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        images = input_images(model_input)
        min_score = float((params or {}).get("min_score", MIN_SCORE))
        rows = []
        with torch.no_grad():
            for start in range(0, len(images), CHUNK):
                chunk = images[start:start + CHUNK]
                x = images_to_batch(chunk, self.canvas, 1).float() / 255.0
                sizes = [image.size for image in chunk]  # (width, height)
                rows += (self._detections(x, sizes, min_score) if self.task == "detection"
                         else self._contours(x, sizes))
        return pd.DataFrame(rows)

    def _detections(self, x: torch.Tensor, sizes: list, min_score: float) -> list[dict]:
        rows = []
        for out, (width, height) in zip(self.network(as_rgb(x)), sizes, strict=True):
            keep = out["scores"] >= min_score
            scale = torch.tensor([width, height, width, height]) / self.canvas
            rows.append({"boxes": (out["boxes"][keep] * scale).tolist(),
                         "labels": [self.classes[i - 1] for i in out["labels"][keep].tolist()],
                         "scores": out["scores"][keep].tolist()})
        return rows

    def _contours(self, x: torch.Tensor, sizes: list) -> list[dict]:
        rows = []
        for logits, (width, height) in zip(self.network(x), sizes, strict=True):
            maps = F.interpolate(logits[None].float(), size=(height, width), mode="bilinear",
                                 align_corners=False)[0] > 0
            rows.append({"boundary": maps[0].to(torch.uint8).numpy(),
                         "mask": maps[1].to(torch.uint8).numpy()})
        return rows


def served_scores(task: str, predictions: pd.DataFrame, layouts: Any, classes: list[str],
                  tolerance: int) -> dict[str, float]:
    """The task's scores of a pyfunc's `predictions` for canvases `layouts`
    (`training.canvas.layouts.Layouts` of `classes`): `map_50` and `map`, or `boundary_f` (its
    precision and recall) and `mask_iou`."""
    from training.canvas.contours import boundary_counts, f_measure, mask_iou
    from training.canvas.detection import mean_average_precision
    from training.canvas.layouts import boundaries

    if task == "detection":
        index = {name: i for i, name in enumerate(classes)}
        found = [{"boxes": torch.tensor(row.boxes, dtype=torch.float32).reshape(-1, 4),
                  "scores": torch.tensor(row.scores, dtype=torch.float32),
                  "labels": torch.tensor([index[n] + 1 for n in row.labels],
                                         dtype=torch.int64)}
                 for row in predictions.itertuples()]
        truth = [{"boxes": b, "labels": lab + 1}
                 for b, lab in zip(layouts.boxes, layouts.labels, strict=True)]
        return mean_average_precision(found, truth)
    boundary = torch.from_numpy(np.stack(predictions["boundary"].tolist())).bool()
    mask = torch.from_numpy(np.stack(predictions["mask"].tolist())).bool()
    counts = boundary_counts(boundary, boundaries(layouts.instances), tolerance)
    return f_measure(counts) | {"mask_iou": mask_iou(mask, layouts.instances > 0).mean().item()}
