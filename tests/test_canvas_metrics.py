"""Boundary F-measure and mask IoU against hand-worked cases; mAP@0.5 (torchmetrics) on
cases whose answer is known."""

from __future__ import annotations

import pytest
import torch

from training.canvas.contours import boundary_counts, dilate, disk, f_measure, mask_iou
from training.canvas.detection import mean_average_precision


def test_disk_and_dilation():
    assert disk(1).tolist() == [[0, 1, 0], [1, 1, 1], [0, 1, 0]]
    assert int(disk(2).sum()) == 13  # x^2 + y^2 <= 4 on the 5 x 5 grid
    point = torch.zeros(7, 7, dtype=torch.bool)
    point[3, 3] = True
    assert int(dilate(point, 2).sum()) == 13
    assert torch.equal(dilate(point, 0), point)


def test_boundary_f_with_tolerance():
    true = torch.zeros(1, 10, 10, dtype=torch.bool)
    true[0, 5, 5] = True
    near = torch.zeros_like(true)
    near[0, 5, 7] = True  # two pixels away
    assert boundary_counts(near, true, 2).tolist() == [1, 1, 1, 1]
    assert f_measure(boundary_counts(near, true, 2))["boundary_f"] == 1.0
    assert boundary_counts(near, true, 1).tolist() == [0, 1, 0, 1]
    assert f_measure(boundary_counts(near, true, 1))["boundary_f"] == 0.0
    # a line of 4 true pixels, 2 of them predicted and 2 stray pixels far away:
    # precision 2 / 4, recall 2 / 4 -> F 0.5
    line = torch.zeros(1, 10, 10, dtype=torch.bool)
    line[0, 2, 2:6] = True
    guess = torch.zeros_like(line)
    guess[0, 2, 2:4] = True
    guess[0, 8, 8:10] = True
    scores = f_measure(boundary_counts(guess, line, 0))
    assert scores == {"boundary_precision": 0.5, "boundary_recall": 0.5, "boundary_f": 0.5}
    # with tolerance 2 the two found pixels also cover the line's other two: recall 1
    assert f_measure(boundary_counts(guess, line, 2))["boundary_recall"] == 1.0
    empty = torch.zeros_like(line)
    assert f_measure(boundary_counts(empty, empty, 1))["boundary_f"] == 1.0


def test_mask_iou_by_hand():
    true = torch.zeros(2, 4, 4, dtype=torch.bool)
    true[0, :2, :2] = True  # 4 pixels
    guess = torch.zeros_like(true)
    guess[0, :2, :3] = True  # 6 pixels, 4 shared
    assert mask_iou(guess, true).tolist() == pytest.approx([4 / 6, 1.0])  # 2nd: both empty


def test_map_at_iou_half():
    truth = [{"boxes": torch.tensor([[10.0, 10, 30, 30], [50, 50, 70, 70]]),
              "labels": torch.tensor([1, 2])}]
    perfect = [{"boxes": truth[0]["boxes"], "scores": torch.tensor([0.9, 0.8]),
                "labels": torch.tensor([1, 2])}]
    assert mean_average_precision(perfect, truth)["map_50"] == pytest.approx(1.0)
    # class 2's box shifted by 8 px: IoU 12 x 20 / (2 x 400 - 240) = 0.43, a miss at IoU
    # 0.5, so class 1 AP 1, class 2 AP 0
    shifted = [{"boxes": torch.tensor([[10.0, 10, 30, 30], [58, 50, 78, 70]]),
                "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([1, 2])}]
    assert mean_average_precision(shifted, truth)["map_50"] == pytest.approx(0.5)
    # shifted by 4 px instead: IoU 16 x 20 / (2 x 400 - 320) = 0.667, a hit
    hit = [{"boxes": torch.tensor([[10.0, 10, 30, 30], [54, 50, 74, 70]]),
            "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([1, 2])}]
    assert mean_average_precision(hit, truth)["map_50"] == pytest.approx(1.0)
