"""One training round, described once and trained the same way in this process or in each
process of a data-parallel job.

A `Round` holds everything a round trains from, as plain typed parts:

- `network`: how to build the network (`ClassifierNetwork`, a technique's own spec), so that
  another process can rebuild it before loading the state;
- `step`: the technique's step spec (`StepSpec`): the loss, the modules trained beside the
  network (a distillation adapter), the parameters the optimizer holds, and how data-parallel
  training wraps them. `ClassifyStep` here; each technique keeps its own in its package
  (`training.distill.losses.DistillStep`, `training.cascade.learning.ModuleStep`,
  `training.image_text.losses.ImageTextStep`, `training.canvas.CanvasStep`);
- `batches`: each pass's batches (`ImageBatches`: a new shuffle per pass, or one stream);
- the optimizer's settings, the passes with their cosine schedule, the weight average's decay
  and the activation-sparsity term (`training.sparsify.term.SparsityTerm`).

`train_passes(round, trainee, device)` trains it in this process. `training.ddp_round` gets the same
`Round` as a record (`to_record`: nested dicts of tensors, numbers and strings, which
`torch.load(weights_only=True)` reads back) and calls the same `train_passes` in every process, so
the step is built in one place for both paths.

`classifier_round` and `configured_round` build a round from a flow's config (a
`ClassifierConfig` or any config with its `optim`, `network` and `run` sections, read only).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from models import ImageClassifier, build_model
from training.batches import Batches, Normalize, RecordedViews
from training.datasets import LoadedDataset
from training.distributed import Distributed, wrap
from training.loops import Step, classification_step
from training.recipe import train_round
from training.settings import ClassifierSettings, DatasetShape, OptimizedSettings

SINGLE = Distributed()  # this process alone
_SPEC = "__spec__"  # a record's key naming the dataclass it rebuilds
_STATE = "__state__"  # a record's key naming the class whose `from_state_dict` rebuilds it
_RECORD_PACKAGES = ("training.", "models.")  # where a record may name a class


class NetworkSpec(Protocol):
    """How to build a round's network (untrained; its state is loaded after)."""

    def build(self) -> nn.Module: ...


class StepSpec(Protocol):
    """A technique's training step, built the same way in one process and in a DDP job."""

    def extras(self) -> dict[str, nn.Module]:
        """The modules trained beside the network (built fresh; states are loaded after)."""
        ...

    def parameters(self, model: nn.Module, extras: dict[str, nn.Module]
                   ) -> list[nn.Parameter]:
        """The parameters the optimizer holds, in its order."""
        ...

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        """What `training.recipe.train_round` steps (wrapped for DDP where `place` has more
        than one process) and the step; hooks it needs are entered on `stack`."""
        ...


class Passes(Protocol):
    """A round's batches: `for_passes(device, place)` gives `pass -> Batches`."""

    def for_passes(self, device: torch.device, place: Distributed
                   ) -> Callable[[int], Any]: ...


@dataclass(frozen=True)
class ClassifierNetwork:
    """A registered network (`models.build_model`)."""

    model: str
    channels: int
    classes: int
    width: int | None = None

    def build(self) -> nn.Module:
        return build_model(self.model, self.channels, self.classes, self.width)


class ModelStep:
    """The defaults of a step spec that trains the network alone."""

    def extras(self) -> dict[str, nn.Module]:
        return {}

    def parameters(self, model: nn.Module, extras: dict[str, nn.Module]
                   ) -> list[nn.Parameter]:
        return [p for module in (model, *extras.values()) for p in module.parameters()]


