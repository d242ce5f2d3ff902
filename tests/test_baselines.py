"""Raw-pixel baselines against hand-computed cases."""

from __future__ import annotations

import torch

from training.baselines import best_baseline, knn_predict, mirror_safe, raw_pixel_baselines


def test_knn_votes_by_majority_and_breaks_ties_towards_the_nearest():
    train = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    queries = torch.tensor([[0.4], [10.4], [1.6]])
    assert knn_predict(train, labels, queries, k=3).tolist() == [0, 1, 0]
    # k=2 at 1.6: neighbours 2.0 (label 1, nearest) and 1.0 (label 0): a tie, the nearest wins
    assert knn_predict(train, labels, queries, k=2).tolist() == [0, 1, 1]


def test_baselines_separate_two_pixel_patterns_and_name_the_stronger():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 2
    images = torch.randint(0, 60, (60, 1, 4, 4), generator=generator, dtype=torch.uint8)
    images[labels == 1, :, :2] += 150  # class 1: a bright top half
    splits = {"train": torch.arange(40), "val": torch.arange(40, 50),
              "test": torch.arange(50, 60)}
    result = raw_pixel_baselines(images, labels, splits)
    for name in ("knn", "linear"):
        assert result[f"{name}_val_accuracy"] == 1.0
        assert result[f"{name}_test_accuracy"] == 1.0
    # a top half survives a left-right mirror: flips keep these classes
    assert result["knn_val_mirrored_accuracy"] == 1.0 and mirror_safe(result, 2)
    assert best_baseline({"knn_val_accuracy": 0.7, "linear_val_accuracy": 0.8}) == \
        ("linear", 0.8)


def test_flips_are_unsafe_where_the_mirror_is_another_class():
    generator = torch.Generator().manual_seed(1)
    labels = torch.arange(60) % 2
    images = torch.randint(0, 60, (60, 1, 4, 4), generator=generator, dtype=torch.uint8)
    images[labels == 0, :, :, :2] += 150  # class 0: bright left half; class 1: right half
    images[labels == 1, :, :, 2:] += 150
    splits = {"train": torch.arange(40), "val": torch.arange(40, 50),
              "test": torch.arange(50, 60)}
    result = raw_pixel_baselines(images, labels, splits)
    assert result["knn_val_accuracy"] == 1.0 and result["knn_val_mirrored_accuracy"] == 0.0
    assert not mirror_safe(result, 2)
    # the rule: mirrored images keep at least half of k-NN's lead on chance (here 0.1 of 10)
    assert mirror_safe({"knn_val_accuracy": 0.9, "knn_val_mirrored_accuracy": 0.5}, 10)
    assert not mirror_safe({"knn_val_accuracy": 0.9, "knn_val_mirrored_accuracy": 0.49}, 10)
    assert mirror_safe({"knn_val_accuracy": 0.1, "knn_val_mirrored_accuracy": 0.0}, 10)
