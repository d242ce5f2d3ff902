"""Distillation losses and the student's training step.

The student's loss is `ce_weight * CE(student(x), y) + feature_weight * L(adapter(f_s), f_t)`,
where `f_s` is the student's feature at a named layer (a forward hook), `f_t` the teacher's
feature for the same images (from a feature bank, or from a teacher network run alongside) and
`L` one of:

- `l2`: mean squared difference over the feature's values (FitNets hints);
- `cosine`: `1 - cos(f_s, f_t)` over the flattened feature;
- `kl`: `T^2 * KL(softmax(f_t / T) || softmax(f_s / T))`, for logits (Hinton KD at layer `fc`);
- `kl-standardized`: `kl` between each image's logits standardized first (minus their mean,
  over their standard deviation: logit standardization, Sun et al., CVPR 2024), so the student
  matches the teacher's ranking and relative gaps among the classes, not the scale of its
  logits, which a much smaller network need not reach; `T` is then a base temperature on
  unit-variance logits;
- `dkd`: decoupled KD (Zhao et al., CVPR 2022), for logits: `T^2 * (TCKD + beta * NCKD)`, where
  TCKD is the KL between the teacher's and the student's binary split (the true class against
  the rest) and NCKD the KL between their distributions over the other classes. Plain KD is
  `TCKD + (1 - p_t[y]) * NCKD`: a confident teacher's non-target knowledge is scaled away, and
  `beta` (`DKD_BETA`, the paper's CIFAR-100 value) gives it back. It needs the labels.

Each image's term is counted only where its target is filled (`mask`), and the sum is divided
by the batch size, so a batch's feature loss weighs every image the same whether or not all of
them have targets.

With `mixup` (Zhang et al. 2018) the step mixes each batch with a shuffled copy of itself
before the student sees it, and a live teacher computes its targets on that same mixed view:
Beyer et al.'s "function matching" (CVPR 2022), which widens the views on which the student
matches the teacher; the CE term takes both labels, weighted by the mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.distributed import Distributed, wrap
from training.features import FeatureHooks
from training.loops import Step
from training.rounds import ModelStep

FeatureLossKind = Literal["l2", "cosine", "kl", "kl-standardized", "dkd"]
FEATURE_LOSSES: tuple[str, ...] = get_args(FeatureLossKind)
DKD_BETA = 8.0
Targets = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def decoupled_kl(student: Tensor, teacher: Tensor, labels: Tensor, temperature: float,
                 beta: float = DKD_BETA) -> Tensor:
    """Per image, `T^2 * (TCKD + beta * NCKD)` between logits (the module docstring), in log
    space: `log(1 - p[y])` is the log-sum-exp of the other classes' log-probabilities."""
    log_s = F.log_softmax(student / temperature, dim=1)
    log_t = F.log_softmax(teacher / temperature, dim=1)
    target = F.one_hot(labels, student.shape[1]).bool()
    others = torch.finfo(log_s.dtype).min

    def split(log_p: Tensor) -> tuple[Tensor, Tensor]:  # log p[y], log(1 - p[y])
        return (log_p.gather(1, labels[:, None]).squeeze(1),
                log_p.masked_fill(target, others).logsumexp(1))

    (in_s, out_s), (in_t, out_t) = split(log_s), split(log_t)
    tckd = in_t.exp() * (in_t - in_s) + out_t.exp() * (out_t - out_s)
    rest_s, rest_t = log_s - out_s[:, None], log_t - out_t[:, None]  # over the other classes
    nckd = torch.where(target, torch.zeros_like(rest_t), rest_t.exp() * (rest_t - rest_s)).sum(1)
    return (tckd + beta * nckd) * temperature**2


def standardized(logits: Tensor) -> Tensor:
    """Each row minus its mean, over its standard deviation (logit standardization)."""
    mean = logits.mean(1, keepdim=True)
    return (logits - mean) / (logits.std(1, keepdim=True) + 1e-7)


