"""Raw-pixel baselines: what a data set gives with no network at all.

A trained model that does not beat these on the same validation images has learned less than
the pixels already tell, so the flows log both beside every model and never promote a model
below them. Both are pure torch and seeded, and each chooses its one setting on the validation
split, so the test accuracy it reports was never looked at while choosing:

- `knn`: the k nearest training images by Euclidean distance on the pixels scaled to [0, 1];
  the majority label among them (ties go to the nearest neighbour's label). k is the one of
  `K_GRID` (capped by the training size) with the best validation accuracy, the smaller k on
  ties; the neighbours are ranked once for the largest k and every k votes from that ranking.
- `linear`: multinomial logistic regression on the pixels standardised with the training
  split's per-pixel mean and deviation, minimising `mean CE + l2 * |W|^2` by L-BFGS. l2 is the
  one of `L2_GRID` with the best validation accuracy, the larger l2 on ties; the grid is fitted
  from the largest penalty down, each fit starting from the previous one's weights.

Measured on Fashion-MNIST (one split each): on 14,400 training images the validation optimum
is k = 5 and l2 = 3e-3 to 1e-2; on 1,440 and 360 images l2 = 1e-2 to 3e-2 (the validation
accuracy falls by 0.01 to 0.05 a decade either side), and k from 1 to 25 (k = 25 once, 0.006
above k = 15). So `L2_GRID` spans a decade beyond the optimum at both ends. On the 14,400,
100 L-BFGS iterations from the warm start end within 0.1 % of the optimum's objective at
l2 >= 1e-2 and within 2 % at 1e-4.

The k-NN also scores the validation images mirrored left to right (`knn_val_mirrored_accuracy`,
at the chosen k): where the classes do not survive a mirror (digits, letters, arrows), it falls
to near chance, and `mirror_safe` tells the flows to train without flips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

K_GRID = (1, 3, 5, 7, 9, 15)
L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1)
MIRROR_KEEP = 0.5  # flips are safe if mirrored images keep this share of k-NN's lead on chance


def flatten_pixels(images: Tensor) -> Tensor:
    """uint8 (N, C, H, W) as float (N, C*H*W) in [0, 1]."""
    return images.reshape(len(images), -1).float().div_(255)


def nearest_neighbours(train_x: Tensor, queries: Tensor, k: int, chunk: int = 1024) -> Tensor:
    """Positions (Q, k) of each query's k nearest training rows, nearest first.

    Ranks by `|t|^2 - 2 q.t`, the squared Euclidean distance `|q - t|^2` less `|q|^2`, which
    is the same for every training row t of one query q; `chunk` queries at a time bound the
    (chunk, N) distance block.
    """
    if not 1 <= k <= len(train_x):
        raise ValueError(f"k={k} must be between 1 and the training size {len(train_x)}")
    squared = (train_x * train_x).sum(1)
    index = [torch.zeros(0, k, dtype=torch.long)]  # no queries: no rows
    for start in range(0, len(queries), chunk):
        distance = squared[None, :] - 2 * queries[start:start + chunk] @ train_x.T
        index.append(distance.topk(k, dim=1, largest=False).indices)
    return torch.cat(index)


def vote(neighbour_labels: Tensor, classes: int) -> Tensor:
    """The majority label of each row of (Q, k) neighbour labels, nearest first.

    Each label scores `count + (k - r) / (k + 1)`, r the rank (0 = nearest) of its nearest
    member: the bonus is below 1, so counts decide first and a tie between labels goes to the
    label of the nearest neighbour among the tied ones.
    """
    queries, k = neighbour_labels.shape
    votes = F.one_hot(neighbour_labels, classes).sum(1).float()
    rank_bonus = (k - torch.arange(k, dtype=torch.float32)).expand(queries, k) / (k + 1)
    bonus = torch.zeros_like(votes).scatter_reduce_(1, neighbour_labels, rank_bonus,
                                                    reduce="amax", include_self=False)
    return (votes + bonus).argmax(1)


def knn_predict(train_x: Tensor, train_y: Tensor, queries: Tensor, k: int,
                chunk: int = 1024) -> Tensor:
    """The majority label of each query's k nearest training rows (Euclidean distance).

    A tie between labels goes to the label of the nearest neighbour among the tied ones.
    """
    index = nearest_neighbours(train_x, queries, k, chunk)
    return vote(train_y[index], int(train_y.max()) + 1)


def choose_k(train_x: Tensor, train_y: Tensor, val_x: Tensor, val_y: Tensor,
             grid: Sequence[int] = K_GRID) -> tuple[int, dict[int, float]]:
    """The k of `grid` (each capped at the training size) whose k-NN is most accurate on the
    validation rows, the smaller k on ties, and every k's validation accuracy.

    The neighbours are ranked once for the largest k; the k nearest of that ranking are the k
    nearest, so every smaller k votes from its first k columns.
    """
    ks = sorted({min(k, len(train_x)) for k in grid})
    labels = train_y[nearest_neighbours(train_x, val_x, ks[-1])]
    classes = int(train_y.max()) + 1
    scores = {k: accuracy(vote(labels[:, :k], classes), val_y) for k in ks}
    best = ks[0]
    for k in ks[1:]:
        if scores[k] > scores[best]:  # strictly better: a tie keeps the smaller k
            best = k
    return best, scores


def fit_linear(train_x: Tensor, train_y: Tensor, l2: float, classes: int,
               iterations: int = 100, start: tuple[Tensor, Tensor] | None = None,
               tolerance: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Weights (D, C) and bias (C,) of a logistic regression fitted by full-batch L-BFGS on
    `L = mean CE(XW + b, y) + l2 * |W|^2` (the bias is not penalised).

    This is scikit-learn's `LogisticRegression(C=1 / (2 * l2 * N))`, whose objective
    `0.5 |W|^2 + C * sum CE` is `C * N` times L. The gradient is written out, one product with
    X each way and no autograd graph: with P = softmax(XW + b) and Y the one-hot labels,
    `dL/dW = X^T (P - Y) / N + 2 l2 W` and `dL/db = mean over rows of (P - Y)`.

    Args:
        train_x: float (N, D).
        train_y: int64 (N,).
        l2: the penalty's weight.
        classes: C.
        iterations: most L-BFGS iterations.
        start: weights and bias to start from (a warm start), zeros if None.
        tolerance: stop once every gradient entry is at most this (scikit-learn's `tol`).
    """
    rows = len(train_x)
    onehot = F.one_hot(train_y, classes).to(train_x.dtype)
    weight = train_x.new_zeros(train_x.shape[1], classes) if start is None else start[0].clone()
    bias = train_x.new_zeros(classes) if start is None else start[1].clone()
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=iterations,
                                  tolerance_grad=tolerance, history_size=10,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        log_p = (train_x @ weight + bias).log_softmax(1)
        residual = (log_p.exp() - onehot) / rows
        # (P - Y)^T X, transposed: X is read row by row, twice as fast as X^T's strided view
        weight.grad = (residual.T @ train_x).T.contiguous() + 2 * l2 * weight
        bias.grad = residual.sum(0)
        return -(log_p * onehot).sum() / rows + l2 * weight.pow(2).sum()

    with torch.no_grad():
        optimizer.step(closure)
    return weight, bias


