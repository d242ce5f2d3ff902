"""The sections a flow config is made of (dataset, network, optim, run, cluster), the base that
nests flat input into them, and the profile that fills the fields not given."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

import models
from tasks.environment import NAME, data_dir, default_project
from training.datasets import DataError, check_group_pattern, image_folder_listing

Profile = Literal["smoke", "quick", "full"]
# A field's `json_schema_extra` when it says where or how a run goes, not what it computes:
# the cache keys leave it out (`tasks.adapters.caching.result_fields`).
RUN_ONLY = {"run_only": True}
FASHION_MNIST = "fashion-mnist"
# a registered model version: models:/NAME@ALIAS or models:/NAME/VERSION
MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w.-]+)|/(?P<version>\d+))$")


def project_field() -> Any:
    """The `project` field of a config that names MLflow experiments or registered models."""
    return Field(None, max_length=60, description="prefix of the MLflow experiment names and "
                 "of the flows' default model names, PROJECT-NAME (compactml-train); given "
                 "here, it prefixes a --model-name too; none: the project's name, "
                 "COMPACTML_PROJECT in project.env (empty: no prefix)",
                 json_schema_extra=RUN_ONLY)


def check_name(value: str | None, info: ValidationInfo) -> str | None:
    """A name part of MLflow names (`model_name`, `project`): letters, digits, '_', '.', '-'
    (or none)."""
    if value is not None and not NAME.fullmatch(value):
        what = info.field_name.replace("_", " ") if info.field_name else "name"
        raise ValueError(f"{what} {value!r} may hold only letters, digits, '_', '.', '-'")
    return value


# the `project` field's type
Project = Annotated[str | None, AfterValidator(check_name)]


def qualified(project: str | None, name: str) -> str:
    """`name` in `project` (none: `default_project()`): PROJECT-NAME, or NAME without one."""
    prefix = default_project() if project is None else project
    return f"{prefix}-{name}" if prefix else name


def model_name_of(project: str | None, model_name: str | None, flow_name: str) -> str:
    """The registered name of a run: a `model_name` the user gave, exactly (PROJECT-NAME only
    when a `project` is given with it), else the flow's name in the project (`qualified`)."""
    if model_name is None:
        return qualified(project, flow_name)
    return f"{project}-{model_name}" if project else model_name


class FormerNameWarning(DeprecationWarning):
    """A config given a field's former name (`StrictConfig.RENAMED`): accepted for one release,
    under its new name."""


# shown once per place that gives a former name, unlike other deprecation warnings (hidden
# outside `__main__`): a deployment's or a script's config is the user's to change
warnings.simplefilter("default", FormerNameWarning)


def renamed(values: Mapping[str, Any], former: Mapping[str, str], owner: str
            ) -> dict[str, Any]:
    """`values` with each former name (`former`: old -> new) given as its new name, warning
    (`FormerNameWarning`) with the new name; an old and a new name given together is an
    error."""
    values = dict(values)
    for old in [name for name in values if name in former]:
        new = former[old]
        if new in values:
            raise ValueError(f"{old} is the former name of {new}: give {new} alone")
        warnings.warn(f"{owner}: {old} is now {new}; the old name is accepted until the next "
                      f"release", FormerNameWarning, stacklevel=2)
        values[new] = values.pop(old)
    return values


def same_field(config: type[StrictConfig], name: str, default: Any = ...) -> Any:
    """Field `name` (a command-line name) of another flow's `config`, its bounds and
    description, with another `default` where given: a config that nests another flow's
    setting (the pipeline's steps) declares it once."""
    field = config.flat_fields()[name]  # copied: the other config keeps its own
    overrides = {} if default is ... else {"default": default}
    return FieldInfo.merge_field_infos(field, **overrides)