class StepModel(nn.Module):
    """`step(model, ids, x, y)` as a module's forward, so that DDP sees the whole step (whose
    loss may call parts of `model` other than its forward, as the cascade's and image-text's
    do) and averages the gradients of every parameter it reaches."""

    def __init__(self, model: nn.Module, step: Step) -> None:
        super().__init__()
        self.model, self.step = model, step

    def forward(self, ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        return self.step(self.model, ids, x, y)


def call_model(model: nn.Module, ids: Tensor, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """The step of a `StepModel` (or its DDP wrapper): its forward."""
    return model(ids, x, y)


def whole_step(model: nn.Module, step: Step, device: torch.device, place: Distributed
               ) -> tuple[nn.Module, Step]:
    """`model` and `step` as `train_round` takes them: unchanged in one process; in a DDP job
    the step wrapped as one module (`StepModel`), some of whose parameters may get no
    gradient in a step (a sub-loss of weight 0, a route not taken)."""
    if place.world_size == 1:
        return model, step
    return wrap(StepModel(model, step), device, place, find_unused=True), call_model


@dataclass(frozen=True)
class ClassifyStep(ModelStep):
    """Cross-entropy on the labels (`training.loops.classification_step`)."""

    label_smoothing: float = 0.0

    def open(self, model: nn.Module, extras: dict[str, nn.Module], device: torch.device,
             place: Distributed, stack: ExitStack) -> tuple[nn.Module, Step]:
        return wrap(model, device, place), classification_step(self.label_smoothing)


@dataclass(frozen=True)
class ImageBatches:
    """Shuffled, augmented batches over `positions` of `images`: a new shuffle per pass from
    that pass's seed (`seeds`, in pass order), or one stream drawn pass after pass from
    `stream_seed` (a distillation stage). A short last batch is dropped, so BatchNorm never
    sees a batch of one; in a DDP job each process takes its share of every batch. `views`:
    recorded views shown in place of their images' draws (a consistent bank's)."""

    images: Tensor
    labels: Tensor
    positions: Tensor
    batch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: float
    flip: bool
    passes: tuple[int, ...]
    seeds: tuple[int, ...] | None = None
    stream_seed: int | None = None
    views: RecordedViews | None = None

    def __post_init__(self) -> None:
        if (self.seeds is None) == (self.stream_seed is None):
            raise ValueError("ImageBatches needs either seeds (one per pass) or stream_seed")
        if self.seeds is not None and len(self.seeds) != len(self.passes):
            raise ValueError(f"{len(self.seeds)} seeds for {len(self.passes)} passes")

    def batches(self, seed: int, device: torch.device, place: Distributed) -> Batches:
        return Batches(self.images, self.labels, self.positions, self.batch_size,
                       Normalize(self.mean, self.std), shuffle=True, seed=seed,
                       augment=self.augment, drop_last=True, device=device,
                       rank=place.rank, world_size=place.world_size, flip=self.flip,
                       views=self.views)

    def for_passes(self, device: torch.device, place: Distributed
                   ) -> Callable[[int], Batches]:
        if self.seeds is None:
            stream = self.batches(self.stream_seed, device, place)
            return lambda _pass: stream
        seeds = dict(zip(self.passes, self.seeds, strict=True))
        return lambda pass_index: self.batches(seeds[pass_index], device, place)


@dataclass(frozen=True)
class Round:
    """Everything one round trains from (see the module docstring). `network` is None for a
    round that only trains in this process (its batches have no per-process shares)."""

    network: NetworkSpec | None
    step: StepSpec
    batches: Passes
    passes: tuple[int, ...]
    schedule: tuple[int, int]
    lr: float
    momentum: float
    weight_decay: float
    warmup_epochs: float = 0.0
    grad_clip: float | None = None
    average_decay: float | None = None
    sparsity: Any = None  # training.sparsify.term.SparsityTerm
    progress: str | None = None


@dataclass
class Trainee:
    """The live state a round trains: the network, the modules beside it, the optimizer over
    `round.step.parameters(...)` and the weight average, if any."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    extras: dict[str, nn.Module] = field(default_factory=dict)
    averaged: AveragedModel | None = None


def train_passes(round_: Round, trainee: Trainee, device: torch.device,
                 place: Distributed = SINGLE) -> dict[str, float]:
    """Trains `round_`'s passes (`training.recipe.train_round`) and returns the last pass's
    losses; `trainee` is left trained."""
    with ExitStack() as stack:
        trained, step = round_.step.open(trainee.model, trainee.extras, device, place, stack)
        if round_.sparsity is not None:
            step = stack.enter_context(round_.sparsity.regularized(step, trainee.model))
        return train_round(trained, trainee.optimizer, round_.batches.for_passes(device, place),
                           step, device, round_.passes,
                           round_.lr, round_.schedule, round_.warmup_epochs, round_.grad_clip,
                           round_.progress, trainee.averaged)


def to_record(value: Any) -> Any:
    """`value` as nested dicts, lists, tensors, numbers and strings: a dataclass becomes its
    fields with its class named under `__spec__`, an object with `state_dict` and
    `from_state_dict` (a feature bank) its state under `__state__`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {_SPEC: _class_name(value), **{
            f.name: to_record(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if hasattr(value, "from_state_dict") and hasattr(value, "state_dict"):
        return {_STATE: _class_name(value), "state": value.state_dict()}
    if isinstance(value, dict):
        return {key: to_record(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_record(item) for item in value]
    return value


def from_record(value: Any) -> Any:
    """The object `to_record` described (a dataclass's sequences come back as tuples)."""
    if isinstance(value, dict) and _SPEC in value:
        cls = _named_class(value[_SPEC])
        return cls(**{key: _as_field(from_record(item)) for key, item in value.items()
                      if key != _SPEC})
    if isinstance(value, dict) and _STATE in value:
        return _named_class(value[_STATE]).from_state_dict(value["state"])
    if isinstance(value, dict):
        return {key: from_record(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_record(item) for item in value]
    return value


def _as_field(value: Any) -> Any:
    """A dataclass field back as written: a spec's sequences are tuples, at any depth."""
    return tuple(_as_field(item) for item in value) if isinstance(value, list) else value


def _class_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}:{cls.__qualname__}"


def _named_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_RECORD_PACKAGES):
        raise ValueError(f"a round record may only name training or models classes, "
                         f"not {name!r}")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


@dataclass
class Opened:
    """A resumed round: what it trains, how, and what the plan keeps for `close`."""

    trainee: Trainee
    round: Round
    context: dict[str, Any] = field(default_factory=dict)


@dataclass
class Closed:
    """A trained round: its metrics, the checkpoint's content, and the kept weights' name."""

    metrics: dict[str, float]
    payload: dict[str, Any]
    kept: str = "model"


def new_model(config: ClassifierSettings, dataset: DatasetShape) -> ImageClassifier:
    """The configured network for the data set, initialised from the seed."""
    torch.manual_seed(config.run.seed)
    return build_model(config.network.model, dataset.channels, len(dataset.classes),
                       config.network.width)


def image_batches(config: ClassifierSettings, dataset: DatasetShape, data: LoadedDataset,
                  positions: torch.Tensor, batch_size: int, passes: Sequence[int],
                  seeds: Sequence[int] | None = None, stream_seed: int | None = None,
                  views: RecordedViews | None = None) -> ImageBatches:
    """A round's shuffled batches over `positions` (`training.rounds.ImageBatches`) with the
    data set's normalisation and `config`'s augmentation and flips: a shuffle per pass from
    `seeds`, or one stream from `stream_seed`; `views` shown in place of their images' draws."""
    return ImageBatches(data.images, data.labels, positions, batch_size, tuple(dataset.mean),
                        tuple(dataset.std), config.optim.augment, config.optim.flips(),
                        tuple(passes),
                        seeds=None if seeds is None else tuple(seeds), stream_seed=stream_seed,
                        views=views)


def configured_round(config: OptimizedSettings, network: NetworkSpec | None, step: StepSpec,
                     batches: Passes, passes: Sequence[int], schedule: tuple[int, int],
                     warmup_epochs: float, **optional: Any) -> Round:
    """A `training.rounds.Round` of `passes` with `config`'s optimizer settings (learning
    rate, momentum, weight decay, gradient clip); `optional`: the round's other fields
    (weight average, sparsity term, progress)."""
    return Round(network=network, step=step, batches=batches, passes=tuple(passes),
                 schedule=schedule, lr=config.optim.lr, momentum=config.optim.momentum,
                 weight_decay=config.optim.weight_decay, warmup_epochs=warmup_epochs,
                 grad_clip=config.optim.grad_clip, **optional)


def classifier_network(config: ClassifierSettings, dataset: DatasetShape) -> ClassifierNetwork:
    """The network spec of `config`'s classifier for the data set (`new_model` builds it)."""
    return ClassifierNetwork(config.network.model, dataset.channels, len(dataset.classes),
                             config.network.width)


def classifier_round(config: ClassifierSettings, dataset: DatasetShape, data: LoadedDataset,
                     passes: range, schedule: tuple[int, int], warmup_epochs: float = 0.0,
                     progress: str | None = None, average_decay: float | None = None,
                     sparsity: Any = None) -> Round:
    """`passes` of a classifier over the training split (`training.rounds.Round`): each pass
    shuffled and augmented from its own seed, on the cosine schedule `schedule`; `sparsity`
    adds its activation-sparsity term to the loss (`training.sparsify.term`), `average_decay`
    a weight average."""
    return configured_round(
        config, classifier_network(config, dataset), ClassifyStep(config.optim.label_smoothing),
        image_batches(config, dataset, data, data.splits["train"], config.optim.batch_size, passes,
                      seeds=[config.run.seed * 1000 + n for n in passes]),
        passes, schedule, warmup_epochs, average_decay=average_decay,
        sparsity=None if sparsity is None else sparsity.term(), progress=progress)
