"""What the training floor reads from a run's configuration and its data set, as protocols.

`tasks.configs` (a config's `network`, `optim` and `run` sections) and `tasks.data.DatasetRef`
satisfy them structurally: `training/` names the fields it reads without importing the floor
above it, and a reader sees at the signature which settings a function takes. Properties, so
that frozen pydantic models satisfy them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class NetworkSettings(Protocol):
    """Which registered network and at what width (`tasks.configs.sections.ModelSection`)."""

    @property
    def model(self) -> str: ...

    @property
    def width(self) -> int | None: ...


class OptimSettings(Protocol):
    """The optimizer, the augmentation and the budget (`tasks.configs.sections.OptimSection`)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def lr(self) -> float: ...

    @property
    def momentum(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def label_smoothing(self) -> float: ...

    @property
    def augment(self) -> float: ...

    @property
    def grad_clip(self) -> float | None: ...

    @property
    def warmup_rounds(self) -> float: ...

    @property
    def min_steps(self) -> int | None: ...

    @property
    def min_steps_full_below(self) -> int | None: ...

    @property
    def max_epochs(self) -> int: ...

    def flips(self) -> bool: ...


class RunSettings(Protocol):
    """The seed, threads and device of a run (`tasks.configs.sections.RunSection`)."""

    @property
    def seed(self) -> int: ...

    @property
    def threads(self) -> int | None: ...

    @property
    def device(self) -> str: ...

    @property
    def progress(self) -> bool: ...


class RunsSettings(Protocol):
    """A config with a `run` section."""

    @property
    def run(self) -> RunSettings: ...


class OptimizedSettings(Protocol):
    """A config with an `optim` section."""

    @property
    def optim(self) -> OptimSettings: ...


class ClassifierSettings(RunsSettings, OptimizedSettings, Protocol):
    """A classifier's network, optimizer and run (`tasks.configs.sections.ClassifierConfig`,
    and every flow config that trains one)."""

    @property
    def network(self) -> NetworkSettings: ...


class RoleSettings(ClassifierSettings, Protocol):
    """A distillation role, the teacher or the student (`tasks.distill.RoleConfig`): its
    stages, the passes of each and its draw from the data queue."""

    @property
    def role(self) -> str: ...

    @property
    def rounds(self) -> int: ...

    @property
    def repeats(self) -> int: ...

    @property
    def fraction(self) -> float: ...

    @property
    def front_weight(self) -> float: ...

    @property
    def back_weight(self) -> float: ...

    @property
    def queue(self) -> str: ...


class StudentSettings(RoleSettings, Protocol):
    """The student role, with the layer its features come from (`tasks.distill.StudentConfig`)."""

    @property
    def layer(self) -> str: ...


class BankSettings(Protocol):
    """What the feature bank stores and how it starts (`tasks.distill.BankConfig`)."""

    @property
    def layer(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def initial(self) -> str: ...

    @property
    def views(self) -> str: ...

    @property
    def average(self) -> str: ...


class PopulationSettings(RunsSettings, Protocol):
    """The search space and exploration of a population (`tasks.configs.pbt.PBTConfig`)."""

    @property
    def lr_range(self) -> tuple[float, float]: ...

    @property
    def weight_decay_range(self) -> tuple[float, float]: ...

    @property
    def momentum_range(self) -> tuple[float, float]: ...

    @property
    def augment_range(self) -> tuple[float, float]: ...

    @property
    def explore_factors(self) -> tuple[float, float]: ...

    @property
    def explore_step(self) -> float: ...

    @property
    def tie_margin(self) -> float | None: ...

    @property
    def explore(self) -> bool: ...


class DatasetShape(Protocol):
    """What a network and its batches need of a prepared data set (`tasks.data.DatasetRef`)."""

    @property
    def classes(self) -> list[str]: ...

    @property
    def channels(self) -> int: ...

    @property
    def image_size(self) -> int: ...

    @property
    def mean(self) -> Sequence[float]: ...

    @property
    def std(self) -> Sequence[float]: ...

    @property
    def sizes(self) -> Mapping[str, int]: ...