def feature_loss_per_image(student: Tensor, teacher: Tensor, kind: FeatureLossKind,
                           temperature: float = 4.0, labels: Tensor | None = None) -> Tensor:
    """The per-image distance `L(f_s, f_t)` (see the module docstring), shape `(batch,)`;
    `labels` only for `dkd`."""
    if student.shape != teacher.shape:
        raise ValueError(f"student feature {tuple(student.shape)} and teacher feature "
                         f"{tuple(teacher.shape)} differ: add an adapter")
    s, t = student.flatten(1).float(), teacher.flatten(1).float()
    if kind == "l2":
        return (s - t).pow(2).mean(1)
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(s, t, dim=1, eps=1e-6)
    if kind == "kl-standardized":
        s, t, kind = standardized(s), standardized(t), "kl"
    if kind == "kl":
        log_p_student = F.log_softmax(s / temperature, dim=1)
        log_p_teacher = F.log_softmax(t / temperature, dim=1)
        return (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(1) * temperature**2
    if kind == "dkd":
        if labels is None:
            raise ValueError("the dkd loss needs the images' labels")
        return decoupled_kl(s, t, labels, temperature)
    raise ValueError(f"unknown feature loss {kind!r}: use {', '.join(FEATURE_LOSSES)}")


def masked_feature_loss(student: Tensor, teacher: Tensor, mask: Tensor, kind: FeatureLossKind,
                        temperature: float = 4.0, labels: Tensor | None = None) -> Tensor:
    """`sum_i mask_i * L(f_s_i, f_t_i) / batch`: unfilled targets add nothing."""
    per_image = feature_loss_per_image(student, teacher, kind, temperature, labels)
    return torch.where(mask, per_image, torch.zeros_like(per_image)).sum() / len(per_image)


class FeatureLoss(nn.Module):
    """Holds a feature loss's kind and temperature (see `masked_feature_loss`)."""

    def __init__(self, kind: FeatureLossKind = "l2", temperature: float = 4.0) -> None:
        super().__init__()
        if kind not in FEATURE_LOSSES:
            raise ValueError(f"unknown feature loss {kind!r}: use {', '.join(FEATURE_LOSSES)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.kind: FeatureLossKind = kind
        self.temperature = temperature

    def forward(self, student: Tensor, teacher: Tensor, mask: Tensor,
                labels: Tensor | None = None) -> Tensor:
        return masked_feature_loss(student, teacher, mask, self.kind, self.temperature, labels)


class FeatureAdapter(nn.Module):
    """Maps a student feature to the teacher's feature shape; learned, trained with the student.

    Identity when the shapes match; a linear map between vectors; a 1x1 convolution (then
    average pooling to the teacher's size) between maps; pooling then a linear map from a map
    to a vector.
    """

    def __init__(self, student_shape: Sequence[int], teacher_shape: Sequence[int]) -> None:
        super().__init__()
        student_shape, teacher_shape = tuple(student_shape), tuple(teacher_shape)
        self.student_shape, self.teacher_shape = student_shape, teacher_shape
        if student_shape == teacher_shape:
            self.body: nn.Module = nn.Identity()
        elif len(student_shape) == 1 and len(teacher_shape) == 1:
            self.body = nn.Linear(student_shape[0], teacher_shape[0])
        elif len(student_shape) == 3 and len(teacher_shape) == 3:
            self.body = nn.Sequential(
                nn.Conv2d(student_shape[0], teacher_shape[0], 1, bias=False),
                nn.BatchNorm2d(teacher_shape[0]),
                nn.AdaptiveAvgPool2d(teacher_shape[1:]),
            )
        elif len(student_shape) == 3 and len(teacher_shape) == 1:
            self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(student_shape[0], teacher_shape[0]))
        else:
            raise ValueError(f"cannot adapt a student feature of shape {student_shape} to a "
                             f"teacher feature of shape {teacher_shape}: pick a student layer "
                             "with a feature map")

    def forward(self, feature: Tensor) -> Tensor:
        return self.body(feature)


def layer_shape(model: nn.Module, layer: str, example: Tensor) -> tuple[int, ...]:
    """The shape of one image's feature at `layer` (runs `example` through an eval pass)."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), FeatureHooks(model, [layer]) as hooks:
        model(example[:1])
    model.train(was_training)
    return tuple(hooks[layer].shape[1:])


class Mixup:
    """Mixes a batch with a shuffled copy of itself: `lam * x + (1 - lam) * x[perm]`, with
    `lam ~ Beta(alpha, alpha)` per batch and the permutation drawn from a generator seeded
    once (`seed`), so a stage's mixes are a function of its seed, on any runner."""

    def __init__(self, alpha: float, seed: int) -> None:
        if alpha <= 0:
            raise ValueError(f"mixup alpha must be positive, got {alpha}")
        self.alpha, self.rng = alpha, np.random.default_rng(seed)

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor, float]:
        """The mixed batch, the permutation that gives each image its partner, and `lam`."""
        lam = float(self.rng.beta(self.alpha, self.alpha))
        perm = torch.from_numpy(self.rng.permutation(len(x))).to(x.device)
        return lam * x + (1.0 - lam) * x[perm], perm, lam


