"""What training and testing read of the descriptions, and what they do with the class texts:
the text bank of every image, the class descriptions' rows, which images keep their label and
which validation images the choices read (`TextSide`); the classifier started from the class
descriptions (`start_classifier`); a split's classifier and zero-shot scores (`score_split`);
and WiSE-FT's head mixing chosen on validation (`mix_head`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.image_text import ImageTextNet
from training.batches import Batches
from training.image_text.losses import (
    MAX_LOGIT_SCALE,
    TextBank,
    choose_mixing,
    class_text_weights,
    mixed_head,
    zero_shot_logits,
)
from training.loops import evaluate


@dataclass
class TextSide:
    """`features`: every distinct text's encoder vector; `bank`: each image's texts and their
    weights; `class_rows` / `class_labels`: the class descriptions' rows of `features` and their
    classes; `train`: the positions a round passes over; `labelled`: over all positions, which
    keep their label; `validation`: the validation positions the choices read; `unseen`: the
    labels of the classes left out of training."""

    features: Tensor
    bank: TextBank
    class_rows: Tensor
    class_labels: Tensor
    train: Tensor
    labelled: Tensor
    validation: Tensor
    unseen: Tensor

    def class_weights(self, model: ImageTextNet, device: torch.device) -> Tensor:
        """Each class's text direction in the shared space, times the similarity scale."""
        features = model.text_features(self.features[self.class_rows].to(device))
        scale = float(model.logit_scale.detach().clamp(max=MAX_LOGIT_SCALE).exp())
        return class_text_weights(features, self.class_labels.to(device),
                                  model.head.out_features, scale)


def start_classifier(model: ImageTextNet, side: TextSide, text_init: bool, seed: int,
                     device: torch.device) -> None:
    """The classifier's weights from the class descriptions (`text_init`) or random
    directions of the same norm (the ablation, seeded by `seed`)."""
    with torch.no_grad():
        weights = side.class_weights(model, device)
        if not text_init:
            generator = torch.Generator().manual_seed(seed + 11)
            random = torch.randn(weights.shape, generator=generator).to(device)
            weights = torch.nn.functional.normalize(random, dim=1) * weights.norm(dim=1,
                                                                                  keepdim=True)
        model.head.weight.copy_(weights)


@torch.no_grad()
def score_split(model: ImageTextNet, side: TextSide, batches: Batches,
                device: torch.device) -> dict[str, float]:
    """The classifier's accuracy and loss on `batches` (a split, or the validation images the
    choices read), its zero-shot accuracy from the class descriptions, and both on the unseen
    classes' images alone (when there are any)."""
    model.eval()
    result = evaluate(model, batches, device)
    weights = side.class_weights(model, device)
    labels, head, zero_shot = [], [], []
    for _ids, x, y in batches:
        features = model.image_features(x)
        labels.append(y)
        head.append(model.head(features).argmax(1))
        zero_shot.append(zero_shot_logits(features, weights).argmax(1))
    y, head_pred, zero_pred = torch.cat(labels), torch.cat(head), torch.cat(zero_shot)
    scores = {"accuracy": result["accuracy"], "loss": result["loss"],
              "zero_shot_accuracy": float((zero_pred == y).float().mean())}
    unseen = torch.isin(y, side.unseen.to(y.device))
    if bool(unseen.any()):
        scores |= {"unseen_zero_shot_accuracy": float((zero_pred == y)[unseen].float().mean()),
                   "unseen_accuracy": float((head_pred == y)[unseen].float().mean()),
                   "seen_accuracy": float((head_pred == y)[~unseen].float().mean())}
    return scores


@torch.no_grad()
def mix_head(model: ImageTextNet, side: TextSide, batches: Batches,
             device: torch.device) -> tuple[float, dict[float, float]]:
    """WiSE-FT on the classifier: its weights become `alpha * trained + (1 - alpha) *
    zero-shot` (the class descriptions' weights, `TextSide.class_weights`), alpha chosen on
    `batches` (`choose_mixing`); sets the mixed head and returns alpha and every alpha's
    accuracy."""
    model.eval()
    features, labels = [], []
    for _ids, x, y in batches:
        features.append(model.image_features(x))
        labels.append(y)
    zero_shot = side.class_weights(model, device)
    trained = model.head.weight.detach().clone()
    alpha, accuracies = choose_mixing(torch.cat(features), torch.cat(labels), trained,
                                      zero_shot)
    model.head.weight.copy_(mixed_head(trained, zero_shot, alpha))
    return alpha, accuracies


def start_backbone(model: ImageTextNet, weights: dict[str, Tensor]) -> None:
    """The image side starts from a classifier's `weights` (the same network): every one but
    its classifier (`fc`), which the image-text network replaces."""
    kept = {k: v for k, v in weights.items() if not k.startswith("fc.")}
    missing, unexpected = model.backbone.load_state_dict(kept, strict=False)
    if unexpected or [k for k in missing if not k.startswith("fc.")]:
        raise ValueError(f"the start checkpoint is another network's: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
