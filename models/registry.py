"""A registry of image backbones, so configs name a network by a string.

Every registered builder takes `(in_channels, num_classes, width)` and returns an
`ImageClassifier`; names are unique (registering one twice is an error, not a silent override).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


class ImageClassifier(nn.Module):
    """Base of every registered network.

    Attributes:
        feature_layers: names of sub-modules whose outputs are meaningful features, shallow to
            deep; the last one is the embedding fed to the classifier. Hooks attach to these.
        depth: number of weighted layers (convolutions and linear layers) on the longest path,
            used to tell a deeper teacher from a shallower student.
    """

    feature_layers: tuple[str, ...] = ()

    @property
    def depth(self) -> int:
        """Convolutions wider than 1x1 plus linear layers (shortcut projections do not count)."""
        return sum(
            1
            for m in self.modules()
            if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1))
        )


Builder = Callable[[int, int, int], ImageClassifier]


@dataclass(frozen=True)
class ModelEntry:
    """A registered network: its builder, family and default width."""

    name: str
    family: str
    default_width: int
    builder: Builder


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(name: str, family: str, default_width: int) -> Callable[[Builder], Builder]:
    """Decorator that registers a builder under `name`; duplicate names raise `ValueError`."""

    def decorate(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = ModelEntry(name, family, default_width, builder)
        return builder

    return decorate


def list_models() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def model_entry(name: str) -> ModelEntry:
    """The entry for `name`, or a `KeyError` that lists the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(list_models())}") from None


def build_model(
    name: str, in_channels: int, num_classes: int, width: int | None = None
) -> ImageClassifier:
    """Builds the registered network `name` (width defaults to the model's own)."""
    entry = model_entry(name)
    if in_channels < 1 or num_classes < 2:
        raise ValueError(f"need in_channels >= 1 and num_classes >= 2, got {in_channels}, "
                         f"{num_classes}")
    return entry.builder(in_channels, num_classes, width or entry.default_width)
