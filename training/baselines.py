"""Raw-pixel baselines: what a data set gives with no network at all.

A trained model that does not beat these on the same validation images has learned less than
the pixels already tell, so the flows log both beside every model and never promote a model
below them. Both are pure torch, seeded, and take a second or two on 20,000 images:

- `knn`: the k nearest training images by Euclidean distance on the pixels scaled to [0, 1];
  the majority label among them (ties go to the nearest neighbour's label).
- `linear`: multinomial logistic regression on the pixels standardised with the training
  split's per-pixel mean and deviation, fitted by L-BFGS with an L2 penalty; the penalty is
  chosen on the validation split from a small grid.

The k-NN also scores the validation images mirrored left to right (`knn_val_mirrored_accuracy`):
where the classes do not survive a mirror (digits, letters, arrows), it falls to near chance,
and `mirror_safe` tells the flows to train without flips.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KNN_K = 3
L2_GRID = (1e-4, 1e-3, 1e-2)
MIRROR_KEEP = 0.5  # flips are safe if mirrored images keep this share of k-NN's lead on chance


def flatten_pixels(images: Tensor) -> Tensor:
    """uint8 (N, C, H, W) as float (N, C*H*W) in [0, 1]."""
    return images.reshape(len(images), -1).float().div_(255)


def knn_predict(train_x: Tensor, train_y: Tensor, queries: Tensor, k: int = KNN_K,
                chunk: int = 1024) -> Tensor:
    """The majority label of each query's k nearest training rows (Euclidean distance).

    A tie between labels goes to the label of the nearest neighbour among the tied ones.
    """
    if not 1 <= k <= len(train_x):
        raise ValueError(f"k={k} must be between 1 and the training size {len(train_x)}")
    classes = int(train_y.max()) + 1
    squared = (train_x * train_x).sum(1)
    out = []
    for start in range(0, len(queries), chunk):
        q = queries[start:start + chunk]
        distance = squared[None, :] - 2 * q @ train_x.T  # + |q|^2, the same for every row
        index = distance.topk(k, dim=1, largest=False).indices  # nearest first
        labels = train_y[index]
        votes = F.one_hot(labels, classes).sum(1).float()
        # break ties towards nearer neighbours: a tiny bonus decreasing with the rank
        bonus = torch.zeros_like(votes).scatter_reduce_(
            1, labels, (k - torch.arange(k, dtype=torch.float32)).expand(len(q), k) / (k + 1),
            reduce="amax", include_self=False)
        out.append((votes + bonus).argmax(1))  # bonus < 1: counts decide first
    return torch.cat(out)


def fit_linear(train_x: Tensor, train_y: Tensor, l2: float, classes: int,
               iterations: int = 100) -> tuple[Tensor, Tensor]:
    """Weights (D, C) and bias (C,) of a logistic regression fitted by full-batch L-BFGS on
    `mean CE + l2 * |W|^2`."""
    weight = torch.zeros(train_x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=iterations,
                                  history_size=10, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(train_x @ weight + bias, train_y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach(), bias.detach()


def accuracy(predicted: Tensor, labels: Tensor) -> float:
    """Fraction of predictions equal to the labels."""
    return float((predicted == labels).float().mean()) if len(labels) else float("nan")


def raw_pixel_baselines(images: Tensor, labels: Tensor, splits: dict[str, Tensor],
                        k: int = KNN_K) -> dict[str, float]:
    """Validation and test accuracy of the k-NN and the linear baseline (module docstring).

    Args:
        images: uint8 (N, C, H, W), every split's images.
        labels: int64 (N,).
        splits: positions of `train`, `val` and `test` in `images`.

    Returns:
        `knn_val_accuracy`, `knn_test_accuracy`, `knn_val_mirrored_accuracy` (the validation
        images mirrored), `linear_val_accuracy`, `linear_test_accuracy`, and `linear_l2`, the
        chosen penalty.
    """
    torch.manual_seed(0)
    x = {name: flatten_pixels(images[index]) for name, index in splits.items()}
    y = {name: labels[index].long() for name, index in splits.items()}
    k = min(k, len(x["train"]))
    result = {f"knn_{name}_accuracy": accuracy(knn_predict(x["train"], y["train"], x[name], k),
                                               y[name]) for name in ("val", "test")}
    mirrored = flatten_pixels(images[splits["val"]].flip(-1))
    result["knn_val_mirrored_accuracy"] = accuracy(knn_predict(x["train"], y["train"], mirrored,
                                                               k), y["val"])
    mean, std = x["train"].mean(0), x["train"].std(0).clamp_min(1e-3)
    z = {name: (value - mean) / std for name, value in x.items()}
    classes = int(labels.max()) + 1
    best = None
    for l2 in L2_GRID:
        weight, bias = fit_linear(z["train"], y["train"], l2, classes)
        val = accuracy((z["val"] @ weight + bias).argmax(1), y["val"])
        if best is None or val > best[0]:
            best = (val, l2, weight, bias)
    val, l2, weight, bias = best
    result |= {"linear_val_accuracy": val, "linear_l2": l2,
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
