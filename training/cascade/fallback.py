"""A two-stage cascade: a small network answers the images it is confident about and a larger
one takes the rest (the `pipeline` flow's last step: the distilled, tuned, sparse student in
front of its teacher).

The student answers every image where, on the validation split, it alone is at most
`tolerance` less accurate than the teacher alone: the pipeline's promise is the small model,
and the teacher's time is spent only where the student cannot keep the big one's accuracy on
its own. Elsewhere the exit rule and its calibration are the `cascade` flow's
(`training.cascade.learning`): the student's confidence (max softmax) against one threshold,
chosen on validation as the cheapest that loses at most `tolerance` of the images the teacher
gets right (`ExitTable.losses_only`), with the measured time of each network as the cost; where
that cascade is no more accurate on validation than the student alone, the student keeps every
image. Inference is real: only the images the student passes on run through the teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.cascade import confidence_of
from training.cascade.learning import ExitTable, threshold_grid


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


def student_alone_stands(table: ExitTable, tolerance: float) -> bool:
    """Whether the student answers every image: its accuracy on `table` is at least the
    teacher's alone minus `tolerance` (a fraction of the images). One comparison of two fixed
    networks, so the net accuracy is counted (no threshold is searched that could spend the
    split's chance gains)."""
    student = table.correct[:, 0].float().mean().item()
    return student >= table.full_accuracy() - tolerance - 1e-9


def calibrate_fallback(table: ExitTable, tolerance: float) -> float:
    """0 (no image passes on: the student alone) where the student alone loses at most
    `tolerance` against the teacher alone (`student_alone_stands`); else the cheapest threshold
    on `table` that loses at most `tolerance` of what the teacher alone gets right, or 0 where
    that cascade is no more accurate on `table` than the student alone: the teacher's time
    must buy accuracy the student cannot keep on its own."""
    if student_alone_stands(table, tolerance):
        return 0.0
    threshold = float(threshold_grid(table.losses_only()).cheapest(table.full_accuracy()
                                                                   - tolerance)[0])
    student_alone = table.correct[:, 0].float().mean().item()
    if table.outcome(torch.tensor([threshold]))["accuracy"] <= student_alone:
        return 0.0
    return threshold


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
