"""Flow configs: one pydantic model per flow, the Prefect parameter form, CLI and MLflow params.

Every field is typed, bounded and described; unknown fields are rejected. Field groups are
shared by mixing sections into a flow's config. A `profile` (smoke, quick, full) fills the
fields that are not given explicitly; the class defaults are the `quick` profile.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import models
from models.dense import SPARSE_LAYERS, TASK_MODELS, build_task_model
from models.detection import SSDLITE
from tasks.environment import data_dir
from training.datasets import DataError, check_group_pattern, image_folder_listing

Profile = Literal["smoke", "quick", "full"]
FASHION_MNIST = "fashion-mnist"
# a registered model version: models:/NAME@ALIAS or models:/NAME/VERSION
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w.-]+)|/(?P<version>\d+))$")


class StrictConfig(BaseModel):
    """Base of every config: unknown fields are errors, values are validated and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DataSection(StrictConfig):
    """Which images, how they are split, and how they are read."""

    data: str = Field(FASHION_MNIST, description="`fashion-mnist`, or the path of an ImageFolder "
                      "directory (one sub-folder of images per class)")
    image_size: int = Field(28, ge=8, le=512, description="images are resized to this square "
                            "size (Fashion-MNIST is 28)")
    channels: int = Field(0, ge=0, le=3, description="1 (gray) or 3 (RGB); 0 picks 1 when every "
                          "image is grayscale")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="fraction of the training "
                                "images held out for validation (early stopping, all choices)")
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5, description="ImageFolder only: fraction "
                                 "held out as the test split (Fashion-MNIST has its own)")
    split_seed: int = Field(0, ge=0, description="seed of the train/validation/test split, "
                            "independent of the training seed so that every run sees the same "
                            "test set; an image's split is a hash of its path and this seed, so "
                            "adding or removing other images never moves it")
    group_pattern: str | None = Field(None, description="a regular expression over file names "
                                      "whose match (its first group, if any) names an image's "
                                      "group: variants of one original (`(\\d+)` puts "
                                      "cat_001.png and cat_001_flip.png together) share a split;"
                                      " none: every image is its own group")
    train_limit: int | None = Field(20000, ge=1, description="use at most this many training "
                                    "images (those whose paths hash lowest: a grown folder "
                                    "keeps them); none: all")
    test_limit: int | None = Field(None, ge=1, description="evaluate on at most this many test "
                                   "images (chosen the same way); none: all")
    skip_bad_images: bool = Field(False, description="skip and count unreadable images instead "
                                  "of stopping with an error")

    @field_validator("group_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        return check_group_pattern(value)

    @field_validator("channels")
    @classmethod
    def _one_or_three(cls, value: int) -> int:
        if value == 2:
            raise ValueError("channels must be 0 (auto), 1 or 3")
        return value

    @field_validator("data")
    @classmethod
    def _data_exists(cls, value: str) -> str:
        if value == FASHION_MNIST:
            raw = data_dir() / "fashion-mnist" / "FashionMNIST" / "raw"
            if not raw.is_dir():
                raise ValueError(f"Fashion-MNIST is not prepared in {raw}: run `make data`")
            return value
        path = Path(value).expanduser()
        if not path.exists():
            raise ValueError(f"no such dataset directory: {value}")
        if not path.is_dir():
            raise ValueError(f"{value} is not a directory (an ImageFolder has one folder per "
                             "class)")
        try:  # its layout is checked before any work; its images when they are read
            image_folder_listing(path)
        except DataError as error:
            raise ValueError(str(error)) from None
        return str(path.resolve())


class SplitsConfig(DataSection):
    """The data settings whose splits `python -m flows splits` prints (a run's defaults: the
    `quick` profile's 20,000-image training limit; `--train-limit none` lists every image)."""


class ModelSection(StrictConfig):
    """Which network."""

    model: str = Field("resnet18", description=f"a registered network: "
                       f"{', '.join(models.list_models())}")
    width: int | None = Field(None, ge=1, le=1024, description="channels of the first stage "
                              "(doubling per stage); none: the model's default")

    @field_validator("model")
    @classmethod
    def _model_registered(cls, value: str) -> str:
        if value not in models.list_models():
            raise ValueError(f"unknown model {value!r}; registered: "
                             f"{', '.join(models.list_models())}")
        return value


class StepSection(StrictConfig):
    """How each step learns: SGD with momentum, a cosine schedule and divergence guards."""

    batch_size: int = Field(128, ge=1, le=65536, description="images per training step")
    lr: float = Field(0.05, gt=0.0, le=10.0, description="peak learning rate (cosine decay)")
    warmup_epochs: float = Field(0.0, ge=0.0, le=100.0, description="linear warm-up, in epochs")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    weight_decay: float = Field(5e-4, ge=0.0, lt=1.0, description="L2 weight decay")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="cross-entropy label "
                                   "smoothing")
    augment: float = Field(0.5, ge=0.0, le=1.0, description="augmentation strength: flips and "
                           "shifts of up to augment x size / 7 pixels, rounded down (4 x "
                           "augment at 28 pixels); 0 is none")
    flip: Literal["auto", "on", "off"] = Field("auto", description="horizontal flips in the "
                                               "augmentation; auto: only where the classes "
                                               "survive a mirror (3-NN on mirrored validation "
                                               "images, `training.baselines.mirror_safe`)")
    grad_clip: float | None = Field(5.0, gt=0.0, description="clip the gradient norm to this; "
                                    "none: no clipping")

    def flips(self) -> bool:
        """Whether the augmentation flips: `flip` as the flow resolved it from the data
        (`flows.skeleton.Prepared.apply`); `auto` reaching a task directly flips."""
        return self.flip != "off"


