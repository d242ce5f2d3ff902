"""Networks of the canvas tasks (`sparsify --task detection|contour`), by task and name."""

from __future__ import annotations

from torch import nn

from models.contour import ContourNet
from models.detection import SSDLITE, SSDLITE_SPARSE_LAYERS, build_ssdlite

TASK_MODELS = {"detection": (SSDLITE,), "contour": ("contour_unet",)}
SPARSE_LAYERS = {SSDLITE: SSDLITE_SPARSE_LAYERS,
                 "contour_unet": tuple(ContourNet.feature_layers)}


def build_task_model(task: str, name: str, num_classes: int, canvas: int,
                     width: int | None = None) -> nn.Module:
    """The untrained network `name` of `task` (one of `TASK_MODELS[task]`)."""
    if name not in TASK_MODELS.get(task, ()):
        raise ValueError(f"unknown {task} model {name!r}; choose one of "
                         f"{list(TASK_MODELS.get(task, ()))}")
    if task == "detection":
        return build_ssdlite(num_classes, canvas)
    return ContourNet(1, width or ContourNet.DEFAULT_WIDTH)
