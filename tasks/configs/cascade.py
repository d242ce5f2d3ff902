"""The `cascade` flow's config (`flows/cascade.py`; the network is `models.cascade`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from models.cascade import CascadeSpec
from tasks.configs.sections import CommaList, ProfiledConfig, RoundsFields
from tasks.configs.train import TrainConfig


class CascadeConfig(ProfiledConfig, RoundsFields):
    """A cascade of modules with exits and super-network modules, trained module by module on
    training sets of rising difficulty, its predictors fitted on a second training set, its
    exit thresholds calibrated on validation (`training/cascade/learning.py`)."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {**{k: v for k, v in TrainConfig.PROFILES["smoke"].items() if k != "model"},
                  "widths": (8, 16, 16), "predictor_epochs": 1, "latency_repeats": 3,
                  "timing_images": 32,
                  "exit_distill_epochs": 3,
                  "serving_batch": 32},
        "quick": {},
        "full": {**{k: v for k, v in TrainConfig.PROFILES["full"].items()
                    if k not in ("model", "width")}, "widths": (32, 128, 256)},
    }

    widths: CommaList[tuple[int, ...]] = Field(
        (16, 64, 128), description="each module's output channels, input side first (K = how "
        "many); each module halves the map")
    super_modules: CommaList[tuple[int, ...]] = Field(
        (1, 2), description="0-based indices of the super-network modules")
    sub_widths: CommaList[tuple[float, ...]] = Field(
        (0.5, 2.0), description="each sub-network's hidden width as a multiple of its module's "
        "width, cheapest first (two or more)")
    confidence: Literal["max_softmax", "entropy"] = Field("max_softmax", description="an exit's "
                                                          "confidence: the top class probability, "
                                                          "or 1 - entropy / log C")
    exit_pool: int = Field(4, ge=1, le=16, description="each exit head averages its map over "
                           "exit_pool x exit_pool cells before its classifier (1: global "
                           "average pooling)")
    exit_hidden: int = Field(64, ge=0, le=4096, description="the early exits' classifier: a "
                             "hidden ReLU layer of this many units, then a linear layer (0: "
                             "linear; the last exit is always linear)")
    route_context: bool = Field(True, description="a super-network module's predictor also "
                                "reads the class probabilities of the exit before it, not only "
                                "its pooled incoming map (off: the map alone)")
    difficulty: Literal["loss", "margin"] = Field("loss", description="per-image difficulty: a "
                                                  "linear classifier on the raw pixels, fitted on "
                                                  "the other half of the images, its cross-entropy "
                                                  "or its softmax margin")
    curriculum: CommaList[tuple[float, ...]] | None = Field(
        None, description="module k trains on the easiest curriculum[k] of the first training set "
        "(rising, the last 1); none: from 0.5 up to 1 in equal steps")
    stage_training: Literal["joint", "frozen"] = Field("joint", description="module k's "
                                                       "rounds: joint, the modules before it "
                                                       "and their exits train along on its set "
                                                       "(each exit on its own cross-entropy); "
                                                       "frozen: they stay as they were")
    predictor: Literal["fitted", "fixed"] = Field("fitted", description="after a super-network "
                                                  "module is trained (joint: after the last "
                                                  "module): fit its predictor on the "
                                                  "second training set, or choose one "
                                                  "sub-network for good there")
    predictor_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the training "
                                      "split held out as the second training set (predictor "
                                      "fitting); the modules never train on it")
    predictor_epochs: int = Field(4, ge=1, le=1000, description="passes over the second "
                                  "training set that fit a predictor")
    routing_target: Literal["oracle", "cost"] = Field(
        "oracle", description="what a fitted predictor learns: oracle, the cross-entropy "
        "toward the cheapest sub-network that gets the image right, its operating point then "
        "set on validation (`--route-shares`); cost, the expected error plus "
        "--latency-weight x time of its choice")
    route_shares: CommaList[tuple[float, ...]] = Field(
        (0.02, 0.05, 0.1, 0.2, 0.35, 0.5), description="comma-separated shares of the "
        "validation images the fitted predictors may send to each module's most expensive "
        "sub-network (an offset on its score; the predictor ranks the images): each is "
        "calibrated on validation beside the argmax and the cheapest kept (ties: the argmax)")
    latency_weight: float = Field(0.002, ge=0.0, le=100.0, description="the latency-aware "
                                  "loss: how many errors the most expensive sub-network's time "
                                  "is worth (above 0.005 every image went to the cheapest "
                                  "sub-network here, at 1.5 points)")
    exit_distill_epochs: int = Field(30, ge=0, le=10000, description="after the modules and "
                                     "predictors: passes that refit every exit head but the "
                                     "last to the last exit's softened outputs and the labels, "
                                     "on the frozen network's maps of the first training set "
                                     "(`training.cascade.learning.distill_exits`); 0: keep the "
                                     "heads")
    exit_distill_weight: float = Field(0.5, ge=0.0, le=1.0, description="the share of the "
                                       "distillation term in the refit's loss (the rest: "
                                       "cross-entropy on the labels)")
    exit_distill_temperature: float = Field(4.0, gt=0.0, le=100.0, description="the softening "
                                            "temperature of the exit refit's distillation term")
    count_gains: bool = Field(False, description="calibrating, let images an early exit gets "
                              "right and the last exit misses make up for images it loses (the "
                              "net accuracy); default: only the losses count, so the thresholds "
                              "do not spend the validation split's chance gains")
    calibrate: Literal["accuracy", "budget"] = Field("accuracy", description="thresholds for an "
                                                     "accuracy (the full network's on validation "
                                                     "minus accuracy_tolerance) or a budget")
    accuracy_tolerance: float = Field(0.003, ge=0.0, le=1.0, description="accuracy the cascade "
                                      "may give up against the full network on validation")
    latency_budget: float | None = Field(None, gt=0.0, le=1.0, description="with --calibrate "
                                         "budget: the cascade's mean time per image as a share "
                                         "of the full network's")
    thresholds: CommaList[tuple[float, ...]] | None = Field(
        None, description="K - 1 exit thresholds in (0, 1] instead of calibrating (1: never leave "
        "there)")
    serving_batch: int = Field(256, ge=1, le=65536, description="the batch size the model "
                               "serves at (latency table, throughput)")
    latency_repeats: int = Field(30, ge=1, le=10000, description="timed calls per part; the "
                                 "median counts")
    latency_table: str | None = Field(None, description="a latency table JSON measured earlier "
                                      "on this device, instead of measuring")
    timing_images: int = Field(1000, ge=1, le=1_000_000, description="test images each variant "
                               "is timed on at batch 1 (each point of the threshold sweep: at "
                               "most 300 of them)")

    @field_validator("thresholds")
    @classmethod
    def _in_unit_interval(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if value is not None and any(not 0.0 < t <= 1.0 for t in value):
            raise ValueError(f"every threshold must be in (0, 1], got {list(value)}")
        return value

    @field_validator("sub_widths")
    @classmethod
    def _two_or_more(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if len(value) < 2:
            raise ValueError(f"a super-network module needs two or more sub-networks, got "
                             f"{list(value)}")
        if any(v <= 0 for v in value) or list(value) != sorted(value):
            raise ValueError(f"sub_widths must be positive and rising (cheapest first), got "
                             f"{list(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CascadeConfig:
        modules = len(self.widths)
        if modules < 3:
            raise ValueError(f"widths: a cascade needs K >= 3 modules, got {list(self.widths)}")
        if any(w < 1 for w in self.widths):
            raise ValueError(f"widths must be >= 1, got {list(self.widths)}")
        bad = [k for k in self.super_modules if not 0 <= k < modules]
        if not self.super_modules or bad:
            raise ValueError(f"super_modules must name at least one module among 0..{modules - 1}"
                             f", got {list(self.super_modules)}")
        if self.thresholds is not None and len(self.thresholds) != modules - 1:
            raise ValueError(f"thresholds needs {modules - 1} values (one per exit but the last)"
                             f", got {len(self.thresholds)}")
        fractions = self.fractions()
        if len(fractions) != modules or any(not 0 < f <= 1 for f in fractions) or \
                list(fractions) != sorted(fractions) or fractions[-1] != 1.0:
            raise ValueError(f"curriculum needs {modules} rising fractions in (0, 1], the last "
                             f"1, got {list(fractions)}")
        if self.calibrate == "budget" and self.latency_budget is None:
            raise ValueError("latency_budget: --calibrate budget needs a budget (a share of the "
                             "full network's time, e.g. 0.4)")
        if self.latency_table is not None:
            self._check_table(Path(self.latency_table).expanduser())
        return self

    def _check_table(self, path: Path) -> None:
        from training.device import resolve_device
        from training.latency import check_device

        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"latency_table: cannot read {path}: {error}") from None
        check_device(table, resolve_device(self.run.device))
        names = set(table.get("parts", {}))
        needed = set(self.parts())
        if needed - names:
            raise ValueError(f"latency_table: {path} has no times for "
                             f"{sorted(needed - names)[:5]}: it is another network's")

    def fractions(self) -> tuple[float, ...]:
        """The curriculum: given, or 0.5 rising to 1 in equal steps."""
        if self.curriculum is not None:
            return self.curriculum
        modules = len(self.widths)
        return tuple(round(0.5 + 0.5 * k / (modules - 1), 6) for k in range(modules))

    def spec(self) -> CascadeSpec:
        """The network's shape (`models.cascade.CascadeSpec`)."""
        return CascadeSpec(widths=self.widths, super_modules=tuple(sorted(set(
            self.super_modules))), sub_widths=self.sub_widths, confidence=self.confidence,
            exit_pool=self.exit_pool, exit_hidden=self.exit_hidden,
            route_context=self.route_context)

    def parts(self) -> list[str]:
        """The names of the parts a latency table must time."""
        names = []
        for k in range(len(self.widths)):
            if k in self.super_modules:
                names += [f"{k}.predictor"] + [f"{k}.sub{s}" for s in range(len(self.sub_widths))]
            else:
                names.append(f"{k}.block")
            names.append(f"{k}.exit")
        return names