class BudgetSection(StrictConfig):
    """How the budget fits the data (`training/budget.py`): a small data set gets a smaller
    batch and more passes, so that it trains for enough optimizer steps."""

    min_steps: int | None = Field(3000, ge=1, le=10_000_000, description="train at least this "
                                  "many optimizer steps: on a small data set the batch shrinks "
                                  "(to 8 steps an epoch, not below 16 images) and every epoch "
                                  "(PBT epoch, distillation stage) is repeated to reach them; "
                                  "none: the configured batch and epochs exactly")
    min_steps_full_below: int | None = Field(4096, ge=1, le=10_000_000, description="min_steps "
                                             "holds in full up to this many training images and "
                                             "shrinks in proportion above (8,192 images: half); "
                                             "none: in full whatever the size")
    max_epochs: int = Field(400, ge=1, le=100_000, description="never more passes over the "
                            "training images than this, however small the data set")


class OptimSection(StepSection, BudgetSection):
    """How long it learns: epochs, the budget that fits them to the data, and early stopping."""

    epochs: int = Field(8, ge=1, le=1000, description="rounds of training: passes over the "
                        "training images, each repeated on a small data set (see min_steps); "
                        "validation is checked after every round")
    patience: int | None = Field(4, ge=1, description="stop after this many rounds in a row "
                                 "below the best validation accuracy; the latest round within "
                                 "one standard error of the best is kept; none: run every "
                                 "round")


class RunSection(StrictConfig):
    """Where and how a run executes and what it is called."""

    # more command-line names of a boolean field (pydantic reserves `register` itself)
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"registry": ("--register",)}

    seed: int = Field(0, ge=0, description="seed of weights, shuffling and augmentation")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="where to train")
    threads: int | None = Field(None, ge=1, le=512, description="CPU threads for PyTorch; none: "
                                "PyTorch's default")
    model_name: str | None = Field(None, min_length=1, max_length=100, description="registered "
                                   "model name in MLflow; none: the flow's name")
    progress: bool = Field(True, description="show progress bars")
    ddp_procs: int = Field(1, ge=1, le=1024, description="data-parallel processes per "
                           "training task, launched by torchrun (gloo on CPUs, nccl and one "
                           "GPU each on CUDA); 1: train in the task's own process")
    baseline_gate: bool = Field(True, description="never make a model champion that does not "
                                "beat the raw-pixel baselines (k-NN, linear) on validation; "
                                "they are logged either way")
    registry: bool = Field(True, description="register the final model in MLflow's registry and "
                           "decide its alias; --no-register (and the smoke profile): the model "
                           "is tested and logged on its run, the registry is never touched")
    max_latency_ms: float | None = Field(None, gt=0.0, le=1e6, description="promotion gate: "
                                         "never make a model champion whose served pyfunc takes "
                                         "longer than this per image (batch 1, median, this "
                                         "machine); none: no budget")

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
            raise ValueError(f"model name {value!r} may hold only letters, digits, '_', '.', '-'")
        return value

    def registered_name(self, flow_name: str) -> str:
        """The MLflow registered-model name: `model_name`, or the flow's name."""
        return self.model_name or flow_name


