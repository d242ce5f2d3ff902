"""Raw-pixel baselines against hand-computed cases and against scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier

from training.baselines import (
    L2_GRID,
    accuracy,
    best_baseline,
    choose_k,
    choose_l2,
    fit_linear,
    knn_predict,
    mirror_safe,
    raw_pixel_baselines,
)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 8x8 digits (shipped with it, no download) as float32 in [0, 1],
    jittered by 1e-3 so no two training images are at exactly the same distance from a query
    (the integer pixels would tie): then "the k nearest" is one set for both libraries."""
    data = load_digits()
    jitter = np.random.default_rng(0).normal(0, 1e-3, data.data.shape)
    x = torch.from_numpy((data.data / 16 + jitter).astype(np.float32))
    return x, torch.from_numpy(data.target).long()


def standardised(x: torch.Tensor, train: slice) -> torch.Tensor:
    """The pixels standardised as `raw_pixel_baselines` does: (x - mean) / std of the rows
    `train`, the deviation clamped at 1e-3 (digits' border pixels are constant)."""
    return (x - x[train].mean(0)) / x[train].std(0).clamp_min(1e-3)


def test_knn_votes_by_majority_and_breaks_ties_towards_the_nearest():
    train = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    queries = torch.tensor([[0.4], [10.4], [1.6]])
    assert knn_predict(train, labels, queries, k=3).tolist() == [0, 1, 0]
    # k=2 at 1.6: neighbours 2.0 (label 1, nearest) and 1.0 (label 0): a tie, the nearest wins
    assert knn_predict(train, labels, queries, k=2).tolist() == [0, 1, 1]


@pytest.mark.parametrize("k", [1, 3, 5, 7, 15])
def test_knn_predicts_as_scikit_learn_where_the_majority_is_unique(digits, k):
    x, y = digits
    train, queries = slice(0, 1000), slice(1000, None)
    ours = knn_predict(x[train], y[train], x[queries], k).numpy()
    reference = KNeighborsClassifier(n_neighbors=k).fit(x[train].numpy(), y[train].numpy())
    theirs = reference.predict(x[queries].numpy())
    # The two differ only where two labels tie for the most votes: scikit-learn takes the mode,
    # whose tie goes to the smallest label; ours goes to the label of the nearest neighbour
    # among the tied ones. So compare where the top count is unique (every query at k = 1).
    neighbours = reference.kneighbors(x[queries].numpy(), return_distance=False)
    counts = np.stack([np.bincount(row, minlength=10) for row in y[train].numpy()[neighbours]])
    top = np.sort(counts, axis=1)
    unique = top[:, -1] > top[:, -2]
    assert unique.mean() > 0.95 and (k > 1 or unique.all())
    assert (ours[unique] == theirs[unique]).all()
    for row in np.flatnonzero(~unique):  # 4 to 7 ties at k > 1: each library keeps its rule
        tied = np.flatnonzero(counts[row] == counts[row].max())
        order = y[train].numpy()[neighbours[row]]
        assert theirs[row] == tied.min()
        assert ours[row] == next(label for label in order if label in tied)


@pytest.mark.parametrize("l2", [1e-3, 1e-2, 1e-1])
def test_logistic_regression_matches_scikit_learn_at_the_same_penalty(digits, l2):
    x, y = digits
    train, test = slice(0, 1200), slice(1200, None)
    z = standardised(x, train)
    weight, bias = fit_linear(z[train], y[train], l2, 10)  # the baseline's 100 iterations
    # ours: mean CE + l2 |W|^2; scikit-learn: 0.5 |W|^2 + C sum CE, the same optimum where
    # C = 1 / (2 l2 N); neither penalises the bias
    reference = LogisticRegression(C=1 / (2 * l2 * 1200), tol=1e-6, max_iter=2000)
    reference.fit(z[train].numpy(), y[train].numpy())
    theirs = torch.from_numpy(reference.coef_.T.astype(np.float32))
    theirs_bias = torch.from_numpy(reference.intercept_.astype(np.float32))

    def objective(w: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(z[train] @ w + b, y[train])
                     + l2 * w.pow(2).sum())

    assert objective(weight, bias) == pytest.approx(objective(theirs, theirs_bias), rel=1e-3)
    assert (weight - theirs).abs().max() < 0.03 * theirs.abs().max()
    ours = (z[test] @ weight + bias).argmax(1)
    assert (ours.numpy() == reference.predict(z[test].numpy())).mean() >= 0.99
    assert accuracy(ours, y[test]) == pytest.approx(reference.score(z[test].numpy(),
                                                                    y[test].numpy()), abs=0.01)


