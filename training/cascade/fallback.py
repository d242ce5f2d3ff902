"""A two-stage cascade: a small network answers the images it is confident about and a larger
one takes the rest (the `pipeline` flow's last step: the distilled, tuned, sparse student in
front of its teacher).

The exit rule and its calibration are the `cascade` flow's (`training.cascade.learning`): the
student's confidence (max softmax) against one threshold, chosen on the validation split as
the cheapest that loses at most `tolerance` of the images the teacher gets right
(`ExitTable.losses_only`), with the measured time of each network as the cost. Where that
cascade is at most `tolerance` more accurate on validation than the student alone, the student
answers every image and is registered alone: the pipeline's promise is the small model, and
the teacher's time is spent only where it buys more than the accuracy the pipeline may trade
for it. Inference is real: only the images the student passes on run through the teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.cascade import confidence_of
from training.cascade.learning import ExitTable, threshold_grid
from training.promotion import discordant


def fallback_table(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor,
                   student_cost: float, teacher_cost: float, score: Tensor | None = None
                   ) -> ExitTable:
    """The two exits' confidence, correctness and cumulative cost for every image: exit 0
    is the student alone, exit 1 the student then the teacher. `score`: what decides at exit
    0 instead of the student's confidence (a fitted predictor's, `training.cascade.routing`;
    its time belongs in `student_cost`)."""
    student_conf, student_pred = confidence_of(student_logits)
    if score is not None:
        student_conf = score.to(student_conf.device).float()
    teacher_conf, teacher_pred = confidence_of(teacher_logits)
    count = len(labels)
    cost = torch.tensor([student_cost, student_cost + teacher_cost]).expand(count, 2)
    return ExitTable(torch.stack([student_conf, teacher_conf], 1).cpu(),
                     torch.stack([student_pred == labels, teacher_pred == labels], 1).cpu(),
                     cost.clone())


def calibrate_fallback(table: ExitTable, tolerance: float) -> float:
    """The cheapest threshold on `table` that loses at most `tolerance` (a fraction of the
    images) of what the teacher alone gets right; 0 (no image passes on: the student alone)
    where that cascade is at most `tolerance` more accurate (net) on `table` than the student
    alone: the teacher's time must buy more accuracy than the pipeline may trade for the small
    model (at 0: any accuracy; at 1: the student alone always)."""
    threshold = float(threshold_grid(table.losses_only()).cheapest(table.full_accuracy()
                                                                   - tolerance)[0])
    student_alone = table.correct[:, 0].float().mean().item()
    cascade = table.outcome(torch.tensor([threshold]))["accuracy"]
    return 0.0 if cascade <= student_alone + tolerance + 1e-9 else threshold


def cascade_evidence(table: ExitTable, threshold: float) -> tuple[int, int, float]:
    """The cascade at `threshold` against the student alone on `table`'s images, paired:
    the images only the cascade gets right, those only the student gets right, and McNemar's
    exact one-sided p-value that the cascade is better (`training.promotion.discordant`, the
    registry's test)."""
    exits = table.exits(torch.tensor([threshold]))
    return discordant(table.correct[torch.arange(len(exits)), exits], table.correct[:, 0])


@dataclass
class FallbackOutput:
    """Per image: the predicted class, its confidence, and the exit taken (0: the student,
    1: the teacher)."""

    labels: Tensor
    confidence: Tensor
    exits: Tensor


@torch.no_grad()
def fallback_infer(student: Callable[[Tensor], Tensor], teacher: Callable[[Tensor], Tensor],
                   images: Tensor, threshold: float,
                   router: Callable[[Tensor], Tensor] | None = None) -> FallbackOutput:
    """Runs the student on `images`; the images whose confidence (with a `router`: its score
    of the student's logits) is at most `threshold` (1: all of them) run through the teacher,
    whose answer replaces the student's."""
    logits = student(images)
    confidence, labels = confidence_of(logits)
    decision = confidence if router is None else router(logits)
    exits = torch.zeros_like(labels)
    passed = (decision <= threshold).nonzero().flatten()
    if len(passed):
        late_conf, late_labels = confidence_of(teacher(images[passed]))
        confidence, labels = confidence.clone(), labels.clone()
        confidence[passed], labels[passed], exits[passed] = late_conf, late_labels, 1
    return FallbackOutput(labels=labels, confidence=confidence, exits=exits)