class ClassifierConfig(ModelSection, OptimSection, RunSection):
    """What one classifier's training needs (a part of every flow config that trains one)."""


def classifier_config(config: BaseModel) -> ClassifierConfig:
    """The classifier part of a flow config."""
    return ClassifierConfig(**config.model_dump(include=set(ClassifierConfig.model_fields)))


class ProfiledConfig(StrictConfig):
    """A config whose unspecified fields come from a named profile."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {"quick": {}}
    profile: Profile = Field("quick", description="preset sizes: smoke (seconds, for tests), "
                             "quick (minutes on a laptop), full (real results, GPU-sized)")

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        profile = values.get("profile", "quick")
        if profile not in cls.PROFILES:
            return values  # the field's own validation names the bad value
        return {**cls.PROFILES[profile], **values}


class TrainConfig(ProfiledConfig, DataSection, ModelSection, OptimSection, RunSection):
    """The `train` flow: one classifier, evaluated, registered and promoted."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"model": "cnn2", "epochs": 1, "train_limit": 512, "test_limit": 256,
                  "batch_size": 64, "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {},
        "full": {"train_limit": None, "epochs": 60, "width": 32, "batch_size": 256, "lr": 0.1,
                 "warmup_epochs": 1.0},
    }


class RunnerSection(StrictConfig):
    """Where a flow's tasks run: in this process, or on a Dask cluster (prefect-dask)."""

    runner: Literal["process", "dask"] = Field("process", description="process: tasks run in "
                                               "turn in this process; dask: on a Dask cluster")
    dask_workers: int = Field(2, ge=1, le=512, description="worker processes of the local Dask "
                              "cluster (with --runner dask and no --dask-address); where "
                              "GPUs exist, one worker per GPU instead")
    dask_address: str | None = Field(None, min_length=1, description="address of a running Dask "
                                     "scheduler (tcp://host:8786); none: start a local cluster")


def _layers_of(model: str) -> tuple[tuple[str, ...], int]:
    """A registered model's feature layers (and the classifier `fc`) and its depth."""
    network = models.build_model(model, 1, 2, 4)
    return (*network.feature_layers, "fc"), network.depth


