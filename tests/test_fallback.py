"""The fallback cascade's pure parts (`training.cascade.fallback`) on hand-made logits."""

from __future__ import annotations

import math

import torch

from training.cascade.fallback import calibrate_fallback, fallback_infer, fallback_table


def logits_for(probabilities: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probabilities).log()


# four images, two classes; the student is sure of images 0 and 1 (0.9), unsure of 2 and 3
STUDENT = logits_for([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.55, 0.45]])
TEACHER = logits_for([[0.8, 0.2], [0.2, 0.8], [0.3, 0.7], [0.3, 0.7]])
LABELS = torch.tensor([0, 0, 1, 1])  # the student is wrong on 2 and 3, the teacher on 1


def test_the_table_holds_each_exit_confidence_correctness_and_cumulative_cost():
    table = fallback_table(STUDENT, TEACHER, LABELS, 0.5, 2.0)
    assert torch.allclose(table.confidence[:, 0], torch.tensor([0.9, 0.9, 0.6, 0.55]))
    assert table.correct.tolist() == [[True, True], [True, False], [False, True], [False, True]]
    assert table.cost[0].tolist() == [0.5, 2.5]
    assert table.full_accuracy() == 0.75


def test_calibration_passes_on_exactly_the_images_the_student_would_lose():
    table = fallback_table(STUDENT, TEACHER, LABELS, 0.5, 2.0)
    threshold = calibrate_fallback(table, 0.0)
    # images 2 and 3 (confidence 0.6 and 0.55) must reach the teacher, 0 and 1 need not: the
    # cheapest threshold keeps 0.9 with the student and sends 0.6 on
    assert 0.6 <= threshold < 0.9
    outcome = table.outcome(torch.tensor([threshold]))
    # image 1 stays with the student, who is right there while the teacher is not: a gain
    assert outcome["accuracy"] == 1.0
    assert outcome["exit_share_0"] == 0.5
    assert math.isclose(outcome["mean_cost"], (0.5 + 0.5 + 2.5 + 2.5) / 4)
    # counted on losses alone the student keeps image 0 only (image 1 is no gain there: the
    # teacher misses it): at a tolerance of half the images (0.75 - 0.5 = 0.25) it keeps all
    assert calibrate_fallback(table, 0.5) < 0.55


def test_inference_runs_the_teacher_on_the_passed_images_only():
    seen = []

    def teacher(images: torch.Tensor) -> torch.Tensor:
        seen.append(images.clone())
        return TEACHER[images[:, 0].long()]

    images = torch.arange(4).float()[:, None]  # each image carries its row index
    out = fallback_infer(lambda x: STUDENT[x[:, 0].long()], teacher, images, 0.6)
    assert [row.tolist() for row in seen] == [[[2.0], [3.0]]]  # one call, the unsure ones
    assert out.exits.tolist() == [0, 0, 1, 1]
    assert out.labels.tolist() == [0, 0, 1, 1]
    assert torch.allclose(out.confidence, torch.tensor([0.9, 0.9, 0.7, 0.7]))
    none_passed = fallback_infer(lambda x: STUDENT[x[:, 0].long()], teacher, images, 0.5)
    assert len(seen) == 1 and none_passed.exits.tolist() == [0, 0, 0, 0]


def test_the_teacher_is_consulted_only_where_it_buys_accuracy():
    # a teacher that answers as the student does: the cascade is no more accurate, so the
    # student keeps every image
    echo = logits_for([[0.7, 0.3], [0.7, 0.3], [0.7, 0.3], [0.7, 0.3]])
    table = fallback_table(STUDENT, echo, LABELS, 0.5, 2.0)
    threshold = calibrate_fallback(table, 0.0)
    assert threshold == 0.0
    assert table.outcome(torch.tensor([threshold]))["exit_share_0"] == 1.0
    # a teacher no more accurate than the student (0.5 each) but right where the student is
    # unsure: the cascade (1.0) is worth it
    complement = logits_for([[0.2, 0.8], [0.2, 0.8], [0.3, 0.7], [0.3, 0.7]])
    table = fallback_table(STUDENT, complement, LABELS, 0.5, 2.0)
    threshold = calibrate_fallback(table, 0.0)
    assert table.outcome(torch.tensor([threshold]))["accuracy"] == 1.0
