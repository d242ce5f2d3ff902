"""Image-text training, pure torch: the weighted multi-description contrastive loss, the
text-initialized classifier, zero-shot classification, WiSE-FT's mix of the trained and the
zero-shot heads, and the step that combines the sub-losses.

Texts are rows of a captions table, each owned by one image, with a weight; identical texts are
one text (`text_id`). In a batch of B images and T text rows:

- image -> text: for image i, each of its own texts t (positive) is scored against the texts
  that are neither its own nor (where both labels are known) of its class; its term is
  `-log(exp(s_it) / (exp(s_it) + sum_n exp(s_in)))`, weighted by the text's weight. An image's
  other descriptions are never in the denominator, so they never push each other down.
- text -> image: text t against the images that neither own it (by `text_id`) nor share its
  class; weighted the same.

The loss is the mean of both directions, each the weighted mean of its terms; the similarity
is the cosine times a learned scale `exp(logit_scale)`, clamped to at most 100 as CLIP does.

With `agreement` (a temperature over cosines) a row's weight is also multiplied by how well the
image agrees with that text, relative to its other texts: `n_i x softmax over i's own texts of
cos(i, t) / agreement`, computed without gradient (1 for an image's only text, and the mean
over an image's rows stays 1). A description that does not fit the image (a measured phrase
shared with other classes, a captioner's mistake) then pulls less than one that does, whatever
weight its kind was given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.distributed import Distributed
from training.loops import Step
from training.rounds import ModelStep

MAX_LOGIT_SCALE = math.log(100.0)  # CLIP clamps exp(logit_scale) to 100
UNLABELLED = -1  # the label of an image whose class is not known


def _positive_terms(logits: Tensor, positive: Tensor, excluded: Tensor) -> Tensor:
    """`-log(exp(l_p) / (exp(l_p) + sum over negatives exp(l_n)))` for every (row, p) with
    `positive[row, p]`; negatives are the entries neither positive nor `excluded`."""
    negative = ~(positive | excluded)
    masked = logits.masked_fill(~negative, float("-inf"))
    negatives = torch.logsumexp(masked, dim=1, keepdim=True)  # -inf when a row has none
    both = torch.logaddexp(logits, negatives.expand_as(logits))
    return (both - logits)[positive]


def agreement_weights(image_features: Tensor, text_features: Tensor, owner: Tensor,
                      temperature: float) -> Tensor:
    """Each text row's agreement with its image among that image's texts (T): `n_i x softmax
    over image i's rows of cos / temperature`, i the row's owner and n_i its row count; no
    gradient flows through it."""
    with torch.no_grad():
        cosine = (image_features[owner] * text_features).sum(1).float() / temperature
        images = len(image_features)
        top = torch.full((images,), float("-inf"), device=cosine.device).scatter_reduce(
            0, owner, cosine, reduce="amax")
        scores = (cosine - top[owner]).exp()
        totals = torch.zeros(images, device=cosine.device).index_add(0, owner, scores)
        counts = torch.bincount(owner, minlength=images).to(scores.dtype)
        return scores / totals[owner] * counts[owner]


def contrastive_loss(image_features: Tensor, text_features: Tensor, owner: Tensor,
                     text_ids: Tensor, weights: Tensor, labels: Tensor,
                     logit_scale: Tensor, agreement: float = 0.0) -> Tensor:
    """The symmetric weighted multi-description contrastive loss (see the module docstring).

    Args:
        image_features: B x D, L2-normalized.
        text_features: T x D, L2-normalized.
        owner: T, the batch position (0..B-1) of the image each text row describes.
        text_ids: T, one id per distinct text (rows with the same id are the same text).
        weights: T, each row's weight (> 0).
        labels: B, the images' classes, `UNLABELLED` where unknown.
        logit_scale: the log of the similarity scale (clamped to at most log 100 here).
        agreement: above 0, each row's weight times `agreement_weights` at this temperature.
    """
    if agreement > 0:
        weights = weights * agreement_weights(image_features, text_features, owner, agreement)
    batch = len(image_features)
    scale = logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
    logits = scale * image_features @ text_features.T  # B x T
    images = torch.arange(batch, device=owner.device)
    # image i owns text t when some row of i's carries t's text id
    owns_row = owner.unsqueeze(0) == images.unsqueeze(1)  # B x T, by row
    same_text = text_ids.unsqueeze(0) == text_ids.unsqueeze(1)  # T x T
    owns = (owns_row.float() @ same_text.float()) > 0  # B x T, by text id
    text_labels = labels[owner]
    known = (labels.unsqueeze(1) != UNLABELLED) & (text_labels.unsqueeze(0) != UNLABELLED)
    same_class = known & (labels.unsqueeze(1) == text_labels.unsqueeze(0))
    excluded = owns | same_class  # never negatives; only a row's own texts are positives
    row_weights = weights.unsqueeze(0).expand(batch, -1)
    image_terms = _positive_terms(logits, owns_row, excluded & ~owns_row)
    image_loss = (image_terms * row_weights[owns_row]).sum() / row_weights[owns_row].sum()
    text_terms = _positive_terms(logits.T, owns_row.T, excluded.T & ~owns_row.T)
    text_loss = (text_terms * row_weights.T[owns_row.T]).sum() / row_weights.T[owns_row.T].sum()
    return (image_loss + text_loss) / 2


def class_text_weights(text_features: Tensor, text_classes: Tensor, classes: int,
                       scale: float) -> Tensor:
    """A classifier's weights from its classes' descriptions, as WiSE-FT builds its zero-shot
    head: each description's feature normalized, averaged per class, renormalized, times
    `scale`. Raises `ValueError` naming the classes without a description."""
    features = F.normalize(text_features, dim=1)
    missing = [c for c in range(classes) if not bool((text_classes == c).any())]
    if missing:
        raise ValueError(f"no description for classes {missing}")
    rows = [features[text_classes == c].mean(0) for c in range(classes)]
    return F.normalize(torch.stack(rows), dim=1) * scale


def zero_shot_logits(image_features: Tensor, class_weights: Tensor) -> Tensor:
    """Logits of normalized image features against per-class text weights."""
    return image_features @ class_weights.T


MIXING_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the grid `choose_mixing` tries


def mixed_head(trained: Tensor, zero_shot: Tensor, alpha: float) -> Tensor:
    """WiSE-FT's weight-space ensemble of two classifier heads on the same features:
    `alpha * trained + (1 - alpha) * zero_shot` (alpha 1: the trained head, 0: zero-shot).

    Raises:
        ValueError: `alpha` outside [0, 1], or heads of different shapes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if trained.shape != zero_shot.shape:
        raise ValueError(f"the heads differ in shape: trained {tuple(trained.shape)}, "
                         f"zero-shot {tuple(zero_shot.shape)}")
    return alpha * trained + (1 - alpha) * zero_shot