class DistillConfig(ProfiledConfig, DataSection, StepSection, BudgetSection, RunSection,
                    RunnerSection):
    """The `distill` flow: a deeper teacher trained in stages fills a feature bank; a shallower
    student learns stage by stage from the bank and the labels."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"teacher_model": "resnet8", "student_model": "cnn2", "stages": 2,
                  "train_limit": 512, "test_limit": 256, "batch_size": 64, "lr": 0.1,
                  "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {},
        "full": {"train_limit": None, "stages": 60, "teacher_width": 32, "batch_size": 256,
                 "lr": 0.1, "warmup_epochs": 1.0},
    }

    teacher_model: str = Field("resnet18", description="the teacher network (deeper than the "
                               "student)")
    teacher_width: int | None = Field(None, ge=1, le=1024, description="the teacher's width; "
                                      "none: the model's default")
    student_model: str = Field("lenet", description="the student network, the final model")
    student_width: int | None = Field(None, ge=1, le=1024, description="the student's width; "
                                      "none: the model's default")
    stages: int = Field(10, ge=2, le=10000, description="S: teacher and student stages")
    teacher_pretrain_epochs: int = Field(0, ge=0, le=1000, description="epochs the teacher "
                                         "trains on all training images before stage 1 (a warm "
                                         "start: its state 0, which --initial-bank teacher "
                                         "fills the bank from); 0: from the seeded weights")
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
    teacher_layer: str = Field("pool", description="the teacher layer whose features fill "
                               "the bank (`fc`: the logits)")
    student_layer: str = Field("pool", description="the student layer matched to the bank "
                               "through the adapter")
    feature_loss: Literal["l2", "cosine", "kl"] = Field("cosine", description="the feature "
                                                       "sub-loss (kl: on softened outputs)")
    feature_weight: float = Field(1.0, ge=0.0, le=1000.0, description="weight of the feature "
                                  "sub-loss")
    ce_weight: float = Field(1.0, ge=0.0, le=1000.0, description="weight of the CE sub-loss")
    temperature: float = Field(4.0, gt=0.0, le=100.0, description="softening temperature of "
                               "the kl feature loss")
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
        return self


class PBTConfig(ProfiledConfig, DataSection, ModelSection, StepSection, BudgetSection,
                RunSection, RunnerSection):
    """The `pbt` flow: a population trained in stages; the best member's weights are copied to
    the others, which then explore hyperparameters around the best's.

    `lr`, `weight_decay`, `momentum` and `augment` are the burn-in values (the same for every
    member); the stages search them within the `*_range` bounds.
    """

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {"model": "cnn2", "members": 2, "burn_in_epochs": 1, "round_epochs": 1,
                  "stages": 2, "train_limit": 512, "test_limit": 256, "batch_size": 64,
                  "progress": False, "min_steps": None,
                  "baseline_gate": False, "registry": False},
        "quick": {"model": "lenet"},  # N members: a network that trains in a minute each
        "full": {"train_limit": None, "members": 8, "burn_in_epochs": 5, "round_epochs": 5,
                 "stages": 11, "width": 32, "batch_size": 256},
    }

    members: int = Field(4, ge=2, le=256, description="N: networks in the population")
    burn_in_epochs: int = Field(1, ge=1, le=1000, description="epochs every member trains with "
                                "the same hyperparameters before the stages (Ray Tune's "
                                "burn-in period)")
    burn_in_patience: int | None = Field(None, ge=1, description="end the burn-in early after "
                                         "this many epochs without a better validation "
                                         "accuracy; none: all burn-in epochs")
    round_epochs: int = Field(2, ge=1, le=1000, description="epochs each member trains per "
                              "stage")
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
    lr_range: tuple[float, float] = Field((0.005, 0.3), description="bounds of the learning "
                                          "rate (log scale)")
    weight_decay_range: tuple[float, float] = Field((1e-5, 5e-3), description="bounds of the "
                                                    "weight decay (log scale)")
    momentum_range: tuple[float, float] = Field((0.5, 0.99), description="bounds of the "
                                                "momentum (linear scale)")
    augment_range: tuple[float, float] = Field((0.0, 1.0), description="bounds of the "
                                               "augmentation strength (linear scale)")
    explore_factors: tuple[float, float] = Field((0.5, 2.0), description="a log-scale value "
                                                 "is the best's times a factor in this range")
    explore_step: float = Field(0.25, gt=0.0, le=1.0, description="a linear-scale value moves "
                                "by up to this fraction of its range from the best's")
    knn_k: int = Field(5, ge=1, le=1000, description="neighbours that vote when the final "
                       "model's embeddings recognize the test split against the training split")

    @field_validator("lr_range", "weight_decay_range", "momentum_range", "augment_range",
                     "explore_factors", mode="before")
    @classmethod
    def _pair(cls, value: Any) -> Any:
        return _comma_list(value)  # from the command line: "0.01,0.3"

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


def _comma_list(value: Any) -> Any:
    """A list from the command line's "a,b,c" (other values unchanged)."""
    if isinstance(value, str):
        return [part for part in re.split(r"[,\s]+", value.strip("()[] ")) if part]
    return value


class SparsitySpec(StrictConfig):
    """The sparsity term of a training run, resolved for its network (`training.sparsity`):
    each regularized layer's lambda, in order, and the transform with its parameters."""

    lambdas: dict[str, float]
    transform: Literal["abs", "power", "exp_abs", "exp_power", "abs_power", "hoyer"]
    power: int
    abs_power: int
    base: float
    # activation thresholds in place while training (`--threshold-cycles`): layer -> t
    thresholds: dict[str, float] = {}

    def build(self):
        """The `training.sparsity.SparsityTransform` of this spec."""
        from training.sparsity import SparsityTransform

        return SparsityTransform(self.transform, n=self.power, m=self.abs_power, c=self.base)


