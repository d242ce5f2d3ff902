"""Which images the pipeline's student passes on to the teacher: the fixed exit rule or a
fitted predictor, chosen on validation as the `cascade` flow chooses its routing
(`training.cascade.calibration`).

The pipeline's cascade (`training.cascade.fallback`) is a super-network module whose two
sub-networks are "the student's answer stands" (no further cost) and "the teacher answers"
(the expensive path), after the student's exit. Two routings compete:

- `fixed`: the `cascade` flow's exit rule, the student's top class probability against one
  threshold;
- `fitted`: a predictor (`Router`, a small MLP on the student's class probabilities, their
  margin and entropy: features the student computed anyway) scores how likely the student's
  answer stands, fitted on a second set disjoint from every image the networks trained on and
  from the images that calibrate it. Its target is the oracle's cheapest right choice: the
  teacher only where the student is wrong and the teacher right.

Both are calibrated alike (the cheapest threshold within the tolerance, `calibrate_fallback`)
on the same images, and the predictor is kept only when it is strictly cheaper at the goal
with its own time counted (`choose_routing`): a predictor must pay for itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.cascade.fallback import calibrate_fallback
from training.cascade.learning import ExitTable


def router_features(logits: Tensor) -> Tensor:
    """Per image: the student's class probabilities, its top probability, the margin to the
    second and the normalized entropy, (N, C + 3)."""
    probs = logits.float().softmax(1)
    top2 = probs.topk(2, dim=1).values
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(1) / math.log(probs.shape[1])
    return torch.cat([probs, top2[:, :1], top2[:, :1] - top2[:, 1:], entropy[:, None]], 1)


class Router(nn.Module):
    """The fitted predictor: standardized `router_features` through one hidden ReLU layer to a
    score in (0, 1), how likely the student's answer stands."""

    def __init__(self, classes: int, hidden: int = 32) -> None:
        super().__init__()
        inputs = classes + 3
        self.register_buffer("mean", torch.zeros(inputs))
        self.register_buffer("std", torch.ones(inputs))
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, logits: Tensor) -> Tensor:
        features = (router_features(logits) - self.mean) / self.std
        return torch.sigmoid(self.net(features)).squeeze(1)

    def to_json(self) -> dict:
        """The weights as plain lists (the served model's meta JSON)."""
        return {name: value.tolist() for name, value in self.state_dict().items()}

    @classmethod
    def from_json(cls, state: dict) -> Router:
        """A router from `to_json`'s output."""
        weights = {name: torch.tensor(value) for name, value in state.items()}
        router = cls(len(weights["mean"]) - 3, len(weights["net.0.bias"]))
        router.load_state_dict(weights)
        return router.eval()


def stands(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor) -> Tensor:
    """Where the student's answer is the cheapest right one: everywhere but the images the
    student gets wrong and the teacher right."""
    student = student_logits.argmax(1) == labels
    teacher = teacher_logits.argmax(1) == labels
    return student | ~teacher


def fit_router(student_logits: Tensor, target: Tensor, seed: int, steps: int = 200,
               lr: float = 0.01, weight_decay: float = 1e-2) -> Router:
    """A `Router` fitted to `target` (`stands`) by full-batch AdamW on the binary
    cross-entropy. Few images need the teacher (about 200 of 3,000 validation images on
    Fashion-MNIST), so the fit is short and its weight decay strong: on the pipeline's
    Fashion-MNIST students, 400 steps at 1e-3, or the two outcomes weighted equally, ranked
    the images worse than the confidence alone did (docs/pipeline.md)."""
    torch.manual_seed(seed)
    router = Router(student_logits.shape[1])
    return train_router(router, student_logits, target, steps, lr, weight_decay)


def train_router(router: Router, student_logits: Tensor, target: Tensor, steps: int,
                 lr: float, weight_decay: float, weight: Tensor | None = None) -> Router:
    """Sets `router`'s standardization from the logits' features and trains its `net` on
    them (`fit_router`; `weight`: per image, for other fits measured beside it)."""
    logits = student_logits.detach().float().cpu()
    features = router_features(logits)
    router.mean.copy_(features.mean(0))
    router.std.copy_(features.std(0).clamp_min(1e-6))
    inputs = (features - router.mean) / router.std
    y = target.float().cpu()
    optimizer = torch.optim.AdamW(router.net.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(router.net(inputs).squeeze(1), y,
                                           weight=weight).backward()
        optimizer.step()
    return router.eval()


@dataclass(frozen=True)
class RoutingChoice:
    """What `choose_routing` compared: each routing's threshold and outcome on the same
    images, and whether the predictor won."""

    fitted_kept: bool
    fixed_threshold: float
    fitted_threshold: float
    fixed: dict[str, float]
    fitted: dict[str, float]


def choose_routing(fixed: ExitTable, fitted: ExitTable, tolerance: float) -> RoutingChoice:
    """Calibrates both routings' thresholds on their tables (the same images; the fitted
    table's costs include the predictor's time) and keeps the predictor only where it meets
    the goal (the teacher's accuracy minus `tolerance`) strictly cheaper than the fixed rule,
    or meets it where the fixed rule misses it."""
    target = fixed.full_accuracy() - tolerance

    def rank(outcome: dict[str, float]) -> tuple[bool, float]:
        return outcome["accuracy"] < target - 1e-9, outcome["mean_cost"]

    fixed_threshold = calibrate_fallback(fixed, tolerance)
    fitted_threshold = calibrate_fallback(fitted, tolerance)
    fixed_outcome = fixed.outcome(torch.tensor([fixed_threshold]))
    fitted_outcome = fitted.outcome(torch.tensor([fitted_threshold]))
    return RoutingChoice(fitted_kept=rank(fitted_outcome) < rank(fixed_outcome),
                         fixed_threshold=fixed_threshold, fitted_threshold=fitted_threshold,
                         fixed=fixed_outcome, fitted=fitted_outcome)