def choose_mixing(features: Tensor, labels: Tensor, trained: Tensor, zero_shot: Tensor,
                  alphas: Sequence[float] = MIXING_ALPHAS) -> tuple[float, dict[float, float]]:
    """The mixing weight whose `mixed_head` classifies `features` (N x D, the validation
    images') best: accuracy of `argmax(features @ mixed_head(alpha).T)` against `labels` for
    each alpha; ties go to the larger alpha (the trained head, unless the zero-shot one
    measurably helps). Returns the alpha and every alpha's accuracy.

    Raises:
        ValueError: no images or no alphas.
    """
    if len(features) == 0 or not alphas:
        raise ValueError(f"choose_mixing needs images and alphas, got {len(features)} images "
                         f"and {len(alphas)} alphas")
    accuracies = {float(alpha): float((zero_shot_logits(
        features, mixed_head(trained, zero_shot, alpha)).argmax(1) == labels).float().mean())
        for alpha in alphas}
    best = max(accuracies.values())
    return max(a for a, accuracy in accuracies.items() if accuracy == best), accuracies


@dataclass(frozen=True)
class TextBank:
    """Every image's texts, on one device: image `p` (a dataset position) owns the rows
    `start[p]:start[p+1]` of `text_ids` and `weights`; `features` holds one entry per distinct
    text (precomputed vectors, or token ids a text encoder reads)."""

    start: Tensor
    text_ids: Tensor
    weights: Tensor
    features: Tensor

    @classmethod
    def build(cls, positions: Sequence[int], text_ids: Sequence[int],
              weights: Sequence[float], images: int, features: Tensor) -> TextBank:
        """From rows (image position, text id, weight), any order."""
        position = torch.as_tensor(positions, dtype=torch.long)
        order = torch.argsort(position, stable=True)
        counts = torch.bincount(position, minlength=images)
        start = torch.zeros(images + 1, dtype=torch.long)
        start[1:] = counts.cumsum(0)
        return cls(start, torch.as_tensor(text_ids, dtype=torch.long)[order],
                   torch.as_tensor(weights, dtype=torch.float32)[order], features)

    def to(self, device: torch.device) -> TextBank:
        return TextBank(self.start.to(device), self.text_ids.to(device),
                        self.weights.to(device), self.features.to(device))

    def rows_of(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """For a batch of dataset positions: each text row's owner (its batch position), text
        id and weight; images without texts own no rows."""
        starts, ends = self.start[ids], self.start[ids + 1]
        counts = ends - starts
        owner = torch.repeat_interleave(torch.arange(len(ids), device=ids.device), counts)
        first = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
        rows = first + torch.arange(int(counts.sum()), device=ids.device)
        return owner, self.text_ids[rows], self.weights[rows]


def image_text_step(bank: TextBank, labelled: Tensor, contrastive_weight: float,
                    ce_weight: float, label_smoothing: float = 0.0, agreement: float = 0.0):
    """The training step (`training.loops.Step`) of an `ImageTextNet`: `ce_weight` x the
    classifier's CE on the labelled images of the batch (`labelled[position]`) plus
    `contrastive_weight` x `contrastive_loss` on every image that has texts (its rows weighted
    by agreement too where `agreement` > 0). A term with weight 0 is not computed."""

    def step(model: nn.Module, ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        image_features = model.image_features(x)
        losses: dict[str, Tensor] = {}
        total = image_features.new_zeros(())
        if ce_weight > 0:
            known = labelled[ids]
            logits = model.head(image_features)
            ce = (F.cross_entropy(logits[known], y[known], label_smoothing=label_smoothing)
                  if bool(known.any()) else logits.sum() * 0)
            losses["loss_ce"] = ce
            total = total + ce_weight * ce
        if contrastive_weight > 0:
            owner, text_ids, weights = bank.rows_of(ids)
            if len(owner):
                unique, inverse = torch.unique(text_ids, return_inverse=True)
                text_features = model.text_features(bank.features[unique])[inverse]
                labels = torch.where(labelled[ids], y, torch.full_like(y, UNLABELLED))
                contrast = contrastive_loss(image_features, text_features, owner, text_ids,
                                            weights, labels, model.logit_scale, agreement)
            else:
                contrast = image_features.sum() * 0
            losses["loss_contrastive"] = contrast
            total = total + contrastive_weight * contrast
        losses["loss"] = total
        return losses

    return step


@dataclass(frozen=True)
class ImageTextStep(ModelStep):
    """An image-text round's step spec (`training.rounds.StepSpec`): `image_text_step` over
    the images' texts (`bank`) and which positions keep their label (`labelled`). In one
    process only: the contrastive loss takes the other images of the batch as negatives, and
    a DDP process would see only its share of them."""

    bank: TextBank
    labelled: Tensor
    contrastive_weight: float
    ce_weight: float
    label_smoothing: float = 0.0
    agreement: float = 0.0

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        if place.world_size > 1:
            raise ValueError("an image-text round trains in one process only")
        return model, image_text_step(self.bank.to(device), self.labelled.to(device),
                                      self.contrastive_weight, self.ce_weight,
                                      self.label_smoothing, self.agreement)