class SparsifyConfig(TrainConfig):
    """The `sparsify` flow: a classifier, detector or contour network trained with its task
    loss plus a sparsity term on the activations of chosen layers (`training/sparsity.py`).
    A task's defaults (`TASK_DEFAULTS`) sit below the profile's and the given values."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {
        "smoke": {**TrainConfig.PROFILES["smoke"], "model": None, "layouts": (64, 32, 32)},
        "quick": {},
        "full": {**TrainConfig.PROFILES["full"], "layouts": (8000, 1000, 1000)},
    }
    TASK_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "classification": {},
        "detection": {"batch_size": 16, "lr": 0.05, "epochs": 8, "min_steps": None},
        # lambda 0.3 cost the contour U-Net 2.7 points of boundary F, 0.02 nothing measurable
        # (docs/sparsify.md)
        "contour": {"batch_size": 16, "lr": 0.05, "epochs": 6, "min_steps": None,
                    "sparsity_lambda": 0.02},
    }

    task: Literal["classification", "detection", "contour"] = Field(
        "classification", description="classification: the data's classes; detection (class "
        "and box) and contour (each object's boundary map): of the data's images pasted on "
        "synthetic layouts (training/layouts.py)")
    model: str | None = Field(None, description="the network whose activations are made "
                              "sparse; none: lenet, ssdlite320_mobilenet_v3_large (detection), "
                              "contour_unet (contour)")
    canvas: int = Field(128, ge=64, le=1024, description="detection and contour: the layout "
                        "canvases' size in pixels (a multiple of 4)")
    layouts: tuple[int, int, int] = Field((3000, 300, 300), description="detection and contour: "
                                          "how many train, validation and test canvases, "
                                          "comma-separated")
    max_objects: int = Field(4, ge=1, le=16, description="detection and contour: the most "
                             "objects on a canvas (at least 1)")
    boundary_tolerance: int = Field(1, ge=0, le=16, description="contour: a boundary pixel is "
                                    "correct within this many pixels of a true one (boundary F)")

    sparse_layers: tuple[str, ...] | None = Field(None, description="module names whose "
                                                  "outputs are regularized, comma-separated "
                                                  "(any module of the network); none: its "
                                                  "feature maps (feature layers but the "
                                                  "embedding)")
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
    layer_lambdas: tuple[float, ...] | None = Field(None, description="an explicit lambda per "
                                                    "layer, comma-separated, in the order of "
                                                    "sparse_layers (instead of the rule)")
    lambda_sweep: tuple[float, ...] | None = Field(None, description="also train with each of "
                                                   "these lambdas, comma-separated (nested runs), "
                                                   "and plot validation accuracy against exact "
                                                   "zeros; the model registered is the one of "
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
                                  "calibration, this many times train --threshold-cycle-epochs "
                                  "rounds with the thresholds in place (the term stays) and "
                                  "calibrate again on top, so the thresholds rise while the "
                                  "network adapts to them; all calibrations together cost at "
                                  "most the tolerance, or the last reaches the zero target")
    threshold_cycle_epochs: int = Field(2, ge=1, le=100, description="rounds of each threshold "
                                        "cycle (each of the main run's passes per round)")
    threshold_cycle_lr: float = Field(0.005, gt=0.0, le=10.0, description="peak learning rate "
                                      "of each threshold cycle (cosine over its rounds)")
    threshold_settle_epochs: int = Field(0, ge=0, le=100, description="classification, with "
                                         "thresholds: after the last calibration, train this "
                                         "many rounds with the final thresholds in place (at "
                                         "--threshold-cycle-lr, the term on), kept where no "
                                         "worse on validation: the network adapts to what the "
                                         "last calibration took (a zero target is topped up "
                                         "after them)")
    zero_target_ramp: tuple[int, int] | None = Field(
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

    @field_validator("sparse_layers", "layer_lambdas", "lambda_sweep", "layouts",
                     "zero_target_ramp", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _comma_list(value)

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, values: Any) -> Any:
        if not isinstance(values, dict) or values.get("task") not in cls.TASK_DEFAULTS:
            return values
        profile = cls.PROFILES.get(values.get("profile", "quick"), {})
        return {**cls.TASK_DEFAULTS[values["task"]], **profile, **values}

    @field_validator("model")
    @classmethod
    def _model_registered(cls, value: str | None) -> str | None:
        return value  # checked against the task in `_layers_exist`

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
        return self.model or {"classification": "lenet", "detection": SSDLITE,
                              "contour": "contour_unet"}[self.task]

    def network(self):
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
        network = self.network()
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
        if self.threshold_settle_epochs and not thresholded:
            raise ValueError(f"threshold_settle_epochs: {self.threshold_settle_epochs} rounds "
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
        if self.ddp_procs > 1 and self.task != "classification":
            raise ValueError(f"ddp_procs: --task {self.task} trains in one process; "
                             f"data-parallel rounds (--ddp-procs {self.ddp_procs}) are for "
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
        if self.threshold_cycles or self.threshold_settle_epochs:
            raise ValueError(f"{ramp} raises the thresholds inside the run, --threshold-cycles "
                             f"and --threshold-settle-epochs after it: give one")
        if not 1 <= first <= last <= self.epochs:
            raise ValueError(f"{ramp} must be two rounds FIRST <= LAST within the run's "
                             f"{self.epochs} (--epochs)")
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
