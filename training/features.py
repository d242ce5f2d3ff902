"""Features from named layers through forward hooks, so networks stay unchanged (torchdistill),
and a classifier exported as a program that returns its logits and its embedding."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn


class FeatureHooks:
    """Captures the outputs of named sub-modules during a forward pass.

    Use as a context manager: `with FeatureHooks(model, ["stage3"]) as feats: model(x)`, then
    `feats["stage3"]` holds that layer's output of the last forward pass. Hooks are removed on
    exit. An unknown layer name raises `KeyError` naming the valid ones.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], detach: bool = False) -> None:
        names = dict(model.named_modules())
        missing = [name for name in layers if name not in names]
        if missing:
            valid = getattr(model, "feature_layers", ()) or tuple(n for n in names if n)
            raise KeyError(f"no layer {missing} in {type(model).__name__}; try one of {valid}")
        self.detach = detach
        self.outputs: dict[str, Tensor] = {}
        self._handles = [names[name].register_forward_hook(self._hook(name)) for name in layers]

    def _hook(self, name: str):
        def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
            self.outputs[name] = output.detach() if self.detach else output

        return hook

    def __getitem__(self, name: str) -> Tensor:
        return self.outputs[name]

    def remove(self) -> None:
        """Detaches every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> FeatureHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def embedding_layer(model: nn.Module) -> str:
    """The layer whose output is the model's embedding: its last (deepest) feature layer."""
    layers = getattr(model, "feature_layers", ())
    if not layers:
        raise ValueError(f"{type(model).__name__} names no feature_layers to embed with")
    return layers[-1]


class WithEmbedding(nn.Module):
    """`model` whose forward returns `(logits, embedding)`: the embedding is the output of
    `layer` (default: `embedding_layer(model)`), flattened to N x D. Exported programs keep
    both, so one registered model both classifies and embeds."""

    def __init__(self, model: nn.Module, layer: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.layer = layer or embedding_layer(model)
        self._hooks = FeatureHooks(model, [self.layer])

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.model(x)
        return logits, self._hooks[self.layer].flatten(1)


def export_program(model: nn.Module, channels: int, size: int, path: Path) -> None:
    """Exports an eval-mode copy of `model` on the CPU, with a dynamic batch dimension; the
    program returns the logits and the embedding (`WithEmbedding`)."""
    model = model.to("cpu").eval()
    example = torch.zeros(2, channels, size, size)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    program = torch.export.export(WithEmbedding(model).eval(), (example,),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
