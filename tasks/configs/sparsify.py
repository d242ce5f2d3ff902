"""The `sparsify` flow's config and the sparsity term it trains with."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

import models
from models.canvas import SPARSE_LAYERS, TASK_MODELS, build_task_model
from models.detection import SSDLITE
from tasks.configs.sections import MODEL_URI, CommaList, ModelSection, StrictConfig
from tasks.configs.train import TrainConfig


class SparsitySpec(StrictConfig):
    """The sparsity term of a training run, resolved for its network (`training.sparsify.term`):
    each regularized layer's lambda, in order, and the transform with its parameters."""

    lambdas: dict[str, float]
    transform: Literal["abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer"]
    power: int
    abs_power: int
    base: float
    # activation thresholds in place while training (`--threshold-cycles`): layer -> t
    thresholds: dict[str, float] = {}

    def build(self):
        """The `training.sparsify.term.SparsityTransform` of this spec."""
        from training.sparsify.term import SparsityTransform

        return SparsityTransform(self.transform, n=self.power, m=self.abs_power, c=self.base)

    def term(self):
        """The `training.sparsify.term.SparsityTerm` of this spec (a round's sparsity)."""
        from training.sparsify.term import SparsityTerm

        return SparsityTerm(dict(self.lambdas), self.build(), dict(self.thresholds))


class SparsifyNetwork(ModelSection):
    """The network whose activations are made sparse (its name is checked against the task in
    `SparsifyConfig`)."""

    model: str | None = Field(None, description="the network whose activations are made "
                              "sparse; none: lenet, ssdlite320_mobilenet_v3_large (detection), "
                              "contour_unet (contour)")

    @field_validator("model")
    @classmethod
    def _model_registered(cls, value: str | None) -> str | None:
        return value  # checked against the task in `SparsifyConfig._layers_exist`