class StrictConfig(BaseModel):
    """Base of every config: unknown fields are errors, values are validated and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # the former names of a class's own fields, old -> new: accepted for one release, with a
    # `FormerNameWarning` (`renamed`); on the command line as hidden flags with a notice
    RENAMED: ClassVar[dict[str, str]] = {}

    @classmethod
    def former_names(cls) -> dict[str, str]:
        """Former names by their command-line names, old -> new: every `RENAMED` of the class
        and its bases."""
        return {old: new for klass in reversed(cls.__mro__)
                for old, new in vars(klass).get("RENAMED", {}).items()}

    @model_validator(mode="before")
    @classmethod
    def _former(cls, values: Any) -> Any:
        if not isinstance(values, Mapping):
            return values
        return renamed(values, cls.former_names(), cls.__name__)

    @classmethod
    def field_groups(cls) -> dict[str | None, dict[str, FieldInfo]]:
        """The fields by their command-line names, grouped: None, the config's own; then a
        sectioned config's sections by name."""
        return {None: dict(cls.model_fields)}

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """The fields by their command-line names, every group's."""
        return {name: field for group in cls.field_groups().values()
                for name, field in group.items()}

    @classmethod
    def flag_aliases(cls) -> dict[str, tuple[str, ...]]:
        """More command-line names of a boolean field, by field name."""
        return dict(getattr(cls, "FLAG_ALIASES", {}))

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, validated again (unlike `model_copy`, which would keep a
        misspelled or invalid value): an unknown name is an error."""
        changes = renamed(changes, type(self).former_names(), type(self).__name__)
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        return type(self).model_validate({**dict(self), **changes})


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
                            "adding or removing other images never moves it (copies of one "
                            "image, found by content, share a split)")
    group_pattern: str | None = Field(None, description="a regular expression over file names "
                                      "whose match (its first group, if any) names an image's "
                                      "group: variants of one original (`(\\d+)` puts "
                                      "cat_001.png and cat_001_flip.png together) share a split;"
                                      " none: every image is its own group")
    train_limit: int | None = Field(20000, ge=1, description="use at most this many training "
                                    "images (those whose paths hash lowest: a grown folder "
                                    "keeps them); none: all")
    val_limit: int | None = Field(None, ge=1, description="validate on at most this many "
                                  "validation images (chosen the same way; every choice reads "
                                  "them); none: all")
    test_limit: int | None = Field(None, ge=1, description="evaluate on at most this many test "
                                   "images (chosen the same way); none: all")
    skip_bad_images: bool = Field(False, description="skip and count unreadable images instead "
                                  "of stopping with an error")
    tiny_classes: Literal["keep", "refuse", "warn"] = Field(
        "keep", description="ImageFolder: a class the split left with no validation or no test "
        "image: keep moves one of its training images there (a class of fewer than 3 images "
        "stops the run, naming it); refuse stops the run naming the class; warn only warns")

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


class OptimSection(StrictConfig):
    """How each step learns (SGD with momentum, a cosine schedule and divergence guards), and the
    budget that fits the steps to the data (`training/budget.py`): a small data set gets a
    smaller batch and more passes, so that it trains for enough optimizer steps."""

    RENAMED: ClassVar[dict[str, str]] = {"warmup_epochs": "warmup_rounds"}

    batch_size: int = Field(128, ge=1, le=65536, description="images per training step")
    lr: float = Field(0.05, gt=0.0, le=10.0, description="peak learning rate (cosine decay)")
    warmup_rounds: float = Field(0.0, ge=0.0, le=100.0, description="linear warm-up, in rounds "
                                 "(each `repeats` passes over the training images on a small "
                                 "data set, see min_steps)")
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

    min_steps: int | None = Field(3000, ge=1, le=10_000_000, description="train at least this "
                                  "many optimizer steps: on a small data set the batch shrinks "
                                  "(to 8 steps an epoch, not below 16 images) and every round "
                                  "(a PBT round, a distillation stage) is repeated to reach them "
                                  "(`repeats` passes a round); none: the configured batch and "
                                  "one pass a round exactly")
    min_steps_full_below: int | None = Field(4096, ge=1, le=10_000_000, description="min_steps "
                                             "holds in full up to this many training images and "
                                             "shrinks in proportion above (8,192 images: half); "
                                             "none: in full whatever the size")
    max_epochs: int = Field(400, ge=1, le=100_000, description="never more passes over the "
                            "training images than this, however small the data set")

    def flips(self) -> bool:
        """Whether the augmentation flips: `flip` as the flow resolved it from the data
        (`flows.skeleton.Prepared.apply`); `auto` reaching a task directly flips."""
        return self.flip != "off"


class RunSection(StrictConfig):
    """Where and how a run executes and what it is called."""

    # more command-line names of a boolean field (pydantic reserves `register` itself)
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"registry": ("--register",)}

    seed: int = Field(0, ge=0, description="seed of weights, shuffling and augmentation")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="where to train",
                                                          json_schema_extra=RUN_ONLY)
    threads: int | None = Field(None, ge=1, le=512, description="CPU threads for PyTorch; none: "
                                "PyTorch's default", json_schema_extra=RUN_ONLY)
    model_name: str | None = Field(None, min_length=1, max_length=100, description="registered "
                                   "model name in MLflow, exactly as given (PROJECT-NAME with "
                                   "--project); none: PROJECT-FLOW (compactml-train)",
                                   json_schema_extra=RUN_ONLY)
    progress: bool = Field(True, description="show progress bars", json_schema_extra=RUN_ONLY)
    ddp_procs: int = Field(1, ge=1, le=1024, description="data-parallel processes per "
                           "training task, launched by torchrun (gloo on CPUs, nccl and one "
                           "GPU each on CUDA); 1: train in the task's own process")
    baseline_gate: bool = Field(True, description="never make a model champion that does not "
                                "beat the raw-pixel baselines (k-NN, linear) on validation; "
                                "they are logged either way", json_schema_extra=RUN_ONLY)
    registry: bool = Field(True, description="register the final model in MLflow's registry and "
                           "decide its alias; --no-register (and the smoke profile): the model "
                           "is tested and logged on its run, the registry is never touched",
                           json_schema_extra=RUN_ONLY)
    max_latency_ms: float | None = Field(None, gt=0.0, le=1e6, description="promotion gate: "
                                         "never make a model champion whose served pyfunc takes "
                                         "longer than this per image (batch 1, median, this "
                                         "machine); none: no budget",
                                         json_schema_extra=RUN_ONLY)
    promotion_alpha: float = Field(0.05, gt=0.0, le=0.5, description="level of the paired "
                                   "test that promotion decides by (McNemar's exact test on "
                                   "the test images neither model saw): a model replaces the "
                                   "champion only when better at this level, or not worse and "
                                   "smaller", json_schema_extra=RUN_ONLY)
    project: Project = project_field()

    _valid_name = field_validator("model_name")(check_name)

    def registered_name(self, flow_name: str) -> str:
        """The MLflow registered-model name (`model_name_of`): `model_name` as given, or
        the flow's name in the project."""
        return model_name_of(self.project, self.model_name, flow_name)

    def experiment(self, flow_name: str) -> str:
        """The MLflow experiment of the flow's runs, in the project (`qualified`)."""
        return qualified(self.project, flow_name)


