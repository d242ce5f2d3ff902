"""The `pipeline` flow's config (`flows/pipeline.py`): the `distill` flow's fields, then one
group per later step (the image-text step where descriptions are given, PBT on the student,
sparsity fine-tuning, the teacher fallback). Each step runs on the config of its own flow,
built here (`image_text_config`, `pbt_config`, `sparsify_config`), so a step trains exactly as
its flow would."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tasks.configs.distill import DistillConfig
from tasks.configs.image_text import ImageTextConfig, ImageTextNetwork
from tasks.configs.pbt import PBTConfig
from tasks.configs.sections import CommaList, ModelSection, StrictConfig, same_field
from tasks.configs.sparsify import SparsifyConfig, SparsifyNetwork
from training.promotion import ALPHA

# The pipeline's distillation: the recipe its step table was measured with (a bank of pooled
# features, cosine, the student's fitted budget, a cold teacher), not `distill`'s default (a
# warm teacher's states on the student's batches, 3x the student's budget), which would about
# double `make run`; PBT and the sparse step train the student further.
PIPELINE_DISTILL: dict[str, Any] = {
    "targets": "bank", "teacher_layer": "pool", "student_layer": "pool",
    "feature_loss": "cosine", "feature_weight": 1.0, "ce_weight": 1.0, "temperature": 4.0,
    "student_patience": 1, "teacher_pretrain_rounds": 0}


class TextStep(StrictConfig):
    """The image-text step, only where the run has descriptions: the distilled student's image
    side trains against the texts (one alignment round, then these) before PBT, and is kept
    only where it helps on validation (the `image-text` flow's fields)."""

    RENAMED: ClassVar[dict[str, str]] = {"epochs": "rounds"}

    encoder: Literal["minilm", "builtin"] = same_field(ImageTextConfig, "text_encoder")
    rounds: int = same_field(ImageTextConfig, "rounds", 3)
    lr: float = same_field(ImageTextConfig, "lr", 0.01)  # a fine-tuning of the student


class PBTStep(StrictConfig):
    """PBT on the distilled student: every member starts from it, after one burn-in round (the
    `pbt` flow's fields)."""

    RENAMED: ClassVar[dict[str, str]] = {"round_epochs": "stage_rounds"}

    members: int = same_field(PBTConfig, "members", 3)
    stages: int = same_field(PBTConfig, "stages", 2)
    stage_rounds: int = same_field(PBTConfig, "stage_rounds", 1)
    # a fine-tuning: below a fresh run's range
    lr_range: CommaList[tuple[float, float]] = same_field(PBTConfig, "lr_range", (0.005, 0.1))


class SparseStep(StrictConfig):
    """Activation-sparsity fine-tuning of PBT's best (the `sparsify` flow's fields; the term's
    own are the config's `transform`, `sparsity_lambda`, ...)."""

    RENAMED: ClassVar[dict[str, str]] = {"epochs": "rounds"}

    rounds: int = same_field(SparsifyConfig, "rounds", 4)
    lr: float = same_field(SparsifyConfig, "lr", 0.01)
    layers: CommaList[tuple[str, ...]] | None = same_field(SparsifyConfig, "sparse_layers")


class FallbackStep(StrictConfig):
    """The fallback cascade: the sparse student answers what it is sure of, the teacher the
    rest."""

    # 0.01: the most of `python -m bench.fallback_tolerance`'s sweep at which the cascade's net
    # validation accuracy stays above the teacher's alone (docs/pipeline.md)
    tolerance: float = Field(0.01, ge=0.0, le=1.0, description="the student answers an image "
                             "when its confidence is above a threshold, calibrated on "
                             "validation as the cheapest that loses at most this fraction of "
                             "the images the teacher gets right; every image (registered "
                             "alone) where that cascade is at most this much more accurate on "
                             "validation than the student alone; 1: the student alone")
    predictor: Literal["fitted", "fixed"] = Field(
        "fitted", description="which images the student passes on: fitted, a predictor on "
        "the student's outputs fitted on half the validation split competes with the "
        "confidence rule on the other half and is kept only where it is cheaper at the same "
        "accuracy (as `cascade --predictor fitted`); fixed: the confidence rule")
    # the registry's level: on ~85 validation images a cascade one or two images ahead of the
    # student was registered, bigger than `train`'s model and no faster (bench.small_data
    # 1000x28, seeds 3-5; docs/pipeline.md)
    level: float = Field(ALPHA, gt=0.0, le=1.0, description="the cascade is registered only "
                         "where its validation advantage over the student alone is also "
                         "significant at this level (McNemar's exact test, one-sided, as the "
                         "registry decides); 1: any advantage beyond the tolerance")
    timing_images: int = Field(1000, ge=1, le=1_000_000, description="test images the "
                               "student, the teacher and the cascade are timed on at batch 1 "
                               "(the table of steps: at most 300 of them)")


class PipelineConfig(DistillConfig):
    """The retraining run that chains the techniques: the data check, the `distill` stages
    (data queue, teacher stages, bank snapshots, student), PBT on the distilled student,
    activation-sparsity fine-tuning of PBT's best, and a fallback cascade (the sparse student
    answers what it is sure of, the teacher the rest), registered and promoted as one model.

    The distillation's fields are the config's own (it is a `DistillConfig`); each later step
    is a section whose command-line names carry its prefix (`--pbt-members` is `pbt.members`)."""

    SECTION_PREFIXES: ClassVar[dict[str, str]] = {
        "text": "text_", "pbt": "pbt_", "sparse": "sparse_", "fallback": "fallback_"}
    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {**DistillConfig.PROFILES["smoke"], **PIPELINE_DISTILL, "pbt_members": 2,
                  "pbt_stages": 1, "fallback_timing_images": 32,
                  "sparse_rounds": 1, "zero_threshold_tolerance": None,
                  "text_encoder": "builtin", "text_rounds": 1},
        "quick": PIPELINE_DISTILL,
        "full": {**DistillConfig.PROFILES["full"], **PIPELINE_DISTILL, "pbt_members": 8,
                 "pbt_stages": 6,
                 "pbt_stage_rounds": 3, "sparse_rounds": 8},
    }

    text: TextStep = Field(default_factory=TextStep)
    pbt: PBTStep = Field(default_factory=PBTStep)
    sparse: SparseStep = Field(default_factory=SparseStep)
    fallback: FallbackStep = Field(default_factory=FallbackStep)
    # which descriptions the image-text step reads; with neither, the step is skipped
    captions: str | None = Field(None, description="image-text step: a table of descriptions "
                                 "(CSV or Parquet: columns image, text, and optionally "
                                 "weight); with it or --class-descriptions, the distilled "
                                 "student's image side trains against the texts before PBT "
                                 "and is kept only where it helps on validation; with "
                                 "neither, the step is skipped")
    class_descriptions: str | None = Field(None, description="image-text step: a table of "
                                           "class descriptions (CSV or Parquet: columns class, "
                                           "text, and optionally weight); each image gets its "
                                           "class's and phrases measured from it")
    # the sparsity term of the sparse step (the `sparsify` flow's fields)
    transform: Literal["abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer"] = \
        same_field(SparsifyConfig, "transform")
    sparsity_lambda: float = same_field(SparsifyConfig, "sparsity_lambda", 0.3)
    lambda_gamma: float = same_field(SparsifyConfig, "lambda_gamma", 0.5)
    zero_threshold_tolerance: float | None = same_field(SparsifyConfig,
                                                        "zero_threshold_tolerance", 0.002)
    # 1: a step goes on wherever it is not below the step before on validation. Below 1 was
    # written after 1000x28 seed 9 (PBT two images ahead on 80 validation images, 1.5 points
    # lost on test); on fresh seeds (1000x28 10-11, 2500x16 12-14) it helped no more than it
    # hurt, so 1 stays the default (bench.small_data, docs/pipeline.md)
    step_level: float = Field(1.0, gt=0.0, le=1.0, description="PBT's and the sparse step's "
                              "model goes on only where it is not below the step before on "
                              "validation and its advantage there is significant at this level "
                              "(McNemar's exact test, one-sided, as the registry decides); 1: "
                              "wherever it is not below")
    skip_unchanged: bool = Field(True, description="when the registered champion was trained "
                                 "by this pipeline on the same data version with the same "
                                 "config and code, finish at once without training (scheduled "
                                 "retraining on unchanged data)")

    @model_validator(mode="after")
    def _steps_valid(self) -> PipelineConfig:
        # each step's own config validates its fields (layers of the student, tables, ...)
        self.pbt_config()
        self.sparsify_config()
        if self.has_descriptions:
            self.image_text_config()
        return self

    @property
    def has_descriptions(self) -> bool:
        """Whether the run has descriptions, so the image-text step runs."""
        return self.captions is not None or self.class_descriptions is not None

    def image_text_config(self) -> ImageTextConfig:
        """The image-text step's config: the student's network, the descriptions given, one
        alignment round and `text_rounds` joint ones at `text_lr`."""
        return ImageTextConfig(
            profile=self.profile, dataset=self.dataset, run=self.run,
            network=ImageTextNetwork(**self.student_network().model_dump()),
            optim=self.optim.replace(lr=self.text.lr), rounds=self.text.rounds,
            align_rounds=1, captions=self.captions, class_descriptions=self.class_descriptions,
            text_encoder=self.text.encoder)

    def student_network(self) -> ModelSection:
        """The distilled student's network, which every later step trains."""
        return ModelSection(model=self.student_model, width=self.student_width)

    def pbt_config(self) -> PBTConfig:
        """The PBT step's config: the pipeline's sections, the student's network, the
        pipeline's population."""
        return PBTConfig(
            profile=self.profile, dataset=self.dataset, run=self.run, cluster=self.cluster,
            network=self.student_network(),
            optim=self.optim.replace(lr=min(self.optim.lr, self.pbt.lr_range[1])),
            members=self.pbt.members, stages=self.pbt.stages,
            stage_rounds=self.pbt.stage_rounds, burn_in_rounds=1, lr_range=self.pbt.lr_range)

    def sparsify_config(self) -> SparsifyConfig:
        """The sparsity fine-tuning's config: the student's network, the `sparse` step's
        rounds."""
        return SparsifyConfig(
            profile=self.profile, dataset=self.dataset, run=self.run,
            network=SparsifyNetwork(**self.student_network().model_dump()),
            optim=self.optim.replace(lr=self.sparse.lr), rounds=self.sparse.rounds,
            sparse_layers=self.sparse.layers, transform=self.transform,
            sparsity_lambda=self.sparsity_lambda, lambda_gamma=self.lambda_gamma,
            zero_threshold_tolerance=self.zero_threshold_tolerance)
