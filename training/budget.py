"""Training budgets that fit the data: optimizer steps as well as rounds.

A round is what a flow repeats (one task, one checkpoint, validation after it); an epoch is one
pass over the training images. A budget given only in rounds of one pass starves a small data
set: 8 passes over 1,000 images at batch 128 are 56 optimizer steps, far too few to learn
anything. `fit_budget` keeps one pass a round for a large data set and, for a small one,

- lowers the batch so that an epoch has at least `min_batches` steps (a power of two, never
  below `min_batch`, never above the configured batch), and
- repeats the pass of every round `repeats` times, the smallest whole number that gives at
  least `min_steps` optimizer steps in all, capped so that no run exceeds `max_epochs` passes.
  The minimum counts steps of the configured batch: a batch lowered to fit the data takes
  proportionally more steps (a quarter of the batch, four times the steps), so lowering it
  never cuts the images a run sees. Without this a set of 360 images (batch 32) saw a quarter
  of what one of 1,080 (batch 128) saw, fewer passes for less data; with it both reach the
  `max_epochs` cap or the same images seen, whichever comes first.

The minimum is `min_steps` in full up to `full_below` training images and shrinks in
proportion above them (`min_steps x full_below / images`), so the passes grow faster than the
data shrinks: a set of 1,000 images needs hundreds of passes to learn what it can (on 8-pixel
Fashion-MNIST, 1,000 steps left the `distill` student 2.8 points below `lenet` trained long,
3,000 steps 0.2), while 18,000 images at the configured 8 rounds (1,120 steps) are past it.

`repeats` is one number per run, so every schedule built on rounds (a cosine over the run, PBT
rounds, distillation stages) stretches alike: a flow trains `rounds x repeats` passes as
`rounds` rounds of `repeats` passes each, and checks validation (early stopping, PBT's choice)
once per round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.settings import DatasetShape, OptimizedSettings, OptimSettings


@dataclass(frozen=True)
class Budget:
    """How a run trains on its data set.

    Attributes:
        batch_size: images per optimizer step.
        steps_per_epoch: optimizer steps in one pass (a short last batch is dropped).
        repeats: passes per round (1 for a large data set).
        rounds: the configured rounds (or stages): validation is checked once per round.
    """

    batch_size: int
    steps_per_epoch: int
    repeats: int
    rounds: int

    @property
    def epochs(self) -> int:
        """Passes over the training images in all: `rounds x repeats`."""
        return self.rounds * self.repeats

    @property
    def steps(self) -> int:
        """Optimizer steps in all."""
        return self.epochs * self.steps_per_epoch


def fitted_batch_size(images: int, batch_size: int, min_batches: int = 8,
                      min_batch: int = 16) -> int:
    """The batch for `images` training images: `batch_size`, lowered to the largest power of
    two that still gives `min_batches` steps per epoch, but not below `min_batch` (nor above
    the number of images)."""
    if images < 1 or batch_size < 1:
        raise ValueError(f"need at least one image and a batch of one, got {images}, "
                         f"{batch_size}")
    if batch_size * min_batches <= images:
        return batch_size
    fitting = 2 ** int(math.log2(max(images // min_batches, 1)))
    return max(min(fitting, batch_size), min(min_batch, batch_size, images))


def needed_steps(images: int, min_steps: int, full_below: int | None) -> int:
    """The minimum steps for `images` training images: `min_steps` up to `full_below` images,
    `min_steps x full_below / images` above (`None`: `min_steps` whatever the size)."""
    if full_below is None or images <= full_below:
        return min_steps
    return math.ceil(min_steps * full_below / images)


def fit_budget(images: int, batch_size: int, rounds: int, min_steps: int | None,
               max_epochs: int, images_per_round: int | None = None,
               full_below: int | None = None) -> Budget:
    """The budget of a run of `rounds` rounds on `images` training images.

    Args:
        images: training images (after the validation split).
        batch_size: the configured batch.
        rounds: the configured rounds (or PBT rounds, or distillation stages).
        min_steps: at least this many optimizer steps of `batch_size` images in all (a lowered
            batch takes proportionally more); `None` keeps the configured batch and one pass a
            round.
        max_epochs: never more passes than this in all (repeats are capped to fit).
        images_per_round: images one round passes over, when a round draws a subset (a
            distillation stage draws a fraction of the training images); default `images`.
        full_below: `min_steps` holds in full up to this many training images and shrinks in
            proportion above (`needed_steps`); `None`: in full whatever the size.
    """
    if rounds < 1 or max_epochs < 1:
        raise ValueError(f"need rounds >= 1 and max_epochs >= 1, got {rounds}, {max_epochs}")
    seen = images if images_per_round is None else images_per_round
    if min_steps is None:
        return Budget(batch_size, max(seen // batch_size, 1), 1, rounds)
    batch = fitted_batch_size(seen, batch_size)
    per_round = max(seen // batch, 1)
    needed = needed_steps(images, min_steps, full_below) * batch_size / batch  # same images
    repeats = max(1, math.ceil(needed / (rounds * per_round)))
    repeats = max(1, min(repeats, max_epochs // rounds))
    return Budget(batch, per_round, repeats, rounds)


def fit_optim(optim: OptimSettings, images: int, rounds: int,
              images_per_round: int | None = None) -> Budget:
    """The budget of `rounds` rounds on `images` training images with `optim`'s batch and
    step settings (`fit_budget`)."""
    return fit_budget(images, optim.batch_size, rounds, optim.min_steps, optim.max_epochs,
                      images_per_round, optim.min_steps_full_below)


def fit_to_data(config: OptimizedSettings, dataset: DatasetShape, rounds: int,
                images_per_round: int | None = None) -> Budget:
    """The budget of a run of `rounds` rounds (or stages) of `config` on
    `dataset`'s training split (`fit_optim`)."""
    return fit_optim(config.optim, dataset.sizes["train"], rounds, images_per_round)