class RunnerSection(StrictConfig):
    """Where a flow's tasks run: in this process, or on a Dask cluster (prefect-dask)."""

    runner: Literal["process", "dask"] = Field("process", description="process: tasks run in "
                                               "turn in this process; dask: on a Dask cluster")
    dask_workers: int = Field(2, ge=1, le=512, description="worker processes of the local Dask "
                              "cluster (with --runner dask and no --dask-address); where "
                              "GPUs exist, one worker per GPU instead")
    dask_address: str | None = Field(None, min_length=1, description="address of a running Dask "
                                     "scheduler (tcp://host:8786); none: start a local cluster")


SECTION_NAMES = ("dataset", "network", "optim", "run", "cluster")


class SectionedConfig(StrictConfig):
    """A config made of sections (`dataset`, `network`, `optim`, `run`, `cluster`: the ones
    it declares, and those named in `SECTION_PREFIXES`) and its own fields; code reads
    `config.optim.lr`.

    Input may be nested (`{"optim": {"lr": 0.1}}`, as the Prefect form has it) or flat (the
    command line's `--lr 0.1`, a profile's presets): flat names are nested by field name,
    every one unique across a config's sections and its own fields (checked when the class is
    made). A section in `SECTION_PREFIXES` has its flat names prefixed (the pipeline's `pbt`
    section: `--pbt-members` is `pbt.members`), so two sections may hold fields of one name.
    `defaults` (the profile) fill what is not given; a section given as an instance is taken
    as it is.
    """

    # sections beyond SECTION_NAMES, by name, with the prefix of their flat names
    SECTION_PREFIXES: ClassVar[dict[str, str]] = {}
    # set for each class when it is made: section name -> its type; flat name -> its section
    # and its name in that section
    _sections: ClassVar[dict[str, type[StrictConfig]]] = {}
    _owners: ClassVar[dict[str, str]] = {}
    _inner: ClassVar[dict[str, str]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._sections = {name: field.annotation for name, field in cls.model_fields.items()
                         if (name in SECTION_NAMES or name in cls.SECTION_PREFIXES)
                         and isinstance(field.annotation, type)
                         and issubclass(field.annotation, StrictConfig)}
        seen: dict[str, str] = {}
        inner: dict[str, str] = {}
        for name, section in cls._sections.items():
            prefix = cls.SECTION_PREFIXES.get(name, "")
            for field in section.model_fields:
                flat = prefix + field
                if flat in seen or flat in cls.model_fields:
                    raise TypeError(f"{cls.__name__}: field {flat!r} of section {name!r} is "
                                    f"also in {seen.get(flat, 'the config itself')}")
                seen[flat], inner[flat] = name, field
        cls._owners, cls._inner = seen, inner

    @classmethod
    def sections(cls) -> dict[str, type[StrictConfig]]:
        """The section fields and their types."""
        return cls._sections

    @classmethod
    def flat_name(cls, section: str, field: str) -> str:
        """The flat (command-line) name of `field` of `section`."""
        return cls.SECTION_PREFIXES.get(section, "") + field

    @classmethod
    def field_groups(cls) -> dict[str | None, dict[str, FieldInfo]]:
        sections = cls.sections()
        return {None: {name: field for name, field in cls.model_fields.items()
                       if name not in sections},
                **{name: {cls.flat_name(name, inner): field
                          for inner, field in section.flat_fields().items()}
                   for name, section in sections.items()}}

    @classmethod
    def flag_aliases(cls) -> dict[str, tuple[str, ...]]:
        aliases = super().flag_aliases()
        for name, section in cls.sections().items():
            aliases.update({cls.flat_name(name, field): flags
                            for field, flags in section.flag_aliases().items()})
        return aliases

    @classmethod
    def former_names(cls) -> dict[str, str]:
        names = super().former_names()
        for name, section in cls.sections().items():
            names.update({cls.flat_name(name, old): cls.flat_name(name, new)
                          for old, new in section.former_names().items()})
        return names

    @classmethod
    def defaults(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Flat values that fill the fields `values` does not give (none here; a profile's)."""
        return {}

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = renamed(values, cls.former_names(), cls.__name__)  # whichever runs first
        sections = cls.sections()
        nested: dict[str, Any] = {}
        preset: dict[str, dict[str, Any]] = {name: {} for name in sections}
        flat: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in cls.defaults(values).items():
            if key in cls._owners:
                preset[cls._owners[key]][cls._inner[key]] = value
            elif key not in values:
                nested[key] = value
        for key, value in values.items():
            if key in cls._owners:
                flat[cls._owners[key]][cls._inner[key]] = value
            else:
                nested[key] = value
        for name in sections:
            whole = nested.get(name)
            if isinstance(whole, BaseModel) and not flat[name]:
                continue  # a section given whole is taken as it is
            if isinstance(whole, BaseModel):
                nested[name] = {**whole.model_dump(), **flat[name]}
            elif isinstance(whole, dict):  # a partial section: the profile fills the rest
                nested[name] = {**preset[name], **whole, **flat[name]}
            elif whole is None:
                nested[name] = {**preset[name], **flat[name]}
            # anything else is not a section: its validation names it
        return nested

    def flat(self) -> dict[str, Any]:
        """The fields by their command-line names (what MLflow logs as the run's params)."""
        sections = type(self).sections()
        values = {name: value for name, value in self if name not in sections}
        for name in sections:
            values.update({type(self).flat_name(name, field): value
                           for field, value in getattr(self, name).model_dump().items()})
        return values

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, by flat field name or whole section, validated again (a
        changed section only): an unknown name is an error."""
        changes = renamed(changes, type(self).former_names(), type(self).__name__)
        owners = type(self)._owners
        unknown = sorted(set(changes) - set(owners) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        values = dict(self)
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key in owners:
                by_section.setdefault(owners[key], {})[type(self)._inner[key]] = value
            else:
                values[key] = value
        for name, update in by_section.items():
            values[name] = getattr(self, name).replace(**update)
        return type(self).model_validate(values)


class RoundsFields(StrictConfig):
    """How many rounds a classifier trains, and when it stops early."""

    RENAMED: ClassVar[dict[str, str]] = {"epochs": "rounds"}

    rounds: int = Field(8, ge=1, le=1000, description="rounds of training: each one pass over "
                        "the training images, repeated on a small data set (see min_steps), "
                        "one task and one checkpoint; validation is checked after every round")
    patience: int | None = Field(4, ge=1, description="stop after this many rounds in a row "
                                 "below the best validation accuracy; the latest round within "
                                 "one standard error of the best is kept; none: run every "
                                 "round", json_schema_extra=RUN_ONLY)


class ClassifierConfig(SectionedConfig, RoundsFields):
    """What one classifier's training needs (built from a flow config by `classifier_config`,
    or by a technique for each of its networks)."""

    network: ModelSection = Field(default_factory=ModelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    run: RunSection = Field(default_factory=RunSection)


def classifier_config(config: Any) -> ClassifierConfig:
    """The classifier part of a flow config: its network, optimizer, run, and its rounds where
    it has them (PBT's stages and distillation's are their own fields)."""
    rounds = {name: getattr(config, name) for name in RoundsFields.model_fields
              if name in type(config).model_fields}
    return ClassifierConfig(network=config.network, optim=config.optim, run=config.run,
                            **rounds)


class ProfiledConfig(SectionedConfig):
    """A flow's config: sections, its own fields, and a named profile that fills the fields
    not given."""

    PROFILES: ClassVar[dict[str, dict[str, Any]]] = {"quick": {}}
    profile: Profile = Field("quick", description="preset sizes: smoke (seconds, for tests), "
                             "quick (minutes on a laptop), full (real results, GPU-sized)",
                             json_schema_extra=RUN_ONLY)
    dataset: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    run: RunSection = Field(default_factory=RunSection)

    @classmethod
    def defaults(cls, values: dict[str, Any]) -> dict[str, Any]:
        return dict(cls.PROFILES.get(values.get("profile", "quick"), {}))


def comma_list(value: Any) -> Any:
    """A tuple from the command line's "a,b,c" (brackets around it and spaces around each
    part dropped; other values unchanged)."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.strip("()[] ").split(",") if part.strip())
    return value


T = TypeVar("T")
# The one list type of the configs: a tuple given in Python or JSON, or comma-separated on the
# command line (`--lr-range 0.005,0.3`, `--unseen-classes "Ankle boot,Bag"`).
CommaList = Annotated[T, BeforeValidator(comma_list)]
