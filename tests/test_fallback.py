"""The fallback cascade's pure parts (`training.cascade.fallback`, `training.cascade.routing`)
on hand-made logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from training.cascade.fallback import (
    calibrate_fallback,
    cascade_evidence,
    fallback_infer,
    fallback_table,
)
from training.cascade.fallback_choice import Scored, choose_fallback
from training.cascade.learning import split_disjoint
from training.cascade.routing import Router, choose_routing, fit_router, stands


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


def test_the_student_answers_alone_where_the_cascade_buys_at_most_the_tolerance():
    # student alone 0.5, teacher alone 0.75; at a tolerance of 0.25 the cheapest cascade sends
    # image 3 on (losses only: 0.5, the teacher's 0.75 minus 0.25) and is right on 0.75 of
    # the images: 0.25 above the student alone, within the tolerance, so the student stands
    table = fallback_table(STUDENT, TEACHER, LABELS, 0.5, 2.0)
    assert calibrate_fallback(table, 0.25) == 0.0
    # at 0.24 the cascade must send images 2 and 3 on and buys 0.5: the teacher stays
    assert calibrate_fallback(table, 0.24) >= 0.6
    assert table.outcome(torch.tensor([calibrate_fallback(table, 0.24)]))["accuracy"] == 1.0
    assert calibrate_fallback(table, 1.0) == 0.0  # `--fallback-tolerance 1`: always alone


def gains(wrong: int, images: int = 84) -> Scored:
    """`images` validation images of two classes, all of class 0: the student sure and right
    on all but `wrong`, which it gets wrong unsure; the teacher right on every one."""
    student = logits_for([[0.9, 0.1]] * (images - wrong) + [[0.45, 0.55]] * wrong)
    teacher = logits_for([[0.8, 0.2]] * images)
    return Scored(student, teacher, torch.zeros(images, dtype=torch.long))


@pytest.mark.parametrize(("wrong", "level", "alone"), [
    (2, 0.05, True),  # two images ahead of 84 (2.4 points, above the tolerance): p = 0.25
    (5, 0.05, False),  # five: p = 1/32, significant
    (2, 1.0, False),  # level 1: any advantage beyond the tolerance keeps the teacher
])
def test_the_teacher_is_kept_only_where_its_validation_advantage_is_significant(
        wrong, level, alone):
    scored = gains(wrong)
    table = fallback_table(scored.student, scored.teacher, scored.labels, 1.0, 1.0)
    only_cascade, only_student, p_better = cascade_evidence(table, calibrate_fallback(table,
                                                                                      0.01))
    assert (only_cascade, only_student, p_better) == (wrong, 0, 0.5 ** wrong)
    choice = choose_fallback(torch.nn.Identity(), torch.nn.Identity(), scored, scored,
                             torch.zeros(4, 2), torch.device("cpu"), 0.01, "fixed", 0, level)
    assert (choice.threshold == 0.0) == alone
    assert choice.metrics["student_alone_stands"] == float(alone)
    assert choice.metrics["val_cascade_p_better"] == 0.5 ** wrong
    assert choice.metrics["val_accuracy"] == pytest.approx((84 - wrong) / 84 if alone else 1.0)


# --- the routing (`training.cascade.routing`): the confidence rule or a fitted predictor


def class_dependent(count: int = 400, seed: int = 0):
    """Student logits whose confidence is the same (0.7) everywhere and says nothing: the
    student is right on every image it calls class 0 and wrong on every image it calls class
    1, where the teacher is right; so only the predicted class tells where the teacher helps."""
    generator = torch.Generator().manual_seed(seed)
    predicted = torch.randint(0, 2, (count,), generator=generator)
    student = torch.where(predicted[:, None] == 0, logits_for([[0.7, 0.3]]),
                          logits_for([[0.3, 0.7]]))
    labels = torch.zeros(count, dtype=torch.long)  # every image is class 0
    teacher = logits_for([[0.8, 0.2]]).expand(count, 2)
    return student, teacher, labels, predicted


def test_the_routing_target_is_the_teacher_only_where_it_alone_is_right():
    student = logits_for([[0.9, 0.1], [0.2, 0.8], [0.2, 0.8], [0.9, 0.1]])
    teacher = logits_for([[0.2, 0.8], [0.9, 0.1], [0.2, 0.8], [0.2, 0.8]])
    labels = torch.tensor([0, 0, 0, 0])
    # 0: student right; 1: student wrong, teacher right; 2: both wrong; 3: student right
    assert stands(student, teacher, labels).tolist() == [True, False, True, True]


def test_a_fitted_predictor_is_kept_where_it_passes_on_fewer_images_for_the_same_accuracy():
    student, teacher, labels, predicted = class_dependent()
    fit, rows = split_disjoint(len(labels), 0.5, 0)
    router = fit_router(student[fit], stands(student[fit], teacher[fit], labels[fit]), seed=0)
    with torch.no_grad():
        scores = router(student[rows])
    # the predictor ranks every image the teacher must answer below every other one
    assert scores[predicted[rows] == 1].max() < scores[predicted[rows] == 0].min()
    fixed = fallback_table(student[rows], teacher[rows], labels[rows], 0.5, 2.0)
    fitted = fallback_table(student[rows], teacher[rows], labels[rows], 0.6, 2.0, scores)
    choice = choose_routing(fixed, fitted, tolerance=0.0)
    assert choice.fitted_kept
    # the rule must pass on every image to reach the teacher's accuracy; the predictor the
    # half that needs it, paying 0.1 more per image for itself
    assert choice.fixed == pytest.approx({"accuracy": 1.0, "mean_cost": 2.5, "exit_share_0": 0.0,
                                          "exit_share_1": 1.0})
    share = (predicted[rows] == 0).float().mean().item()
    assert choice.fitted["accuracy"] == 1.0
    assert choice.fitted["exit_share_0"] == pytest.approx(share)
    assert choice.fitted["mean_cost"] == pytest.approx(0.6 + 2.0 * (1 - share))


def test_a_predictor_no_cheaper_than_the_confidence_rule_is_dropped():
    # the confidence already tells the images apart: a predictor can only tie and adds its time
    table = fallback_table(STUDENT, TEACHER, LABELS, 0.5, 2.0)
    scored = fallback_table(STUDENT, TEACHER, LABELS, 0.6, 2.0,
                            score=torch.tensor([0.9, 0.9, 0.6, 0.55]))
    choice = choose_routing(table, scored, tolerance=0.0)
    assert not choice.fitted_kept
    assert choice.fitted["accuracy"] == choice.fixed["accuracy"] == 1.0
    assert choice.fitted["mean_cost"] > choice.fixed["mean_cost"]


def test_inference_with_a_router_passes_on_what_it_scores_low_and_it_travels_as_json():
    student, teacher, labels, predicted = class_dependent(count=200)
    router = fit_router(student, stands(student, teacher, labels), seed=0)
    restored = Router.from_json(json.loads(json.dumps(router.to_json())))
    with torch.no_grad():
        assert torch.equal(restored(student), router(student))
        threshold = float((router(student[predicted == 1]).max()
                           + router(student[predicted == 0]).min()) / 2)
    images = torch.arange(len(labels)).float()[:, None]
    out = fallback_infer(lambda x: student[x[:, 0].long()], lambda x: teacher[x[:, 0].long()],
                         images, threshold, restored)
    assert out.exits.tolist() == predicted.tolist()  # the teacher answers exactly class 1's
    assert (out.labels == labels).all()
    # its confidence column is the answer's probability, not the router's score
    assert torch.allclose(out.confidence, torch.where(predicted == 0, 0.7, 0.8))


def test_the_calibrated_threshold_does_not_depend_on_what_each_network_costs():
    # `choose_fallback` calibrates once on unit costs: the cheapest cascade is the one that
    # sends the fewest images on, whatever the student and the teacher cost
    complement = logits_for([[0.2, 0.8], [0.2, 0.8], [0.3, 0.7], [0.3, 0.7]])
    for teacher, tolerance in ((TEACHER, 0.0), (TEACHER, 0.24), (complement, 0.0)):
        unit = calibrate_fallback(fallback_table(STUDENT, teacher, LABELS, 1.0, 1.0), tolerance)
        for costs in ((0.5, 2.0), (0.01, 10.0), (3.0, 0.2)):
            assert calibrate_fallback(fallback_table(STUDENT, teacher, LABELS, *costs),
                                      tolerance) == unit