class SparsifyConfig(TrainConfig):
    """The `sparsify` flow: a classifier, detector or contour network trained with its task
    loss plus a sparsity term on the activations of chosen layers (`training/sparsify/term.py`).
    A task's defaults (`TASK_DEFAULTS`) sit below the profile's and the given values."""

    RENAMED: ClassVar[dict[str, str]] = {"threshold_cycle_epochs": "threshold_cycle_rounds",
                                         "threshold_settle_epochs": "threshold_settle_rounds"}
    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {**TrainConfig.PROFILES["smoke"], "model": None, "layouts": (64, 32, 32)},
        "quick": {},
        "full": {**TrainConfig.PROFILES["full"], "layouts": (8000, 1000, 1000)},
    }
    TASK_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        # one lambda for both of lenet's maps: at the same zeros the area rule (gamma 0.5 at
        # lambda 0.3) won on Fashion-MNIST and lost on a second data set; 0.42 zeros as many
        # values as the rule on Fashion-MNIST's validation images (`bench.area_rule`)
        "classification": {"lambda_gamma": 0.0, "sparsity_lambda": 0.42},
        "detection": {"batch_size": 16, "lr": 0.05, "rounds": 8, "min_steps": None},
        # lambda 0.3 cost the contour U-Net 2.7 points of boundary F, 0.02 nothing measurable
        # (docs/sparsify.md)
        "contour": {"batch_size": 16, "lr": 0.05, "rounds": 6, "min_steps": None,
                    "sparsity_lambda": 0.02},
    }

    task: Literal["classification", "detection", "contour"] = Field(
        "classification", description="classification: the data's classes; detection (class "
        "and box) and contour (each object's boundary map): of the data's images pasted on "
        "synthetic layouts (training/canvas/layouts.py)")
    network: SparsifyNetwork = Field(default_factory=SparsifyNetwork)
    canvas: int = Field(128, ge=64, le=1024, description="detection and contour: the layout "
                        "canvases' size in pixels (a multiple of 4)")
    layouts: CommaList[tuple[int, int, int]] = Field(
        (3000, 300, 300), description="detection and contour: how many train, validation and test "
        "canvases, comma-separated")
    max_objects: int = Field(4, ge=1, le=16, description="detection and contour: the most "
                             "objects on a canvas (at least 1)")
    boundary_tolerance: int = Field(1, ge=0, le=16, description="contour: a boundary pixel is "
                                    "correct within this many pixels of a true one (boundary F)")

    sparse_layers: CommaList[tuple[str, ...]] | None = Field(
        None, description="module names whose outputs are regularized, comma-separated (any "
        "module of the network); none: its feature maps (feature layers but the embedding)")
    transform: Literal["abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer"] = Field(
        "abs", description="T(x) per activation: abs |x|, power x^N, exp_abs c^|x|, "
        "exp_power c^(x^N), abs_power |x|^M; or hoyer: each image's map's Hoyer-square "
        "(sum |x|)^2 / (n sum x^2), which does not change with the map's scale")
    power: int = Field(2, ge=2, le=16, description="N of power and exp_power (even)")
    abs_power: int = Field(1, ge=1, le=16, description="M of abs_power (a whole number)")
    base: float = Field(2.0, le=1e6, description="c of exp_abs and exp_power (> 1)")
    sparsity_lambda: float = Field(0.3, ge=0.0, le=1e6, description="lambda: the sparsity "
                                   "term's weight on the largest map (contour: 0.02)")
    lambda_gamma: float = Field(0.5, ge=0.0, le=4.0, description="lambda_l = lambda x "
                                "(A_max / A_l)^gamma with A a map's area: a smaller map weighs "
                                "more; 0: one lambda for all")
    layer_lambdas: CommaList[tuple[float, ...]] | None = Field(
        None, description="an explicit lambda per layer, comma-separated, in the order of "
        "sparse_layers (instead of the rule)")
    lambda_sweep: CommaList[tuple[float, ...]] | None = Field(
        None, description="also train with each of these lambdas, comma-separated (nested runs), "
        "and plot validation accuracy against exact zeros; the model registered is the one of "
        "--sparsity-lambda")
    zero_threshold_tolerance: float | None = Field(
        None, ge=0.0, le=1.0, description="classification: after training, zero each "
        "regularized layer's activations up to a threshold, per layer the largest (of quantiles "
        "of its nonzero magnitudes) that costs at most this much validation accuracy, e.g. "
        "0.002; exported with the network; none: no thresholds")
    zero_target: float | None = Field(
        None, gt=0.0, lt=1.0, description="classification, instead of "
        "--zero-threshold-tolerance: activation thresholds that give each regularized layer "
        "this share of exact zeros on validation (e.g. 0.8), reached in equal steps over "
        "--threshold-cycles, whatever the accuracy; none: thresholds by the tolerance")
    threshold_cycles: int = Field(0, ge=0, le=50, description="classification, with "
                                  "--zero-threshold-tolerance or --zero-target: after the first "
                                  "calibration, this many times train --threshold-cycle-rounds "
                                  "rounds with the thresholds in place (the term stays) and "
                                  "calibrate again on top, so the thresholds rise while the "
                                  "network adapts to them; all calibrations together cost at "
                                  "most the tolerance, or the last reaches the zero target")
    threshold_cycle_rounds: int = Field(2, ge=1, le=100, description="rounds of each threshold "
                                        "cycle (each of the main run's passes per round)")
    threshold_cycle_lr: float = Field(0.005, gt=0.0, le=10.0, description="peak learning rate "
                                      "of each threshold cycle (cosine over its rounds)")
    threshold_settle_rounds: int = Field(0, ge=0, le=100, description="classification, with "
                                         "thresholds: after the last calibration, train this "
                                         "many rounds with the final thresholds in place (at "
                                         "--threshold-cycle-lr, the term on), kept where no "
                                         "worse on validation: the network adapts to what the "
                                         "last calibration took (a zero target is topped up "
                                         "after them)")
    zero_target_ramp: CommaList[tuple[int, int]] | None = Field(
        None, description="classification, with --zero-target, instead of --threshold-cycles "
        "after the run: FIRST,LAST (rounds, from 1): raise the thresholds inside the run, before "
        "each of rounds FIRST to LAST in equal steps (the one before LAST reaches the target), "
        "and top them up to it before every later round and after the last; one optimizer and "
        "schedule throughout (Zhu and Gupta's gradual schedule); only rounds from LAST on are "
        "kept. FIRST 1 needs --init-from (a fresh network has nothing to measure)")
    init_from: str | None = Field(None, description="fine-tune: start from the weights of a "
                                  "registered classifier, models:/NAME@ALIAS or "
                                  "models:/NAME/VERSION (the same --model and width, e.g. "
                                  "models:/distill@champion with lenet); none: a fresh network")

    @field_validator("init_from")
    @classmethod
    def _model_uri(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_URI.match(value):
            raise ValueError("not models:/NAME@ALIAS or models:/NAME/VERSION")
        return value

    @classmethod
    def defaults(cls, values: dict[str, Any]) -> dict[str, Any]:
        task = values.get("task") or cls.model_fields["task"].default
        return {**cls.TASK_DEFAULTS.get(task, {}), **super().defaults(values)}

    @field_validator("layouts")
    @classmethod
    def _layout_counts(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(v < 1 for v in value):
            raise ValueError(f"every layout count must be >= 1, got {list(value)}")
        return value

    @field_validator("canvas")
    @classmethod
    def _multiple_of_four(cls, value: int) -> int:
        if value % 4:
            raise ValueError(f"canvas must be a multiple of 4 (the contour network pools "
                             f"twice), got {value}")
        return value

    @field_validator("power")
    @classmethod
    def _even(cls, value: int) -> int:
        if value % 2:
            raise ValueError(f"power must be even (an odd power is not smallest at 0), got "
                             f"{value}")
        return value

    @field_validator("base")
    @classmethod
    def _above_one(cls, value: float) -> float:
        if not value > 1:
            raise ValueError(f"base must be > 1 (c^|x| must grow with |x|), got {value}")
        return value

    @field_validator("layer_lambdas", "lambda_sweep")
    @classmethod
    def _non_negative(cls, value: tuple[float, ...] | None, info) -> tuple[float, ...] | None:
        if value is not None and any(v < 0 for v in value):
            raise ValueError(f"{info.field_name} must be >= 0, got {list(value)}")
        return value

    def network_name(self) -> str:
        """`model`, or the task's default network."""
        return self.network.model or {"classification": "lenet", "detection": SSDLITE,
                              "contour": "contour_unet"}[self.task]

    def build_network(self):
        """An instance of the network (for its module names)."""
        if self.task == "classification":
            return models.build_model(self.network_name(), 1, 2, 4)
        return build_task_model(self.task, self.network_name(), 2, self.canvas)

    @model_validator(mode="after")
    def _layers_exist(self) -> SparsifyConfig:
        known = (models.list_models() if self.task == "classification"
                 else TASK_MODELS[self.task])
        if self.network_name() not in known:
            raise ValueError(f"model: unknown {self.task} model {self.network_name()!r}; "
                             f"choose one of {', '.join(known)}")
        network = self.build_network()
        names = [name for name, _ in network.named_modules() if name]
        missing = [name for name in self.layers() if name not in names]
        if missing:
            shown = ", ".join(names[:60]) + (f", ... ({len(names)} in all)"
                                             if len(names) > 60 else "")
            raise ValueError(f"sparse_layers {missing} are not modules of "
                             f"{self.network_name()}; it has {shown}")
        if self.zero_threshold_tolerance is not None and self.task != "classification":
            raise ValueError(f"zero_threshold_tolerance: thresholds are calibrated for --task "
                             f"classification, not {self.task}")
        if self.zero_target is not None and self.zero_threshold_tolerance is not None:
            raise ValueError(f"zero_target: {self.zero_target} sets the thresholds by their "
                             f"zeros, zero_threshold_tolerance by the accuracy: give one")
        if self.zero_target is not None and self.task != "classification":
            raise ValueError(f"zero_target: thresholds are for --task classification, not "
                             f"{self.task}")
        thresholded = self.zero_threshold_tolerance is not None or self.zero_target is not None
        if self.threshold_settle_rounds and not thresholded:
            raise ValueError(f"threshold_settle_rounds: {self.threshold_settle_rounds} rounds "
                             f"settle thresholds: give --zero-threshold-tolerance (or "
                             f"--zero-target) too")
        if self.threshold_cycles and not thresholded:
            raise ValueError(f"threshold_cycles: {self.threshold_cycles} cycles raise "
                             f"thresholds: give --zero-threshold-tolerance (or --zero-target) "
                             f"too")
        self._check_ramp()
        if self.init_from is not None and self.task != "classification":
            raise ValueError(f"init_from: fine-tuning is for --task classification, not "
                             f"{self.task}")
        if self.run.ddp_procs > 1 and self.task != "classification":
            raise ValueError(f"ddp_procs: --task {self.task} trains in one process; "
                             f"data-parallel rounds (--ddp-procs {self.run.ddp_procs}) are for "
                             f"--task classification")
        if self.layer_lambdas is not None and len(self.layer_lambdas) != len(self.layers()):
            raise ValueError(f"layer_lambdas has {len(self.layer_lambdas)} values for "
                             f"{len(self.layers())} sparse_layers ({', '.join(self.layers())})")
        return self

    def _check_ramp(self) -> None:
        if self.zero_target_ramp is None:
            return
        first, last = self.zero_target_ramp
        ramp = f"zero_target_ramp: {first},{last}"
        if self.zero_target is None:
            raise ValueError(f"{ramp} raises thresholds toward a zero target: give "
                             f"--zero-target too")
        if self.threshold_cycles or self.threshold_settle_rounds:
            raise ValueError(f"{ramp} raises the thresholds inside the run, --threshold-cycles "
                             f"and --threshold-settle-rounds after it: give one")
        if not 1 <= first <= last <= self.rounds:
            raise ValueError(f"{ramp} must be two rounds FIRST <= LAST within the run's "
                             f"{self.rounds} (--rounds)")
        if first == 1 and self.init_from is None:
            raise ValueError(f"{ramp}: a fresh network has no activations to set thresholds "
                             f"by before round 1; start at round 2 or give --init-from")

    def layers(self) -> tuple[str, ...]:
        """The regularized layers: `sparse_layers`, or the model's feature maps."""
        if self.sparse_layers is not None:
            return self.sparse_layers
        if self.task != "classification":
            return SPARSE_LAYERS[self.network_name()]
        return tuple(models.build_model(self.network_name(), 1, 2, 4).feature_layers[:-1])
