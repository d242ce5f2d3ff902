"""A canvas round's parts (`training.rounds`): the task's step and the shuffled layouts.

Canvas rounds train in one process only: a `LayoutBatches` pass has no per-process shares,
so the `sparsify` flow refuses `--ddp-procs` for detection and contour.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from training.canvas.contours import contour_step
from training.canvas.detection import detection_step
from training.canvas.layouts import LayoutBatches, Layouts
from training.distributed import Distributed
from training.loops import Step
from training.rounds import ModelStep

TARGET = {"detection": "boxes", "contour": "contours"}  # the task's `LayoutBatches` target


@dataclass(frozen=True)
class CanvasStep(ModelStep):
    """The task's loss on canvases: `detection_step` or `contour_step`."""

    task: Literal["detection", "contour"]

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        if place.world_size > 1:
            raise ValueError(f"a {self.task} round trains in one process only")
        return model, detection_step() if self.task == "detection" else contour_step()


@dataclass(frozen=True)
class LayoutPasses:
    """Each pass over `layouts` shuffled and half flipped from its own generator, seeded by
    `seed * 100_003 + pass`."""

    layouts: Layouts
    task: Literal["detection", "contour"]
    batch_size: int
    seed: int

    def for_passes(self, device: torch.device, place: Distributed
                   ) -> Callable[[int], LayoutBatches]:
        def batches(pass_index: int) -> LayoutBatches:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + pass_index)
            return LayoutBatches(self.layouts, TARGET[self.task], self.batch_size, device,
                                 generator)

        return batches
