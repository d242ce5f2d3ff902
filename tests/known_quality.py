"""Models of known quality for registry tests: per-image evidence with a given accuracy.

Every model is right on the images whose fixed uniform draw is below its accuracy, so a better
model is right wherever a worse one is (the discordant images all favour it) and the paired
test's outcome follows from the two accuracies alone: on 400 images, 0.9 against 0.95 differ
on 20 images (p = 2^-20), 0.9 against 0.9025 on one (p = 0.5).
"""

from __future__ import annotations

import numpy as np

from training.promotion import Correct

IMAGES = 400
_DRAW = (np.arange(IMAGES) + 0.5) / IMAGES  # evenly spread: exact counts


def known(accuracy: float, images: int = IMAGES) -> Correct:
    """A model right on round(`accuracy` x `images`) of the same `images` images."""
    draw = _DRAW if images == IMAGES else (np.arange(images) + 0.5) / images
    return Correct(draw < accuracy)
