"""How far a validation score can be trusted: shared by early stopping and PBT's choices."""

from __future__ import annotations

import math


def standard_error(accuracy: float, images: int) -> float:
    """The standard error of an accuracy measured on `images` images (binomial):
    `sqrt(accuracy * (1 - accuracy) / images)`; 3.6 points for 0.8 on 120 images."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / images)
