"""The `distill` flow's config."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

import models
from tasks.configs.sections import ModelSection, ProfiledConfig, RunnerSection


def _layers_of(model: str) -> tuple[tuple[str, ...], int]:
    """A registered model's feature layers (and the classifier `fc`) and its depth."""
    network = models.build_model(model, 1, 2, 4)
    return (*network.feature_layers, "fc"), network.depth


# `--targets auto`: each candidate's student fields over the config's own (the order breaks a
# tie on validation); `final` is plain KD, at Hinton's temperature whatever --temperature says;
# `standardized` is KD from the last state on standardized logits with the recipe of its paper
# (Sun et al., CVPR 2024: base temperature 2, CE 0.1 and KD 9), taken as published, not tuned
AUTO_CANDIDATES: dict[str, dict[str, Any]] = {
    "labels": {"targets": "labels", "feature_weight": 0.0, "ce_weight": 1.0},
    "final": {"targets": "final", "temperature": 4.0},
    "states": {"targets": "states"},
    "standardized": {"targets": "final", "feature_loss": "kl-standardized", "temperature": 2.0,
                     "ce_weight": 0.1, "feature_weight": 9.0},
}


class DistillConfig(ProfiledConfig):
    """The `distill` flow: a deeper teacher trained in stages; a shallower, patient student
    learns stage by stage from the labels and the teacher's states (each state run on the
    student's own batches; or the feature bank the states fill, or the last state, or the
    labels alone; by default once with each of four, the best on validation kept)."""

    RENAMED: ClassVar[dict[str, str]] = {"teacher_pretrain_epochs": "teacher_pretrain_rounds"}
    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"teacher_model": "resnet8", "student_model": "cnn2", "stages": 2,
                  "train_limit": 512, "test_limit": 256, "val_limit": 1000, "batch_size": 64,
                  "lr": 0.1, "student_patience": 1, "teacher_pretrain_rounds": 0,
                  "targets": "states", "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {},
        "full": {"train_limit": None, "stages": 60, "teacher_width": 32, "batch_size": 256,
                 "lr": 0.1, "warmup_rounds": 1.0},
    }

    cluster: RunnerSection = Field(default_factory=RunnerSection)
    teacher_model: str = Field("resnet18", description="the teacher network (deeper than the "
                               "student)")
    teacher_width: int | None = Field(None, ge=1, le=1024, description="the teacher's width; "
                                      "none: the model's default")
    student_model: str = Field("lenet", description="the student network, the final model")
    student_width: int | None = Field(None, ge=1, le=1024, description="the student's width; "
                                      "none: the model's default")
    stages: int = Field(10, ge=2, le=10000, description="S: teacher and student stages")
    teacher_pretrain_rounds: int = Field(8, ge=0, le=1000, description="rounds the teacher "
                                         "trains on all training images before stage 1 (each "
                                         "one pass, repeated on a small data set, see "
                                         "min_steps; a warm start: its state 0, which "
                                         "--initial-bank teacher fills the bank from); 0: from "
                                         "the seeded weights")
    teacher_fraction: float = Field(0.8, gt=0.0, lt=1.0, description="N/M: the share of the M "
                                    "training images the teacher draws per stage")
    student_fraction: float = Field(0.8, gt=0.0, lt=1.0, description="P/M: the share of the "
                                    "training images the student draws per stage")
    front_weight: float = Field(2.0, gt=0.0, description="draw weight of an image not drawn "
                                "in the previous stage")
    back_weight: float = Field(1.0, gt=0.0, description="draw weight of an image drawn in the "
                               "previous stage")
    student_queue: Literal["recency", "uniform"] = Field("recency", description="how the "
                                                         "student draws: like the teacher, or "
                                                         "uniformly")
    teacher_layer: str = Field("fc", description="the teacher layer whose features fill "
                               "the bank (`fc`: the logits)")
    student_layer: str = Field("fc", description="the student layer matched to the bank "
                               "through the adapter")
    feature_loss: Literal["l2", "cosine", "kl", "kl-standardized", "dkd"] = Field(
        "kl", description="the feature sub-loss (kl: on softened outputs; kl-standardized: kl "
        "on each image's logits standardized to mean 0 and unit deviation first; dkd: "
        "decoupled KD on the logits, the target class apart from the others, both layers `fc`)")
    feature_weight: float = Field(0.5, ge=0.0, le=1000.0, description="weight of the feature "
                                  "sub-loss")
    ce_weight: float = Field(0.5, ge=0.0, le=1000.0, description="weight of the CE sub-loss")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="softening temperature of "
                               "the kl, kl-standardized and dkd feature losses")
    bank_mode: Literal["single", "per-state"] = Field("single", description="single: one bank, "
                                                      "each entry from the state that last "
                                                      "wrote it; per-state: bank s kept for "
                                                      "each stage s")
    bank_dtype: Literal["float16", "bfloat16", "float32"] = Field("float16", description="how "
                                                                  "bank features are stored")
    bank_memmap: bool = Field(False, description="memory-map banks from disk instead of "
                              "loading them (for banks larger than memory)")
    initial_bank: Literal["masked", "teacher"] = Field("masked", description="masked: entries "
                                                       "no stage wrote are left out of the "
                                                       "loss; teacher: filled by the initial "
                                                       "teacher (state 0)")
    bank_views: Literal["clean", "augmented"] = Field(
        "clean", description="clean: the bank holds the teacher's features of each image "
        "unaugmented (the student trains on other, augmented views); augmented: each entry "
        "records the augmented view its teacher state saw, and the student is shown that same "
        "view of the image (a consistent bank)")
    bank_average: Literal["latest", "mean"] = Field(
        "latest", description="latest: each entry holds the last teacher state that wrote it; "
        "mean: the running mean of every state's features for the image (clean views only)")
    targets: Literal["auto", "states", "final", "labels", "bank"] = Field(
        "auto", description="what the student's stage s learns from: auto: the student is "
        "trained once per candidate (labels; final, plain KD at T=4; states, at "
        "--temperature; standardized, KD on standardized logits) on the same teacher "
        "stages, and the one best on validation is kept; "
        "states: teacher state s itself, run on the student's own augmented batch (the route "
        "of states, consistent with what the student sees); final: the last teacher state, "
        "on the student's batch, at every stage (plain KD when the layers are fc); labels: the "
        "labels alone (CE at weight 1, no teacher term); bank: the feature bank s (each "
        "image's features as a teacher state recorded them, on the view it saw then)")
    student_patience: int = Field(3, ge=1, le=100, description="the student's passes per "
                                  "stage as a multiple of its fitted budget (the teacher's "
                                  "stays): a patient student trains longer on the same "
                                  "targets")
    student_mixup: float = Field(0.0, ge=0.0, le=100.0, description="mix each student batch "
                                 "with a shuffled copy of itself, the mix drawn from Beta(a, "
                                 "a) with a = this value, and run the teacher state on the "
                                 "same mixed images (function matching); 0: no mixing; needs "
                                 "targets states or final")

    @field_validator("teacher_model", "student_model")
    @classmethod
    def _model_registered(cls, value: str) -> str:
        return ModelSection._model_registered(value)

    @model_validator(mode="after")
    def _teacher_deeper_and_layers_exist(self) -> DistillConfig:
        teacher_layers, teacher_depth = _layers_of(self.teacher_model)
        student_layers, student_depth = _layers_of(self.student_model)
        if teacher_depth <= student_depth:
            raise ValueError(f"the teacher must be deeper than the student: teacher_model "
                             f"{self.teacher_model} has {teacher_depth} layers, student_model "
                             f"{self.student_model} has {student_depth}")
        if self.teacher_layer not in teacher_layers:
            raise ValueError(f"teacher_layer {self.teacher_layer!r} is not a layer of "
                             f"{self.teacher_model}: {', '.join(teacher_layers)}")
        if self.student_layer not in student_layers:
            raise ValueError(f"student_layer {self.student_layer!r} is not a layer of "
                             f"{self.student_model}: {', '.join(student_layers)}")
        if self.targets not in ("bank", "labels") and self.run.ddp_procs > 1:
            raise ValueError(f"targets {self.targets!r} runs a live teacher beside the student, "
                             "in one process: use --targets bank with --ddp-procs")
        if self.student_mixup > 0 and self.targets == "bank":
            raise ValueError(f"student_mixup {self.student_mixup} mixes two images, and a bank "
                             "holds targets of single images: use targets states or final")
        if self.student_mixup > 0 and self.feature_loss == "dkd":
            raise ValueError(f"student_mixup {self.student_mixup} gives a mixed image two "
                             "labels, and feature_loss dkd needs one: use kl")
        if self.bank_views == "augmented" and self.bank_average == "mean":
            raise ValueError("bank_average mean averages features of different views: use it "
                             "with bank_views clean")
        if self.bank_views == "augmented" and self.optim.augment == 0:
            raise ValueError("bank_views augmented records each entry's augmentation, but "
                             "augment is 0: set augment above 0 or bank_views clean")
        if self.feature_loss == "dkd" and (self.teacher_layer, self.student_layer) != ("fc",
                                                                                       "fc"):
            raise ValueError("feature_loss dkd compares logits: set teacher_layer and "
                             f"student_layer to fc (got {self.teacher_layer!r} and "
                             f"{self.student_layer!r})")
        return self
