"""A registry of image backbones, so configs name a network by a string.

Every registered builder takes `(in_channels, num_classes, width)` and returns an
`ImageClassifier`; names are unique (registering one twice is an error, not a silent override).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.nn import functional as F


class ImageClassifier(nn.Module):
    """Base of every registered network.

    Attributes:
        feature_layers: names of sub-modules whose outputs are meaningful features, shallow to
            deep; the last one is the embedding fed to the classifier. Hooks attach to these.
        depth: number of weighted layers (convolutions and linear layers) on the longest path,
            used to tell a deeper teacher from a shallower student.
        min_input_size: the smallest height and width the first layer sees. The networks are
            built for 28-pixel images, which they pool to 7 or 4 pixels; an 8-pixel image would
            be pooled to 2 or 1, throwing away what its pixels tell. Smaller inputs are
            upsampled (bilinear) to this size by `fit_input`, inside the network, so a model
            trained on small images serves the same small images.
    """

    feature_layers: tuple[str, ...] = ()
    min_input_size: int = 28

    def fit_input(self, x: Tensor) -> Tensor:
        """`x` upsampled (bilinear) to at least `min_input_size` in height and width."""
        height, width = x.shape[-2:]
        size = max(height, self.min_input_size), max(width, self.min_input_size)
        if (height, width) == size:
            return x
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)

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