def choose_l2(train_z: Tensor, train_y: Tensor, val_z: Tensor, val_y: Tensor, classes: int,
              grid: Sequence[float] = L2_GRID) -> tuple[float, Tensor, Tensor, dict[float, float]]:
    """The l2 of `grid` whose logistic regression is most accurate on the validation rows, the
    larger l2 on ties, with its weights and bias, and every l2's validation accuracy.

    The penalties are fitted from the largest down, each from the previous one's solution
    (a regularisation path): a slightly weaker penalty moves the optimum a little, so each fit
    starts near its end.
    """
    scores: dict[float, float] = {}
    best = None
    solution = None
    for l2 in sorted(grid, reverse=True):
        solution = fit_linear(train_z, train_y, l2, classes, start=solution)
        scores[l2] = accuracy((val_z @ solution[0] + solution[1]).argmax(1), val_y)
        if best is None or scores[l2] > scores[best[0]]:  # a tie keeps the larger l2
            best = (l2, *solution)
    if best is None:
        raise ValueError("the l2 grid is empty")
    return (*best, scores)


def accuracy(predicted: Tensor, labels: Tensor) -> float:
    """Fraction of predictions equal to the labels."""
    return float((predicted == labels).float().mean()) if len(labels) else float("nan")


def raw_pixel_baselines(images: Tensor, labels: Tensor, splits: dict[str, Tensor],
                        k_grid: Sequence[int] = K_GRID,
                        l2_grid: Sequence[float] = L2_GRID) -> dict[str, float]:
    """Validation and test accuracy of the k-NN and the linear baseline (module docstring), k
    and l2 chosen on the validation split (`choose_k`, `choose_l2`) and only the chosen ones
    scored on the test split.

    Args:
        images: uint8 (N, C, H, W), every split's images.
        labels: int64 (N,).
        splits: positions of `train`, `val` and `test` in `images`.
        k_grid: the k-NN's candidate k.
        l2_grid: the linear baseline's candidate penalties.

    Returns:
        `knn_val_accuracy`, `knn_test_accuracy`, `knn_val_mirrored_accuracy` (the validation
        images mirrored), `knn_k`, the chosen k, `linear_val_accuracy`,
        `linear_test_accuracy`, and `linear_l2`, the chosen penalty.
    """
    torch.manual_seed(0)
    x = {name: flatten_pixels(images[index]) for name, index in splits.items()}
    y = {name: labels[index].long() for name, index in splits.items()}
    k, knn_scores = choose_k(x["train"], y["train"], x["val"], y["val"], k_grid)
    mirrored = flatten_pixels(images[splits["val"]].flip(-1))
    result: dict[str, float] = {
        "knn_val_accuracy": knn_scores[k], "knn_k": k,
        "knn_test_accuracy": accuracy(knn_predict(x["train"], y["train"], x["test"], k),
                                      y["test"]),
        "knn_val_mirrored_accuracy": accuracy(knn_predict(x["train"], y["train"], mirrored, k),
                                              y["val"])}
    mean, std = x["train"].mean(0), x["train"].std(0).clamp_min(1e-3)
    z = {name: (value - mean) / std for name, value in x.items()}
    l2, weight, bias, linear_scores = choose_l2(z["train"], y["train"], z["val"], y["val"],
                                                int(labels.max()) + 1, l2_grid)
    result |= {"linear_val_accuracy": linear_scores[l2], "linear_l2": l2,
               "linear_test_accuracy": accuracy((z["test"] @ weight + bias).argmax(1),
                                                y["test"])}
    return result


def best_baseline(baselines: dict[str, float], split: str = "val") -> tuple[str, float]:
    """The stronger baseline on `split`: its name (`knn` or `linear`) and accuracy."""
    return max(((name, baselines[f"{name}_{split}_accuracy"]) for name in ("knn", "linear")),
               key=lambda item: item[1])


def mirror_safe(baselines: dict[str, float], classes: int) -> bool:
    """Whether horizontal flips keep the classes: k-NN on the mirrored validation images keeps
    at least `MIRROR_KEEP` of its accuracy above chance. On Fashion-MNIST it keeps 0.70 (shoes
    all face one way, so not all of it); on scikit-learn's digits 0.15. Where the pixels tell
    nothing (k-NN at chance), flips stay on."""
    chance = 1.0 / classes
    lead = baselines["knn_val_accuracy"] - chance
    if lead <= 0:
        return True
    return baselines["knn_val_mirrored_accuracy"] - chance >= MIRROR_KEEP * lead