def distillation_step(hooks: FeatureHooks, student_layer: str, adapter: nn.Module,
                      targets: Targets, loss: FeatureLoss, ce_weight: float = 1.0,
                      feature_weight: float = 1.0, label_smoothing: float = 0.0,
                      mixup: Mixup | None = None) -> Step:
    """A training step: `ce_weight * CE + feature_weight * feature loss` (module docstring).

    Args:
        hooks: forward hooks on the student that capture `student_layer`.
        adapter: maps the student's feature to the target's shape.
        targets: `(ids, images) -> (teacher features, filled mask)`, called on the images the
            student sees (mixed, with `mixup`).
        mixup: mixes each batch before the student and the targets see it; CE then weighs
            both labels of a mixed image by the mix.
    """

    def step(model: nn.Module, ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        if mixup is None:
            logits = model(x)
            ce = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
        else:
            x, perm, lam = mixup(x)
            logits = model(x)
            ce = lam * F.cross_entropy(logits, y, label_smoothing=label_smoothing) \
                + (1.0 - lam) * F.cross_entropy(logits, y[perm], label_smoothing=label_smoothing)
        teacher, filled = targets(ids, x)
        feature = loss(adapter(hooks[student_layer]), teacher, filled, y)
        return {"loss": ce_weight * ce + feature_weight * feature, "loss_ce": ce,
                "loss_feat": feature}

    return step


def bank_targets(bank, device: torch.device) -> Targets:
    """Targets read from a `FeatureBank` by dataset id."""

    def targets(ids: Tensor, _x: Tensor) -> tuple[Tensor, Tensor]:
        return bank.lookup(ids, device)

    return targets


def teacher_targets(teacher: nn.Module, layer: str) -> Targets:
    """Targets from a frozen teacher run on the same (augmented) images: every one is filled."""
    teacher.eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    hooks = FeatureHooks(teacher, [layer], detach=True)  # lives as long as the teacher

    def targets(_ids: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            teacher(x)
        return hooks[layer].float(), torch.ones(len(x), dtype=torch.bool, device=x.device)

    return targets


@dataclass(frozen=True)
class FeatureStep(ModelStep):
    """A student's step spec (`training.rounds.StepSpec`): `distillation_step` on the
    student's `layer` through its adapter (trained beside the network, under `adapter`)
    against the targets of a subclass (`targets`)."""

    layer: str
    adapter_shapes: tuple[tuple[int, ...], tuple[int, ...]]  # the student's, the target's
    feature_loss: FeatureLossKind
    temperature: float
    ce_weight: float
    feature_weight: float
    label_smoothing: float = 0.0
    mixup: float = 0.0  # Beta(alpha, alpha) of the batch's mix; 0: no mixing
    mixup_seed: int = 0

    def extras(self) -> dict[str, nn.Module]:
        return {"adapter": FeatureAdapter(*self.adapter_shapes)}

    def targets(self, device: torch.device, place: Distributed) -> Targets:
        raise NotImplementedError

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        adapter = extras["adapter"].train()
        if place.world_size > 1 and any(p.requires_grad for p in adapter.parameters()):
            adapter = wrap(adapter, device, place)  # its gradients averaged like the network's
        targets = self.targets(device, place)
        captured = stack.enter_context(FeatureHooks(model, [self.layer]))
        return wrap(model, device, place), distillation_step(
            captured, self.layer, adapter, targets,
            FeatureLoss(self.feature_loss, self.temperature), self.ce_weight,
            self.feature_weight, self.label_smoothing,
            Mixup(self.mixup, self.mixup_seed) if self.mixup > 0 else None)


@dataclass(frozen=True)
class DistillStep(FeatureStep):
    """A student stage against the feature `bank` (a `FeatureBank`, read by dataset id)."""

    bank: object = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.mixup > 0:
            raise ValueError("a bank holds each image's targets for one view, not for a mix of "
                             "two images: mixup needs a live teacher (targets states or final)")

    def targets(self, device: torch.device, place: Distributed) -> Targets:
        bank = self.bank if place.world_size == 1 else self.bank.to(device)
        return bank_targets(bank, device)


@dataclass(frozen=True)
class TeacherStep(FeatureStep):
    """The baselines' step (Hinton KD, FitNets, an L2 on the final teacher's logits): against
    a frozen `teacher` network run on the same augmented images at `teacher_layer`
    (`teacher_targets`), instead of a bank. One process only: the teacher is a live module."""

    teacher: nn.Module = field(kw_only=True)
    teacher_layer: str = field(kw_only=True)

    def targets(self, device: torch.device, place: Distributed) -> Targets:
        if place.world_size > 1:
            raise ValueError("a live teacher's targets are for one process")
        return teacher_targets(self.teacher.to(device), self.teacher_layer)


@dataclass(frozen=True)
class LabelsStep(FeatureStep):
    """A student on its labels alone (`--targets labels`): no target is filled, so the feature
    term adds nothing and the loss is CE (on both labels of a mixed image, with mixup). Runs
    in any number of processes."""

    def targets(self, device: torch.device, place: Distributed) -> Targets:
        shape = self.adapter_shapes[1]

        def unfilled(_ids: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
            return (torch.zeros(len(x), *shape, device=x.device),
                    torch.zeros(len(x), dtype=torch.bool, device=x.device))

        return unfilled
