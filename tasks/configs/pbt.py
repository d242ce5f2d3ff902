"""The `pbt` flow's config."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from tasks.configs.sections import CommaList, ModelSection, ProfiledConfig, RunnerSection


class PBTConfig(ProfiledConfig):
    """The `pbt` flow: a population trained in stages; the best member's weights are copied to
    the others, which then explore hyperparameters around the best's.

    `lr`, `weight_decay`, `momentum` and `augment` are the burn-in values (the same for every
    member); the stages search them within the `*_range` bounds.
    """

    RENAMED: ClassVar[dict[str, str]] = {"burn_in_epochs": "burn_in_rounds",
                                         "round_epochs": "stage_rounds"}
    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"model": "cnn2", "members": 2, "burn_in_rounds": 1, "stage_rounds": 1,
                  "stages": 2, "train_limit": 512, "test_limit": 256, "val_limit": 1000,
                  "batch_size": 64,
                  "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {"model": "lenet"},  # N members: a network that trains in a minute each
        "full": {"train_limit": None, "members": 8, "burn_in_rounds": 5, "stage_rounds": 5,
                 "stages": 11, "width": 32, "batch_size": 256},
    }

    network: ModelSection = Field(default_factory=ModelSection)
    cluster: RunnerSection = Field(default_factory=RunnerSection)
    members: int = Field(4, ge=2, le=256, description="N: networks in the population")
    burn_in_rounds: int = Field(1, ge=1, le=1000, description="rounds every member trains with "
                                "the same hyperparameters before the stages (Ray Tune's "
                                "burn-in period), each one pass over the training images "
                                "(repeated on a small data set, see min_steps) and one task")
    burn_in_patience: int | None = Field(None, ge=1, description="end the burn-in early after "
                                         "this many rounds without a better validation "
                                         "accuracy; none: all burn-in rounds")
    stage_rounds: int = Field(2, ge=1, le=1000, description="rounds each member trains per "
                              "stage, in one task (each round one pass over the training "
                              "images, repeated on a small data set)")
    stages: int = Field(4, ge=1, le=10000, description="stop after this many stages")
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0, description="stop once the "
                                          "best validation accuracy reaches this")
    stage_patience: int | None = Field(None, ge=1, description="stop after this many stages "
                                       "without a better best validation accuracy")
    average_decay: float | None = Field(
        0.98, gt=0.0, lt=1.0, description="from the first stage on, members keep an exponential "
        "moving average of their weights with this decay per step; each round scores both the "
        "last weights and the average (its BatchNorm statistics re-estimated) and keeps the "
        "better, so a member with a large learning rate is not ranked on its noisiest weights; "
        "none: the last weights only")
    soup: bool = Field(True, description="after the last stage, average the members' weights "
                       "greedily (a model soup: the best first, each other added only if "
                       "validation accuracy does not drop) and keep the average when it holds "
                       "two or more members")
    tie_margin: float | None = Field(None, ge=0.0, le=1.0, description="the incumbent (the "
                                     "last stage's best; at stage 1 member 0, which starts from "
                                     "the configured values) stays the best unless another "
                                     "member beats it on validation by more than this, so the "
                                     "search leaves the configured values only on evidence; "
                                     "none: one standard error of the best score (3.6 points "
                                     "on 120 images, 0.8 on 2,000); 0: the highest score")
    lr_range: CommaList[tuple[float, float]] = Field(
        (0.005, 0.3), description="bounds of the learning rate (log scale)")
    weight_decay_range: CommaList[tuple[float, float]] = Field(
        (1e-5, 5e-3), description="bounds of the weight decay (log scale)")
    momentum_range: CommaList[tuple[float, float]] = Field(
        (0.5, 0.99), description="bounds of the momentum (linear scale)")
    augment_range: CommaList[tuple[float, float]] = Field(
        (0.0, 1.0), description="bounds of the augmentation strength (linear scale)")
    explore_factors: CommaList[tuple[float, float]] = Field(
        (0.5, 2.0), description="a log-scale value is the best's times a factor in this range")
    explore_step: float = Field(0.25, gt=0.0, le=1.0, description="a linear-scale value moves "
                                "by up to this fraction of its range from the best's")
    explore: bool = Field(True, description="draw the members' hyperparameters and explore "
                          "around the best's after each stage; --no-explore: every member "
                          "keeps the configured values and the stages only copy the best's "
                          "weights (the control exploration must beat)")
    knn_k: int = Field(5, ge=1, le=1000, description="neighbours that vote when the final "
                       "model's embeddings recognize the test split against the training split")

    @model_validator(mode="after")
    def _ordered_ranges(self) -> PBTConfig:
        for name in ("lr_range", "weight_decay_range", "momentum_range", "augment_range",
                     "explore_factors"):
            low, high = getattr(self, name)
            if not low < high:
                raise ValueError(f"{name}: low {low} must be below high {high}")
        if self.lr_range[0] <= 0 or self.weight_decay_range[0] <= 0:
            raise ValueError("lr_range and weight_decay_range are log scales: bounds must be "
                             "positive")
        if self.momentum_range[1] >= 1 or self.augment_range[1] > 1:
            raise ValueError("momentum_range must stay below 1 and augment_range within [0, 1]")
        return self