def test_k_is_the_one_with_the_best_validation_accuracy_and_the_smaller_on_ties():
    # 1-D groups 10 apart with alternating labels; in each, training points at offsets 0.1 to
    # 0.7, the three nearest the group's centre mislabelled. A query at a centre: k = 1 and 3
    # see only mislabelled points, k = 5 three of five, k = 7 the whole group (4 right to 3),
    # k = 9 adds the left group's two nearest (wrong: 5 to 4); k = 15 is right again (8 to 7),
    # a tie with k = 7 that the smaller k wins.
    groups = torch.arange(2, 10)
    offsets = torch.arange(1, 8) / 10
    train_x = (10 * groups[:, None] + offsets).reshape(-1, 1)
    truth = groups % 2
    train_y = (truth[:, None] ^ (offsets < 0.35).long()).reshape(-1)
    queries, query_y = (10 * groups[1:-1]).float()[:, None], truth[1:-1]
    k, scores = choose_k(train_x, train_y, queries, query_y)
    assert scores == {1: 0.0, 3: 0.0, 5: 0.0, 7: 1.0, 9: 0.0, 15: 1.0} and k == 7
    # every k voted from the one ranking for k = 15, as a k-NN of its own would
    for each, score in scores.items():
        assert accuracy(knn_predict(train_x, train_y, queries, each), query_y) == score
    # clean labels: k = 1 is right everywhere, ties with 3, 5, 7 and wins as the smallest
    k, scores = choose_k(train_x, truth.repeat_interleave(7), queries, query_y)
    assert k == 1 and scores[1] == 1.0
    # the grid is capped at the training size
    assert choose_k(train_x[:4], train_y[:4], queries, query_y)[1].keys() == {1, 3, 4}


def test_l2_is_the_one_with_the_best_validation_accuracy():
    generator = torch.Generator().manual_seed(0)
    grid = (1e-4, 1e-2, 10.0)
    # three to one, and the label is in feature 0: weak penalties learn it, l2 = 10 shrinks W
    # to almost nothing and the unpenalised bias calls every image the common class
    y = (torch.arange(400) % 4 == 0).long()
    x = torch.randn(400, 5, generator=generator)
    x[:, 0] += 5 * y
    l2, weight, bias, scores = choose_l2(x[:200], y[:200], x[200:], y[200:], 2, grid)
    # 1e-2 and 1e-4 tie: the larger penalty is kept
    assert scores[10.0] == 0.75 and scores[1e-2] == scores[1e-4] > 0.95 and l2 == 1e-2
    assert accuracy((x[200:] @ weight + bias).argmax(1), y[200:]) == scores[l2]
    # three to one and pure noise in 100 features for 40 training rows: a weak penalty fits the
    # noise and calls some images the rare class, the strong one always the common class
    x = torch.randn(440, 100, generator=generator)
    y = (torch.arange(440) % 4 == 0).long()
    l2, _, _, scores = choose_l2(x[:40], y[:40], x[40:], y[40:], 2, grid)
    assert l2 == 10.0 and scores[10.0] == 0.75 > scores[1e-4]


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
    # every k and every penalty is perfect on validation: the smallest k, the largest penalty
    assert result["knn_k"] == 1 and result["linear_l2"] == max(L2_GRID)
    # a top half survives a left-right mirror: flips keep these classes
    assert result["knn_val_mirrored_accuracy"] == 1.0 and mirror_safe(result, 2)
    assert best_baseline({"knn_val_accuracy": 0.7, "linear_val_accuracy": 0.8}) == \
        ("linear", 0.8)


def test_baselines_report_the_test_accuracy_of_the_k_chosen_on_validation():
    # 1-pixel images: class 0 at 10..50, class 1 at 200..240, and a class-1 image at 100.
    # Validation wants k >= 3 (at 99 the lone 100 outvotes the class-0 row only at k = 1),
    # so k = 3; the test image at 101 is class 1, which k = 1 would get right and k = 3 does not
    train = [10, 20, 30, 40, 50, 200, 210, 220, 230, 240, 100]
    train_y = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    val, val_y = [15, 225, 99], [0, 1, 0]
    test, test_y = [101, 205], [1, 1]
    images = torch.tensor(train + val + test, dtype=torch.uint8)[:, None, None, None]
    labels = torch.tensor(train_y + val_y + test_y)
    positions = torch.arange(len(labels))
    splits = {"train": positions[:11], "val": positions[11:14], "test": positions[14:]}
    result = raw_pixel_baselines(images, labels, splits)
    assert result["knn_k"] == 3 and result["knn_val_accuracy"] == 1.0
    assert result["knn_test_accuracy"] == 0.5  # k = 1 would score 1.0 on these test images


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
